"""What the draft kinds share in their checkpoint and their check-draft judgement: the weight
dtype, the config.json keys every kind writes alike (`layer_config`), a DraftConfig from another
trainer's flat config (`config_from_hf`), check-draft's per-consumer `Report` and the judgements
that read only the config's fields (`judge_tensors`, `judge_shape_fit`).  Below export/ and the
kind modules: it imports neither a kind nor export/format.py or export/check.py."""

from __future__ import annotations

import torch

from eaglenest.draft.config import DraftConfig
from eaglenest.draft.vocab import check_vocab
from eaglenest.export.layer_ids import ENGINES
from eaglenest.kinds.registry import get as get_kind
from eaglenest.models.target import normalized_rope

WEIGHT_DTYPE = torch.bfloat16
CONSUMERS = (*ENGINES, "hf")


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


def layer_config(cfg: DraftConfig, extra: dict | None, engines, attn: dict | None = None) -> dict:
    """The config.json keys every draft kind writes alike: the layers' shape (`attn`: the attention's
    keys, Llama attention's by default), the target's rope (rope_theta/rope_scaling for older
    readers, rope_parameters for newer), the vocabularies, and our own `eaglenest` block (the exact
    config; engines ignore unknown keys)."""
    rope = dict(cfg.rope_parameters)
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if rope_scaling.get("rope_type", "default") == "default":
        rope_scaling = None
    attn = attn or {"num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim}
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        **attn,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": rope_scaling,
        "rope_parameters": rope,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "eaglenest": {
            "draft_config": cfg.to_dict(),
            "layer_convention": "capture-before",
            "serving_engines": list(engines),
            **(extra or {}),
        },
    }


def config_from_hf(cls: type[DraftConfig], f: dict, **kw) -> DraftConfig:
    """A config of class `cls` (a kind's) from another trainer's flat config.json, with the engines'
    defaults for what it leaves out; `kw` sets what depends on the draft kind (its layers, ...)."""
    kw = {"num_key_value_heads": f.get("num_key_value_heads") or f["num_attention_heads"],
          "head_dim": f.get("head_dim") or f["hidden_size"] // f["num_attention_heads"], **kw}
    return cls(
        hidden_size=f["hidden_size"],
        intermediate_size=f["intermediate_size"],
        num_attention_heads=f["num_attention_heads"],
        vocab_size=f["vocab_size"],
        draft_vocab_size=f.get("draft_vocab_size") or f["vocab_size"],
        target_hidden_size=f.get("target_hidden_size") or f["hidden_size"],
        rms_norm_eps=f.get("rms_norm_eps", 1e-6),
        hidden_act=f.get("hidden_act", "silu"),
        max_position_embeddings=f.get("max_position_embeddings", 8192),
        rope_parameters=normalized_rope(f),
        bos_token_id=f.get("bos_token_id"),
        eos_token_id=f.get("eos_token_id"),
        **kw,
    )


def judge_tensors(r: Report, cfg, tensors: dict, optional=(), said=frozenset()) -> None:
    """Keys, shapes, dtypes and finiteness against the contract; `optional` keys may be absent,
    `said`: tensors the kind's own judgement already reported (no second line for them)."""
    exp = get_kind(cfg.kind).expected_tensors(cfg)
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


def judge_shape_fit(r: Report, raw: dict, cfg, t, ours: bool) -> None:
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
