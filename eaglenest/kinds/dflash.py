"""The DFlash kind (arXiv 2602.06036): a block drafter over any number of target layers, one forward
per block (the model: draft/dflash.py; its objective: train/objective.py DFlashObjective; its
decoder: evaluate/dflash.py).  Its checkpoint is the format vLLM 0.32 loads (`method: "dflash"`),
read back by eaglenest's own decoder.

DRAFT_DIR/config.json (read by vLLM's qwen3_dflash.py / v1/spec_decode/dflash.py, SGLang's
dflash_utils.parse_dflash_draft_config):
  architectures ["DFlashDraftModel"], model_type "qwen3" (a Qwen3Config: q/k norms, no bias),
  num_hidden_layers = the draft's layers, the layer shape, the target's rope, vocab_size,
  draft_vocab_size, target_hidden_size, block_size (vLLM serves num_speculative_tokens =
  block_size - 1), dflash_config {mask_token_id, target_layer_ids (output-of: both engines capture
  before id + 1; export/layer_ids.py), causal: false, use_swa: false}, num_target_layers, and our
  own `eaglenest` block (engines ignore unknown keys).
DRAFT_DIR/model.safetensors, keys exactly:
  fc.weight [H, n*H_t], hidden_norm.weight, norm.weight,
  layers.N.{input_layernorm, post_attention_layernorm}.weight,
  layers.N.self_attn.{q,k,v,o}_proj.weight, layers.N.self_attn.{q,k}_norm.weight [head_dim],
  layers.N.mlp.{gate,up,down}_proj.weight, lm_head.weight [draft_vocab, H],
  d2t (int64) + t2d (bool) only with a reduced vocabulary (vLLM maps d2t to draft_id_to_target_id
  and skips t2d; with the full vocabulary it has no parameter for d2t) -- never embed_tokens (both
  engines then use the target's; the MASK slot is the target's embedding of mask_token_id).
"""

from __future__ import annotations

import torch

from eaglenest import EaglenestError
from eaglenest.draft.dflash import DFlashConfig
from eaglenest.kinds.common import WEIGHT_DTYPE, config_from_hf, judge_shape_fit, judge_tensors, layer_config
from eaglenest.kinds.registry import DraftKind, register

# --- target layers -------------------------------------------------------------------------------------
# Both engines read a DFlash draft's `dflash_config.target_layer_ids` output-of (id i = the output
# of target layer i) and capture before layer i + 1, whatever the target class: vLLM 0.32
# (gpu_model_runner._get_eagle3_aux_layers_from_config: `i + 1`, read only when no top-level
# eagle_aux_hidden_state_layer_ids is present; the layer loop captures before layers 0..N) and
# SGLang 0.5.23 (set_dflash_layers_to_capture in llama.py / qwen3.py: `val + 1`;
# dflash_utils.resolve_target_layer_ids refuses ids outside 0..N-1).
# target classes whose SGLang 0.5.23 model file defines set_dflash_layers_to_capture with that
# `val + 1` rule (llama.py, also Mistral's; qwen3.py; qwen3_moe.py; deepseek_v2.py, also Kimi-K2 and
# Kimi-K2.5; glm4_moe_lite.py; gpt_oss.py); qwen2.py, qwen2_moe.py, glm4_moe.py, minimax_m2.py,
# gemma3_causal.py define none: SGLang cannot serve a DFlash draft on those targets.
SGLANG_DFLASH_CLASSES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "Glm4MoeLiteForCausalLM", "GptOssForCausalLM",
})


def dflash_target_layer_ids(trained: list[int], n: int) -> list[int]:
    """The `dflash_config.target_layer_ids` that make both engines capture exactly `trained`
    (capture-before ids 1..N-1 for an N-layer target: eaglenest captures and decodes at a decoder
    layer's input, so the last layer's output, id N, is not offered); refused otherwise."""
    bad = [k for k in trained if not 1 <= k <= n - 1]
    if bad or sorted(set(trained)) != list(trained):
        raise EaglenestError(f"DFlash target layers {list(trained)} (capture-before): must be strictly increasing ids in 1..{n - 1} "
                             f"for a {n}-layer target (dflash_config.target_layer_ids = id - 1)")
    return [k - 1 for k in trained]


def dflash_trained_layers(config: dict) -> list[int]:
    """The capture-before layers a DFlash draft's config makes the engines capture (see above)."""
    ids = (config.get("dflash_config") or {}).get("target_layer_ids") or config.get("target_layer_ids") or []
    return [int(i) + 1 for i in ids]


def check_dflash_config(cfg: DFlashConfig) -> None:
    """A DFlash config that cannot be trained, served or exported is refused here, by field."""
    if cfg.block_size < 2:
        raise EaglenestError(f"--block-size must be at least 2 (an anchor and one drafted token), got {cfg.block_size}")
    if cfg.num_hidden_layers < 1:
        raise EaglenestError(f"--draft-layers must be at least 1, got {cfg.num_hidden_layers}")
    if not cfg.aux_layer_ids:
        raise EaglenestError("a DFlash draft needs at least one target layer")
    if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise EaglenestError(f"DFlash mask_token_id {cfg.mask_token_id} is not a token id of the target (0..{cfg.vocab_size - 1})")


def default_mask_token_id(model) -> int:
    """The MASK slot's token when none is given: the tokenizer's own mask token, else its last
    special token that no chat turn contains and that is not bos/eos/pad/unk (SmolLM2: 16,
    <empty_output>).  Its embedding is the target's, frozen: what matters is that a real anchor
    never looks like a mask slot, so a token that never occurs in text is the right one."""
    from eaglenest.models.target import load_tokenizer, special_token_ids

    tok = load_tokenizer(model)
    if tok.mask_token_id is not None:
        return int(tok.mask_token_id)
    used = {getattr(tok, f"{n}_token_id") for n in ("bos", "eos", "pad", "unk")}
    try:
        text = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                        {"role": "assistant", "content": "a"}], tokenize=False)
        used |= set(tok(text, add_special_tokens=True)["input_ids"])
    except Exception:  # noqa: BLE001 -- a tokenizer without a chat template: bos/eos/pad/unk only
        pass
    special = sorted(i for i in special_token_ids(tok) if i not in used and i < len(tok))
    if not special:
        raise EaglenestError(f"{model}: the tokenizer has no mask token and no unused special token: pass --mask-token-id "
                             "(a token id that never occurs in the data)")
    return special[-1]


def dflash_config(tcfg, draft_vocab_size: int, layer_ids: list[int], opts) -> DFlashConfig:
    """The DFlash config of a run: the target `tcfg`'s shape and vocabulary (DraftConfig.from_target)
    with the block options of `opts` (TrainConfig: draft_shape, block_size, draft_layers,
    mask_token_id, model)."""
    mask = opts.mask_token_id if opts.mask_token_id is not None else default_mask_token_id(opts.model)
    cfg = DFlashConfig.from_target(tcfg, draft_vocab_size, layer_ids, shape=opts.draft_shape, block_size=int(opts.block_size),
                                   num_hidden_layers=int(opts.draft_layers), mask_token_id=int(mask))
    check_dflash_config(cfg)
    return cfg


ARCHITECTURE = "DFlashDraftModel"


def expected_tensors(cfg: DFlashConfig, weight_dtype=WEIGHT_DTYPE) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    w = weight_dtype
    out = {
        "fc.weight": ((H, len(cfg.aux_layer_ids) * cfg.target_hidden_size), w),
        "hidden_norm.weight": ((H,), w),
        "norm.weight": ((H,), w),
        "lm_head.weight": ((cfg.draft_vocab_size, H), w),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": ((H,), w),
            p + "post_attention_layernorm.weight": ((H,), w),
            p + "self_attn.q_proj.weight": ((q, H), w),
            p + "self_attn.k_proj.weight": ((kv, H), w),
            p + "self_attn.v_proj.weight": ((kv, H), w),
            p + "self_attn.o_proj.weight": ((H, q), w),
            p + "self_attn.q_norm.weight": ((hd,), w),
            p + "self_attn.k_norm.weight": ((hd,), w),
            p + "mlp.gate_proj.weight": ((I, H), w),
            p + "mlp.up_proj.weight": ((I, H), w),
            p + "mlp.down_proj.weight": ((H, I), w),
        })
    if cfg.draft_vocab_size < cfg.vocab_size:
        out.update({"d2t": ((cfg.draft_vocab_size,), torch.int64), "t2d": ((cfg.vocab_size,), torch.bool)})
    return out


def hf_config(cfg: DFlashConfig, extra: dict | None = None, engines=("vllm",)) -> dict:
    """config.json; refuses (EaglenestError) target layers the engines cannot capture."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        **layer_config(cfg, extra, engines),
        "num_target_layers": cfg.target_num_layers,
        "block_size": cfg.block_size,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": dflash_target_layer_ids(cfg.aux_layer_ids, cfg.target_num_layers),
            "causal": False,  # non-causal inside the block, as trained
            "use_swa": False,
        },
        "attention_dropout": 0.0,
        "use_sliding_window": False,
    }


def read_config(raw: dict, draft_dir) -> DFlashConfig:
    """A DFlash config.json written by another trainer (SpecForge, z-lab) as a DFlashConfig: target
    layers from dflash_config.target_layer_ids (output-of -> capture-before), block_size and
    mask_token_id top-level or in dflash_config."""
    dc = raw.get("dflash_config") or {}
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in raw]
    if missing:
        raise EaglenestError(f"{draft_dir}/config.json: missing {', '.join(missing)}: not a DFlash draft config")
    block = raw.get("block_size", dc.get("block_size"))
    mask = dc.get("mask_token_id", raw.get("mask_token_id"))
    if block is None or mask is None:
        raise EaglenestError(f"{draft_dir}/config.json: a DFlash draft needs block_size and dflash_config.mask_token_id "
                             f"(got {block!r}, {mask!r})")
    return config_from_hf(DFlashConfig, raw, aux_layer_ids=dflash_trained_layers(raw),
                          target_num_layers=int(raw.get("num_target_layers") or 0),
                          num_hidden_layers=int(raw.get("num_hidden_layers", 1)), block_size=int(block), mask_token_id=int(mask))


def judge(r, raw: dict, cfg: DFlashConfig, tensors: dict | None, model=None, trained: list[int] | None = None) -> None:
    """check-draft for a DFlash draft (export/check.py's Report `r`, per consumer): what vLLM 0.32
    (qwen3_dflash.py) and SGLang 0.5.23 (srt/models/dflash.py, GPU-only here) do with it, and whether
    eaglenest's own decoder (evaluate/dflash.py) runs it."""
    r.notes.append("DFlash draft (block drafter): served by vLLM 0.32 with method \"dflash\", num_speculative_tokens = "
                   f"block_size - 1 = {cfg.block_size - 1}; SGLang 0.5.23 serves DFLASH on a GPU only (Triton kernels), "
                   "not run here")
    archs = raw.get("architectures") or []
    if ARCHITECTURE not in archs:
        r.error(f"config.json: architectures {archs!r}: the engines resolve DFlash drafts as {ARCHITECTURE}", ["vllm", "sglang"])
    if not raw.get("model_type"):
        r.error("config.json: no model_type: vLLM builds the draft's config with transformers' AutoConfig (ours: qwen3)", ["vllm"])
    dc = raw.get("dflash_config") or {}
    if "block_size" not in raw and "block_size" not in dc:
        r.error("config.json: no block_size (SGLang defaults to 16; the draft was trained on one block size)", ["sglang", "hf"])
    if dc.get("mask_token_id") is None:
        r.error("config.json: no dflash_config.mask_token_id: vLLM feeds masked slots token 0")
    elif not 0 <= int(dc["mask_token_id"]) < cfg.vocab_size:
        r.error(f"dflash_config.mask_token_id {dc['mask_token_id']} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    if dc.get("causal") or raw.get("is_causal") or dc.get("use_swa") or "sliding_attention" in (raw.get("layer_types") or []):
        r.error("causal or sliding-window draft attention: eaglenest's decoder drafts non-causal full-attention blocks", ["hf"])
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        r.notes.append("a top-level eagle_aux_hidden_state_layer_ids: vLLM captures those instead of dflash_config.target_layer_ids")
    if tensors is not None:
        shared_head = cfg.draft_vocab_size == cfg.vocab_size and "lm_head.weight" not in tensors
        if shared_head:  # SpecForge's / z-lab's drafts: no head of their own
            r.notes.append("no lm_head.weight: vLLM, SGLang and eaglenest's decoder use the target's lm_head")
        judge_tensors(r, cfg, tensors, optional=("lm_head.weight",) if shared_head else ())
        if cfg.draft_vocab_size < cfg.vocab_size:
            r.error("a reduced draft vocabulary (lm_head + d2t): SGLang 0.5.23's DFLASH has no draft head, it proposes with the "
                    "target's lm_head, not the trained one", ["sglang"])
    if model is None:
        return
    from eaglenest.export.layer_ids import VLLM_EAGLE3_CLASSES
    from eaglenest.models.target import target_facts

    t = target_facts(model)
    n = t.num_layers
    judge_shape_fit(r, raw, cfg, t, "eaglenest" in raw)
    if tensors is not None and cfg.draft_vocab_size == cfg.vocab_size and "lm_head.weight" in tensors and t.vocab_size == cfg.vocab_size:
        from eaglenest.models.weights import target_head

        if not torch.equal(tensors["lm_head.weight"].float(), target_head(model)["lm_head"].float()):
            r.error("lm_head.weight differs from the target's: SGLang 0.5.23's DFLASH proposes with the target's lm_head", ["sglang"])
    ids = list(trained) if trained else list(cfg.aux_layer_ids)
    r.notes.append(f"trained on target layers {ids} (capture-before)")
    if not ids or any(not 1 <= k <= n - 1 for k in ids) or sorted(set(ids)) != ids:
        r.error(f"target layers {ids} are not increasing capture-before ids in 1..{n - 1} for a {n}-layer target "
                "(eaglenest captures at a decoder layer's input)", ["hf"])
    if not ids or any(not 1 <= k <= n for k in ids) or sorted(set(ids)) != ids:
        r.error(f"target layers {ids} are not increasing capture-before ids in 1..{n} for a {n}-layer target", ["vllm", "sglang"])
        return
    got = dflash_trained_layers(raw)
    vllm_got = list(raw.get("eagle_aux_hidden_state_layer_ids") or got)
    if vllm_got != ids:
        r.error(f"would capture before layers {vllm_got}, the draft was trained on {ids}", ["vllm"])
    if got != ids:
        r.error(f"would capture before layers {got} (dflash_config.target_layer_ids + 1), the draft was trained on {ids}", ["sglang"])
    if t.architecture not in VLLM_EAGLE3_CLASSES:
        r.error(f"vLLM 0.32: target class {t.architecture} does not provide aux hidden states (SupportsEagle3): no DFlash draft on it",
                ["vllm"])
    if t.architecture not in SGLANG_DFLASH_CLASSES:
        r.error(f"SGLang 0.5.23: target class {t.architecture} has no set_dflash_layers_to_capture: no DFlash draft on it", ["sglang"])


class DFlashKind(DraftKind):
    name = "dflash"
    title = "a DFlash draft"
    online_layers = "dflash"  # the engine captures DFlash's default layers (capture/layers.py)
    default_init_head = "zero"  # setup.init_weights: mask slots start as a special token's embedding
    needs_teacher = False  # trains on hard labels
    default_engines = ("vllm",)  # SGLang serves DFlash on GPUs only, with the target's lm_head
    vllm_method = "dflash"
    sglang_algorithm = "DFLASH"  # srt/models/dflash.py (Triton kernels: GPU only)
    config_class = DFlashConfig

    def check_train_options(self, tc) -> None:
        if tc.block_size < 2:
            raise EaglenestError(f"--block-size must be at least 2 (an anchor and one drafted token), got {tc.block_size}")
        if tc.fc_norm or tc.norm_output or tc.draft_attention != "gqa":
            raise EaglenestError("--fc-norm, --norm-output and --draft-attention mla are EAGLE-3 draft options; a DFlash draft "
                                 "has none of them (vLLM 0.32's DFlash model reads neither)")
        if tc.loss != "ce":
            raise EaglenestError(f"--loss {tc.loss}: the acceptance losses train the EAGLE-3 head against the target's "
                                 "distribution; a DFlash draft trains on hard labels (--dflash-loss ce or dpace)")

    def train_config(self, tcfg, draft_vocab_size, layer_ids, tc):
        return dflash_config(tcfg, draft_vocab_size, layer_ids, tc)

    def model(self, cfg, embed_weight=None):
        from eaglenest.draft.dflash import DFlashDraft

        check_dflash_config(cfg)
        return DFlashDraft(cfg, embed_weight=embed_weight)

    def init_model(self, model, qk_gain: float = 1.0) -> None:
        from eaglenest.draft.dflash import sharpen_attention

        sharpen_attention(model, qk_gain)

    def objective(self, tc, cfg, *, teacher, device, autocast, attn, recompute, argmax_room):
        from eaglenest.train.objective import DFlashObjective

        return DFlashObjective(cfg.block_size, tc.dflash_anchors, seed=tc.seed, device=device, autocast=autocast,
                               decay=tc.dflash_decay, loss=tc.dflash_loss, dpace_alpha=tc.dpace_alpha,
                               logits_chunk=tc.logits_chunk)

    def bind_objective(self, objective, model) -> None:
        objective.bind(model.t2d)

    def step_denominators(self, objective, data, step):
        return sum((objective.denominators(b, step) for b in data.batches), torch.zeros(2, dtype=torch.float64))

    def serve_steps(self, positions: int, tc) -> int:
        return positions  # a block drafts its positions per round

    def export_extra(self, train: dict) -> dict:
        return {"dflash_anchors": train.get("dflash_anchors"), "dflash_loss": train.get("dflash_loss")}

    def expected_tensors(self, cfg) -> dict:
        return expected_tensors(cfg)

    def hf_config(self, cfg, extra, engines) -> dict:
        return hf_config(cfg, extra, engines)

    def claims(self, raw: dict) -> bool:
        return ARCHITECTURE in (raw.get("architectures") or []) or "dflash_config" in raw

    def read_config(self, raw, draft_dir):
        return read_config(raw, draft_dir)

    def complete_tensors(self, cfg, tensors: dict, lm_head_weight) -> None:
        # the engines serve a draft without lm_head (SpecForge's, z-lab's) with the target's
        if "lm_head.weight" not in tensors and lm_head_weight is not None and cfg.draft_vocab_size == cfg.vocab_size:
            tensors["lm_head.weight"] = lm_head_weight.detach()

    def layout(self, cfg) -> str:
        return "DFlash"

    def judge(self, r, raw, cfg, tensors, model=None, trained=None) -> None:
        judge(r, raw, cfg, tensors, model, trained)

    def check_fits(self, cfg, num_layers: int, where: str) -> None:
        # any number of target layers, each a decoder layer's input (capture-before 1..N-1)
        ids, N = list(cfg.aux_layer_ids), num_layers
        if not ids or any(not 1 <= k < N for k in ids) or sorted(set(ids)) != ids:
            raise EaglenestError(f"{where} target layers {ids} do not fit a {N}-layer target (increasing capture-before ids in 1..{N - 1})")

    def eval_steps(self, args, cfg, given) -> int:
        """block_size - 1: one block per round, in a chain; any other --steps is refused (a shorter
        block would not be the function the draft was trained as)."""
        n = cfg.block_size - 1
        if int(args.topk) != 1:
            raise EaglenestError(f"a DFlash draft proposes one block per round (a chain): --topk must be 1 (got {args.topk})")
        if given is not None and int(given) != n:
            raise EaglenestError(f"--draft {args.draft}: a DFlash draft with block_size {cfg.block_size} drafts {n} tokens per "
                                 f"round; --steps {given} cannot be run with it (pass --steps {n} or leave it out)")
        if args.num_draft_tokens not in (None, n + 1):
            raise EaglenestError(f"a DFlash draft verifies block_size = {n + 1} tokens per round (got --num-draft-tokens {args.num_draft_tokens})")
        return n

    def decoder(self, target, draft, eos, args, *, num_draft_tokens, temperature, draft_sampling):
        from eaglenest.evaluate.dflash import DFlashDecoder

        return DFlashDecoder(target, draft, eos, temperature=temperature, seed=args.seed)


KIND = register(DFlashKind())
