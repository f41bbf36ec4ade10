"""`eaglenest check-draft`: validate a draft against its target, judged the way each consumer uses it.

Consumers: `sglang` (0.5.23), `vllm` (0.32) and `hf` (eaglenest's own decoder, `eval --engine hf`).
A draft from another trainer (SpecForge, TorchSpec, speculators) is accepted where the engines
accept it: a missing `target_hidden_size` means the target's width (both engines), a missing
`draft_vocab_size` the full vocabulary (vLLM), an `embed_tokens` in the file is replaced by the
target's in SGLang but used as the draft's own by vLLM when it differs from the target's.  Each
problem is one line naming the field or tensor, prefixed by the consumers it affects; the layers
each engine will capture are computed from the target class's rule (export/layer_ids.py) and
compared with the layers the draft was trained on.

Draft kinds: the attention (gqa: `LlamaForCausalLMEagle3`; mla: `Eagle3DeepseekV2ForCausalLM`) and
EAGLE 3.1's `fc_norm` / `norm_output`, judged as the engines read them (top-level config keys) and
against the weights present: a flag without its weights, weights without their flag, a flag in a
place no engine reads, or (our drafts) a served flag that differs from the trained one is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eaglenest import EaglenestError
from eaglenest.draft.vocab import check_vocab
from eaglenest.export.format import (
    KINDS,
    MLA_ARCHITECTURES,
    UNSUPPORTED_FLAGS,
    expected_tensors,
    flat_config,
    read_draft_config,
    read_draft_tensors,
)
from eaglenest.export.layer_ids import ENGINES, engine_capture, rule_text, trained_layers

CONSUMERS = (*ENGINES, "hf")
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


class Report:
    """Problems per consumer; `errors(consumers)` is what a command acting for them must refuse."""

    def __init__(self) -> None:
        self.problems: list[tuple[tuple[str, ...], str]] = []
        self.warnings: list[str] = []
        self.notes: list[str] = []

    def error(self, msg: str, consumers=CONSUMERS) -> None:
        self.problems.append((tuple(consumers), msg))

    def errors(self, consumers=CONSUMERS) -> list[str]:
        out = []
        for who, msg in self.problems:
            hit = [c for c in who if c in consumers]
            if hit:
                out.append(msg if set(who) >= set(CONSUMERS) else f"{'/'.join(hit)}: {msg}")
        return out

    def ok_for(self, consumer: str) -> bool:
        return not any(consumer in who for who, _ in self.problems)


def judge_draft(draft_dir: Path | str, model: str | Path | None = None, trained: list[int] | None = None,
                weights: bool = True) -> Report:
    """Everything check-draft knows about a draft, per consumer.  `trained` (capture-before ids)
    overrides the layers read from the config (see export/layer_ids.py `trained_layers`);
    `weights=False` judges config.json alone (what `eval` does before it starts an engine)."""
    raw, cfg = read_draft_config(draft_dir)
    return judge(raw, cfg, read_draft_tensors(draft_dir, cfg.kind) if weights else None, model, trained)


def judge(raw: dict, cfg, tensors: dict | None, model=None, trained: list[int] | None = None) -> Report:
    """`judge_draft` on a config and its tensors (None: the config alone); meta tensors (a draft too
    big to write, e.g. the Kimi-K2.5 shape in a test) get the shape and dtype checks only.
    `model`: a target directory, known name or config dict."""
    r = Report()
    if cfg.kind == "dflash":  # its own layout and engine code paths
        from eaglenest.export import dflash

        dflash.judge(r, raw, cfg, tensors, model, trained)
        return r
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
        _judge_tensors(r, cfg, tensors)
    if model is not None:
        _judge_fit(r, raw, cfg, tensors or {}, model, trained, "eaglenest" in raw)
    return r


def _judge_model_type(r: Report, model_type, attention: str) -> None:
    want = KINDS[attention]["model_type"]
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


def _judge_tensors(r: Report, cfg, tensors: dict, optional=()) -> None:
    """Keys, shapes, dtypes and finiteness against the contract; `optional` keys may be absent."""
    exp = expected_tensors(cfg)
    said = set()  # tensors a summary line below already accounts for
    norms = {k for k in tensors if k.startswith("fc_norm.")}
    if norms and not cfg.fc_norm:
        r.error(f"model.safetensors: {', '.join(sorted(norms))} but the config's fc_norm is false: SGLang would skip them "
                "silently and vLLM refuses them (set fc_norm: true, as the draft was trained)")
        said |= norms
    if cfg.fc_norm and not norms:
        r.error("config.json: fc_norm is true but model.safetensors has no fc_norm.* weights: an engine would serve "
                "randomly initialized aux norms or refuse the file")
        said |= {k for k in exp if k.startswith("fc_norm.")}
    llama_attn = {f"midlayer.self_attn.{p}_proj.weight" for p in "kv"} & set(tensors)
    mla_attn = {k for k in tensors if k.startswith("midlayer.self_attn.kv_")}
    if cfg.attention == "mla" and llama_attn and not mla_attn:
        r.error("config.json describes an MLA draft but model.safetensors holds Llama attention (k_proj/v_proj), no MLA weights")
    if cfg.attention == "gqa" and mla_attn and not llama_attn:
        r.error("config.json describes a Llama-attention draft but model.safetensors holds MLA attention weights (kv_a_proj_with_mqa, ...)")
    for k in sorted(set(tensors) - set(exp) - {"embed_tokens.weight"} - said):
        r.error(f"model.safetensors: unexpected tensor {k}")
    for k, (shape, dtype) in exp.items():
        if k in said or (k not in tensors and k in optional):
            continue
        if k not in tensors:
            r.error(f"model.safetensors: missing {k}" + (" (served without it, acceptance collapses to 1.0)" if k == "lm_head.weight" else ""))
            continue
        t = tensors[k]
        if tuple(t.shape) != shape:
            r.error(f"model.safetensors: {k} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != dtype and not (t.is_floating_point() and dtype.is_floating_point):
            r.error(f"model.safetensors: {k} has dtype {t.dtype}, expected {dtype}")
        elif t.is_floating_point() and not t.is_meta and not torch.isfinite(t.float()).all():
            r.error(f"model.safetensors: {k} contains NaN/Inf")
    if cfg.draft_vocab_size < cfg.vocab_size and "d2t" in tensors and "t2d" in tensors and not tensors["d2t"].is_meta:
        why = check_vocab(tensors["d2t"], tensors["t2d"])
        if why:
            r.error(f"vocabulary mapping: {why}")
    if cfg.draft_vocab_size == cfg.vocab_size and "d2t" in tensors:
        r.error("model.safetensors: d2t with a full draft vocabulary: vLLM 0.32 has no parameter for it and refuses the file", ["vllm"])
    emb = tensors.get("embed_tokens.weight")
    if emb is not None and tuple(emb.shape) != (cfg.vocab_size, cfg.hidden_size):
        r.error(f"model.safetensors: embed_tokens.weight has shape {tuple(emb.shape)}, expected {(cfg.vocab_size, cfg.hidden_size)}")


def _judge_fit(r: Report, raw: dict, cfg, tensors: dict, model, trained, ours: bool) -> None:
    from eaglenest.models.target import target_facts

    t = target_facts(model)
    n = t.num_layers
    _judge_shape_fit(r, raw, cfg, t, ours)

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


def _judge_shape_fit(r: Report, raw: dict, cfg, t, ours: bool) -> None:
    """The draft's sizes, vocabulary and rope against the target's facts `t` (any draft kind)."""
    n = t.num_layers
    if cfg.target_hidden_size != t.hidden_size:
        r.error(f"target_hidden_size {cfg.target_hidden_size} != target hidden size {t.hidden_size}: this draft is for another target")
    if cfg.hidden_size != t.hidden_size:
        r.error(f"draft hidden size {cfg.hidden_size} != target hidden size {t.hidden_size} (engines feed it the target's embeddings)")
    if cfg.vocab_size != t.vocab_size:
        r.error(f"vocab_size {cfg.vocab_size} != target vocab_size {t.vocab_size}: this draft is for another tokenizer")
    if cfg.draft_vocab_size > t.vocab_size:
        r.error(f"draft_vocab_size {cfg.draft_vocab_size} exceeds the target vocabulary {t.vocab_size}")
    if cfg.max_position_embeddings < t.max_position_embeddings:
        r.error(f"max_position_embeddings {cfg.max_position_embeddings} < target's {t.max_position_embeddings} (engines clamp the draft's RoPE)")
    if dict(cfg.rope_parameters) != t.rope_parameters:
        msg = f"rope parameters {dict(cfg.rope_parameters)} differ from the target's {t.rope_parameters}"
        (r.error(msg) if ours else r.warnings.append(msg + " (another trainer's choice: served as written)"))
    dc = (raw.get("eaglenest") or {}).get("draft_config") or {}
    if dc.get("target_num_layers") not in (None, 0, n):
        r.error(f"trained for a {dc['target_num_layers']}-layer target, this one has {n}")
    if ours and dc.get("target_architecture") not in (None, t.architecture):
        r.warnings.append(f"trained on a {dc['target_architecture']} target, this one is {t.architecture}")


def check_draft(draft_dir: Path | str, model: str | Path | None = None, engines=CONSUMERS, trained=None,
                weights: bool = True) -> tuple[list[str], list[str]]:
    """(errors for `engines`, warnings).  Problems that only affect other consumers are warnings."""
    r = judge_draft(draft_dir, model, trained, weights)
    others = [c for c in CONSUMERS if c not in engines]
    return r.errors(engines), r.warnings + [f"(not checked for) {e}" for e in r.errors(others) if e not in r.errors(engines)]


def assert_draft_ok(draft_dir, model=None, engines=CONSUMERS, weights: bool = True) -> list[str]:
    errors, warnings = check_draft(draft_dir, model, engines, weights=weights)
    if errors:
        raise EaglenestError(f"{draft_dir}: {len(errors)} problem(s): " + "; ".join(errors))
    return warnings
