"""The EAGLE-3 kind: one decoder layer over three fused target states, drafted step by step
(chain or tree), trained with the training-time test.  EAGLE 3.1 (`fc_norm`, `norm_output`) and
the MLA attention (`attention: mla`) are options of this kind, not kinds of their own.

Its checkpoint is the portable layout both SGLang and vLLM load:
DRAFT_DIR/config.json + DRAFT_DIR/model.safetensors, keys exactly:
  fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
  midlayer.self_attn.* (below), midlayer.mlp.{gate,up,down}_proj.weight,
  norm.weight, lm_head.weight, d2t (int64), t2d (bool)  -- and never embed_tokens;
  EAGLE 3.1 `fc_norm`: fc_norm.{0,1,2}.weight.
Per attention (Eagle3Config.attention; `ATTENTIONS`):
  gqa: `LlamaForCausalLMEagle3`, model_type llama, self_attn.{q,k,v,o}_proj;
  mla: `Eagle3DeepseekV2ForCausalLM`, model_type deepseek_v2, DeepSeek's unfused names
       self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
       kv_b_proj, o_proj}: vLLM 0.32 (deepseek_eagle3.py hf_to_vllm_mapper) stacks q_a_proj +
       kv_a_proj_with_mqa into fused_qkv_a_proj, SGLang 0.5.23 (kimi_k25_eagle3.py load_weights)
       concatenates them into fused_qkv_a_proj_with_mqa; both load kv_b_proj whole and split it
       after loading (vLLM's MLA layer; SGLang's post_load_weights: w_kc / w_vc).  Not
       deepseek_v3: vLLM's SpeculativeConfig.hf_config_override turns every deepseek_v3 draft
       config into its DeepSeek MTP model.
`fc_norm` and `norm_output` are written top-level, where both engines read them.
d2t/t2d only with a reduced draft vocabulary: vLLM 0.32 has no parameter for a d2t when the draft
vocabulary is the target's (llama_eagle3.py `draft_id_to_target_id = None`) and refuses the file.
Aux layer ids: written so that each engine captures the trained layers, per the target class's
rule (export/layer_ids.py); omitted when the engines' defaults are those layers.

Other trainers' drafts (SpecForge, TorchSpec: `midlayer.*`, maybe the target's `embed_tokens`;
speculators: `layers.0.*` + `transformer_layer_config`) are read into the same Eagle3Config.

check-draft (`judge`): the attention (gqa: `LlamaForCausalLMEagle3`; mla:
`Eagle3DeepseekV2ForCausalLM`) and EAGLE 3.1's `fc_norm` / `norm_output`, judged as the engines
read them (top-level config keys) and against the weights present: a flag without its weights,
weights without their flag, a flag in a place no engine reads, or (our drafts) a served flag that
differs from the trained one is refused.
"""

from __future__ import annotations

import torch

from eaglenest import EaglenestError
from eaglenest.draft.model import Eagle3Config
from eaglenest.export.layer_ids import ENGINES, config_keys, engine_capture, rule_text, trained_layers
from eaglenest.kinds.common import (
    CONSUMERS,
    WEIGHT_DTYPE,
    Report,
    config_from_hf,
    judge_shape_fit,
    judge_tensors,
    layer_config,
)
from eaglenest.kinds.registry import DraftKind, register
from eaglenest.models.target import MLA_FIELDS

# the engines' class and config type per attention kind (see the module docstring)
ATTENTIONS = {
    "gqa": {"architecture": "LlamaForCausalLMEagle3", "model_type": "llama"},
    "mla": {"architecture": "Eagle3DeepseekV2ForCausalLM", "model_type": "deepseek_v2"},
}
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")  # vLLM's registry; SGLang has the V2 name

ARCHITECTURES = {  # draft architectures each engine's registry resolves, per attention kind
    "gqa": {  # llama_eagle3.py in both
        "sglang": {"LlamaForCausalLMEagle3"},
        "vllm": {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"},
        "hf": {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"},
    },
    "mla": {  # SGLang kimi_k25_eagle3.py EntryClass; vLLM registry.py -> deepseek_eagle3.py
        "sglang": {"Eagle3DeepseekV2ForCausalLM"},
        "vllm": set(MLA_ARCHITECTURES),
        "hf": set(MLA_ARCHITECTURES),
    },
}
KIND_FLAGS = ("fc_norm", "norm_output", "attention")  # what a served draft must share with the trained one

# config flags of other trainers' layer variants that eaglenest's decoder does not implement
# (both engines do; check-draft judges them per engine)
UNSUPPORTED_FLAGS = ("norm_before_fc",)


def expected_tensors(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    H, I = cfg.hidden_size, cfg.intermediate_size
    w = WEIGHT_DTYPE
    return {
        "fc.weight": ((H, 3 * cfg.target_hidden_size), w),
        **({f"fc_norm.{i}.weight": ((cfg.target_hidden_size,), w) for i in range(3)} if cfg.fc_norm else {}),
        "midlayer.input_layernorm.weight": ((H,), w),
        "midlayer.hidden_norm.weight": ((H,), w),
        "midlayer.post_attention_layernorm.weight": ((H,), w),
        **{f"midlayer.self_attn.{k}": v for k, v in attention_tensors(cfg).items()},
        "midlayer.mlp.gate_proj.weight": ((I, H), w),
        "midlayer.mlp.up_proj.weight": ((I, H), w),
        "midlayer.mlp.down_proj.weight": ((H, I), w),
        "norm.weight": ((H,), w),
        "lm_head.weight": ((cfg.draft_vocab_size, H), w),
        **(
            {"d2t": ((cfg.draft_vocab_size,), torch.int64), "t2d": ((cfg.vocab_size,), torch.bool)}
            if cfg.draft_vocab_size < cfg.vocab_size
            else {}
        ),
    }


def attention_tensors(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The attention's tensors (names under midlayer.self_attn.) for the draft's kind."""
    H, n, w = cfg.hidden_size, cfg.num_attention_heads, WEIGHT_DTYPE
    if cfg.attention == "mla":
        qd, r, rope = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        q = ({"q_a_proj.weight": ((cfg.q_lora_rank, 2 * H), w), "q_a_layernorm.weight": ((cfg.q_lora_rank,), w),
              "q_b_proj.weight": ((n * qd, cfg.q_lora_rank), w)} if cfg.q_lora_rank else {"q_proj.weight": ((n * qd, 2 * H), w)})
        return {**q, "kv_a_proj_with_mqa.weight": ((r + rope, 2 * H), w), "kv_a_layernorm.weight": ((r,), w),
                "kv_b_proj.weight": ((n * (cfg.qk_nope_head_dim + cfg.v_head_dim), r), w),
                "o_proj.weight": ((H, n * cfg.v_head_dim), w)}
    q, kv = n * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q_proj.weight": ((q, 2 * H), w), "k_proj.weight": ((kv, 2 * H), w), "v_proj.weight": ((kv, 2 * H), w),
            "o_proj.weight": ((H, q), w)}


def hf_config(cfg: Eagle3Config, extra: dict | None = None, engines=ENGINES) -> dict:
    kind = ATTENTIONS[cfg.attention]
    attn = None
    if cfg.attention == "mla":
        attn = {"num_key_value_heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
                "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
                "rope_interleave": True}  # GPT-J pairs: vLLM always, SGLang unless this is false
    c = {"architectures": [kind["architecture"]], "model_type": kind["model_type"], "num_hidden_layers": 1,
         **layer_config(cfg, extra, engines, attn),
         "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output}  # EAGLE 3.1: top-level keys, as both engines read them
    c.update(config_keys(cfg.target_architecture, cfg.target_num_layers, cfg.aux_layer_ids, engines))
    return c


def flat_config(raw: dict) -> dict:
    """A draft config.json as one flat Llama-style dict: the speculators format keeps the layer's
    fields in `transformer_layer_config` and the EAGLE-3 ones at the top (vLLM's
    SpeculatorsConfig does the same flattening; its default for norm_before_residual is True)."""
    if raw.get("speculators_model_type") != "eagle3":
        return raw
    flat = dict(raw.get("transformer_layer_config") or {})
    for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(k) is not None:
            flat[k] = raw[k]
    flat["norm_before_residual"] = raw.get("norm_before_residual", True)
    return flat


def judge(r: Report, raw: dict, cfg, tensors: dict | None, model=None, trained: list[int] | None = None) -> None:
    """check-draft for an EAGLE-3 draft (ours or another trainer's), per consumer."""
    flat = flat_config(raw)
    arch = (raw.get("architectures") or [None])[0]
    if "speculators_model_type" in raw:
        # vLLM builds the draft from speculators_model_type + transformer_layer_config, whatever
        # `architectures` says (transformers_utils/configs/speculators/algos.py: llama or qwen3 layers)
        r.notes.append("speculators format (layers.0.* + transformer_layer_config)")
        if raw["speculators_model_type"] != "eagle3":
            r.error(f"config.json: speculators_model_type {raw['speculators_model_type']!r} is not an EAGLE-3 draft")
        r.error("the speculators format: SGLang 0.5.23 has no loader for it", ["sglang"])
        layer = flat.get("model_type", "llama")
        if layer not in ("llama", "qwen3"):
            r.error(f"transformer_layer_config.model_type {layer!r}: vLLM 0.32 builds EAGLE-3 drafts from llama or qwen3 layers", ["vllm"])
        if layer != "llama":
            r.error(f"transformer_layer_config.model_type {layer!r}: eaglenest's decoder is a Llama layer", ["hf"])
    else:
        for c in CONSUMERS:
            if arch not in ARCHITECTURES[cfg.attention][c]:
                r.error(f"config.json: architectures {raw.get('architectures')!r}: not a {cfg.attention} draft class this consumer "
                        f"loads (expected {' or '.join(sorted(ARCHITECTURES[cfg.attention][c]))})", [c])
        _judge_model_type(r, raw.get("model_type"), cfg.attention)
    if flat.get("num_hidden_layers", 1) != 1:
        r.error(f"config.json: num_hidden_layers is {flat.get('num_hidden_layers')}: eaglenest checks and evaluates one-layer drafts")
    if flat.get("tie_word_embeddings"):
        r.error("config.json: tie_word_embeddings is true: SGLang would use embed_tokens as the lm_head", ["sglang"])
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps", "vocab_size", "max_position_embeddings"):
        if key not in flat:
            r.error(f"config.json: missing {key}")
    if "draft_vocab_size" not in flat:
        r.error("config.json: no draft_vocab_size: SGLang 0.5.23's llama_eagle3.py reads config.draft_vocab_size, which "
                "transformers' LlamaConfig does not default (vLLM assumes the full vocabulary)", ["sglang"])
    if flat.get("norm_before_residual"):
        r.error("norm_before_residual is true: SGLang 0.5.23's draft layer has no such variant and would compute another function", ["sglang"])
    for k in UNSUPPORTED_FLAGS:
        if flat.get(k):
            r.error(f"{k} is set: eaglenest's decoder does not implement it (the engines do)", ["hf"])
    _judge_kind_flags(r, raw, flat, cfg)
    if cfg.attention == "mla":
        _judge_mla(r, cfg)

    if tensors is not None:
        judge_tensors(r, cfg, tensors, said=_judge_layout_tensors(r, cfg, tensors))
    if model is not None:
        _judge_fit(r, raw, cfg, tensors or {}, model, trained, "eaglenest" in raw)


def _judge_layout_tensors(r: Report, cfg: Eagle3Config, tensors: dict) -> set[str]:
    """The tensors against the config's EAGLE 3.1 and attention options; returns the tensors reported."""
    said = set()
    norms = {k for k in tensors if k.startswith("fc_norm.")}
    if norms and not cfg.fc_norm:
        r.error(f"model.safetensors: {', '.join(sorted(norms))} but the config's fc_norm is false: SGLang would skip them "
                "silently and vLLM refuses them (set fc_norm: true, as the draft was trained)")
        said |= norms
    if cfg.fc_norm and not norms:
        r.error("config.json: fc_norm is true but model.safetensors has no fc_norm.* weights: an engine would serve "
                "randomly initialized aux norms or refuse the file")
        said |= {k for k in expected_tensors(cfg) if k.startswith("fc_norm.")}
    llama_attn = {f"midlayer.self_attn.{p}_proj.weight" for p in "kv"} & set(tensors)
    mla_attn = {k for k in tensors if k.startswith("midlayer.self_attn.kv_")}
    if cfg.attention == "mla" and llama_attn and not mla_attn:
        r.error("config.json describes an MLA draft but model.safetensors holds Llama attention (k_proj/v_proj), no MLA weights")
    if cfg.attention == "gqa" and mla_attn and not llama_attn:
        r.error("config.json describes a Llama-attention draft but model.safetensors holds MLA attention weights (kv_a_proj_with_mqa, ...)")
    return said


def _judge_model_type(r: Report, model_type, attention: str) -> None:
    want = ATTENTIONS[attention]["model_type"]
    if model_type == want:
        return
    if attention == "mla" and model_type in ("deepseek_v3", "deepseek_v32", "kimi_k2"):
        r.error(f"config.json: model_type {model_type!r}: vLLM 0.32 loads it as DeepseekV3Config, whose drafts "
                "SpeculativeConfig.hf_config_override turns into its DeepSeek MTP model (config/speculative.py); use 'deepseek_v2'", ["vllm"])
        if model_type == "kimi_k2":
            r.error("config.json: model_type 'kimi_k2' has no config class in transformers or SGLang 0.5.23 (remote code only)",
                    ["sglang", "hf"])
        return
    r.error(f"config.json: model_type is {model_type!r}, expected {want!r} for a {attention} draft")


def _judge_kind_flags(r: Report, raw: dict, flat: dict, cfg) -> None:
    """EAGLE 3.1's flags where the engines read them (top-level config keys; SGLang also takes
    `use_aux_norm` for fc_norm, vLLM does not), and, for our own drafts, against what was trained."""
    if flat.get("use_aux_norm") and not flat.get("fc_norm"):
        r.error("use_aux_norm is SGLang's spelling of fc_norm: vLLM 0.32 ignores it and would serve the draft without its "
                "aux norms (write fc_norm: true)", ["vllm"])
    eagle = raw.get("eagle_config") or {}
    for k in ("fc_norm", "norm_output"):
        if k in eagle and bool(eagle[k]) != bool(flat.get(k)):
            r.error(f"config.json: eagle_config.{k} is {eagle[k]!r} but the top-level {k} is {flat.get(k)!r}: both engines "
                    f"read only the top-level key, so the draft would be served with {k} {bool(flat.get(k))}")
    trained = (raw.get("eaglenest") or {}).get("draft_config")
    if trained is None:
        return
    served = {"fc_norm": bool(flat.get("fc_norm") or flat.get("use_aux_norm")), "norm_output": bool(flat.get("norm_output")),
              "attention": "mla" if (raw.get("architectures") or [None])[0] in MLA_ARCHITECTURES else "gqa"}
    for k in KIND_FLAGS:
        was = trained.get(k, {"attention": "gqa"}.get(k, False))
        if served[k] != was:
            r.error(f"config.json: the engines would serve {k} = {served[k]!r}, the draft was trained with {k} = {was!r} "
                    "(eaglenest.draft_config): its states would not be the ones it learned from")


def _judge_mla(r: Report, cfg) -> None:
    rope_type = dict(cfg.rope_parameters).get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        r.error(f"rope_type {rope_type!r}: both engines' MLA layers apply DeepSeek's YaRN to any scaled rope "
                "(vLLM deepseek_v2.py, SGLang deepseek_v2.py DeepseekV2AttentionMLA), not this one", ENGINES)
    if not cfg.q_lora_rank:
        r.error("an MLA draft without q_lora_rank: SGLang 0.5.23's Eagle3MLADecoderLayer requires one", ["sglang"])
    if cfg.kv_lora_rank + cfg.qk_rope_head_dim != 576:
        r.notes.append(f"MLA latent {cfg.kv_lora_rank} + {cfg.qk_rope_head_dim}: vLLM 0.32's CPU MLA kernel takes only 512 + 64 "
                       "(GPU backends are not limited so)")


def _judge_fit(r: Report, raw: dict, cfg, tensors: dict, model, trained, ours: bool) -> None:
    from eaglenest.models.target import target_facts

    t = target_facts(model)
    n = t.num_layers
    judge_shape_fit(r, raw, cfg, t, ours)

    emb = tensors.get("embed_tokens.weight")
    if emb is not None and tuple(emb.shape) == (t.vocab_size, t.hidden_size):
        from eaglenest.models.weights import target_head

        own = target_head(model)["embed"]
        if torch.equal(emb.to(own.dtype), own):
            r.notes.append("embed_tokens.weight equals the target's: vLLM shares the target's, SGLang replaces it")
        else:
            r.error("embed_tokens.weight differs from the target's: vLLM 0.32 would use it as the draft's own "
                    "(SGLang and eaglenest use the target's)", ["vllm"])

    ids, how = (list(trained), "given by --trained-layers") if trained else trained_layers(raw, n)
    r.notes.append(f"trained on layers {ids} (capture-before; {how})")
    if len(ids) != 3 or any(not 1 <= k <= n - 1 for k in ids) or sorted(set(ids)) != ids:
        r.error(f"trained layers {ids} are not three increasing capture-before ids in 1..{n - 1} for a {n}-layer target")
        return
    for e in ENGINES:
        try:
            got = engine_capture(e, t.architecture, n, raw)
        except EaglenestError as ex:
            r.error(str(ex), [e])
            continue
        if got != ids:
            r.error(f"would capture before layers {got}, the draft was trained on {ids} ({rule_text(e, t.architecture)})", [e])


def read_config(raw: dict, draft_dir) -> Eagle3Config:
    """Another trainer's EAGLE-3 config.json as an Eagle3Config, with the engines' defaults for what it
    leaves out (target_hidden_size = hidden_size, draft_vocab_size = vocab_size, head_dim = hidden /
    heads); its aux layers stay [] unless given top-level (format.resolve_aux_layers fills them once
    the target's layer count is known)."""
    f = flat_config(raw)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in f]
    if missing:
        raise EaglenestError(f"{draft_dir}/config.json: missing {', '.join(missing)}: not an EAGLE-3 draft config")
    ids = f.get("eagle_aux_hidden_state_layer_ids")
    arch = (raw.get("architectures") or [None])[0]
    mla = arch in MLA_ARCHITECTURES or (arch is None and f.get("kv_lora_rank") is not None)
    kw = dict(num_key_value_heads=f["num_attention_heads"], head_dim=f.get("v_head_dim"),
              **{k: f.get(k) for k in MLA_FIELDS}) if mla else {}
    return config_from_hf(Eagle3Config, f, aux_layer_ids=list(ids) if ids else [], target_num_layers=0,
                          norm_before_residual=bool(f.get("norm_before_residual", False)),
                          # what the engines read: top-level flags (SGLang also takes use_aux_norm for fc_norm)
                          fc_norm=bool(f.get("fc_norm") or f.get("use_aux_norm")), norm_output=bool(f.get("norm_output")),
                          attention="mla" if mla else "gqa", **kw)


class Eagle3Kind(DraftKind):
    name = "eagle3"
    title = "an EAGLE-3 draft"
    aux_count = 3  # fc reads three aux states
    vllm_method = "eagle3"
    sglang_algorithm = "EAGLE3"
    config_class = Eagle3Config

    def check_train_options(self, tc) -> None:
        if tc.draft_layers != 1:
            raise EaglenestError(f"--draft-layers {tc.draft_layers}: an EAGLE-3 draft has one layer (the engines normalize the "
                                 "input of deeper layers differently, draft/shape.py); use --draft-kind dflash for several")

    def train_config(self, tcfg, draft_vocab_size, layer_ids, tc):
        return self.config_class.from_target(tcfg, draft_vocab_size, layer_ids, shape=tc.draft_shape, attention=tc.draft_attention,
                                             fc_norm=tc.fc_norm, norm_output=tc.norm_output, kind=self.name)

    def model(self, cfg, embed_weight=None):
        from eaglenest.draft.model import Eagle3Draft

        return Eagle3Draft(cfg, embed_weight=embed_weight)

    def objective(self, tc, cfg, *, teacher, device, autocast, attn, recompute, argmax_room):
        from eaglenest.train.objective import Eagle3Objective

        return Eagle3Objective(teacher, tc.ttt_steps, device=device, autocast=autocast, attn=attn, logits_chunk=tc.logits_chunk,
                               recompute=recompute, argmax_room=argmax_room, loss=tc.loss_spec(), step_decay=tc.step_decay)

    def export_extra(self, train: dict) -> dict:
        return {"ttt_steps": train["ttt_steps"]}

    def expected_tensors(self, cfg) -> dict:
        return expected_tensors(cfg)

    def hf_config(self, cfg, extra, engines) -> dict:
        return hf_config(cfg, extra, engines)

    def read_config(self, raw, draft_dir):
        return read_config(raw, draft_dir)

    def tensor_name(self, key: str) -> str:
        # speculators' `layers.0.` is our `midlayer.`
        return key.replace("layers.0.", "midlayer.", 1) if key.startswith("layers.0.") else key

    def layout(self, cfg) -> str:
        return f"EAGLE-3 ({cfg.attention} attention, fc_norm {cfg.fc_norm})"

    def load_refusal(self, raw: dict) -> str | None:
        flags = [k for k in UNSUPPORTED_FLAGS if flat_config(raw).get(k)]
        if flags:
            return (f"{', '.join(flags)} set: eaglenest's decoder does not implement that layer variant "
                    "(SGLang/vLLM do): evaluate it with --engine vllm or --engine sglang")
        return None

    def judge(self, r, raw, cfg, tensors, model=None, trained=None) -> None:
        judge(r, raw, cfg, tensors, model, trained)

    def check_fits(self, cfg, num_layers: int, where: str) -> None:
        ids, N = list(cfg.aux_layer_ids), num_layers
        if len(ids) != 3 or any(not 0 <= k < N for k in ids):
            raise EaglenestError(
                f"{where} aux layer ids {ids} do not fit a {N}-layer target (three capture-before ids in 0..{N - 1})"
            )

    def decoder(self, target, draft, eos, args, *, num_draft_tokens, temperature, draft_sampling):
        from eaglenest.evaluate.specdec import SpecDecoder

        return SpecDecoder(target, draft, eos, steps=args.steps, topk=args.topk, num_draft_tokens=num_draft_tokens,
                           temperature=temperature, seed=args.seed, draft_sampling=draft_sampling)


KIND = register(Eagle3Kind())
