"""The one home for what eaglenest knows about a target model.

Loading (by path or known short name), and the facts every stage needs, each decided here once:
  * `target_facts`: family (models/families.py), architecture class, sizes, rope, final norm and
    logit soft-capping, from config.json (a multimodal checkpoint's `text_config`);
  * `decoder_layers`: the ModuleList of decoder layers of a loaded transformers model;
  * `eos_token_ids`: the stop ids, ONE rule for capture, regenerate, train and eval;
  * `final_norm`, `soft_cap` and `models/weights.py:target_head`: the teacher's final norm, logit
    soft-capping, embedding and head tensors, per family.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest import EaglenestError
from eaglenest.models.families import BY_MODEL_TYPE, Family
from eaglenest.utils import sha256_text


def resolve_model_path(model: str | Path) -> Path:
    """A directory, or a known name such as `smollm2` (fetched into the cache on first use)."""
    from eaglenest.models.fetch import KNOWN, fetch

    if str(model) in KNOWN:
        return fetch(str(model))
    p = Path(model)
    if not p.exists():
        raise EaglenestError(f"target model not found: {model} (a checkpoint directory, or one of: {', '.join(KNOWN)})")
    if not (p / "config.json").exists():
        raise EaglenestError(f"{p} has no config.json: not a transformers checkpoint")
    return p


def load_tokenizer(model: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not tok.chat_template:
        raise EaglenestError(f"tokenizer at {path} has no chat template")
    return tok


def load_config(model: str | Path, trust_remote_code: bool = False):
    """The transformers config; a family whose model_type transformers does not register (Kimi-K2:
    `kimi_k2` + remote code) is read with the config class it is an instance of (`Family.load_as`)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = resolve_model_path(model)
    raw = _read_config(path)
    fam = BY_MODEL_TYPE.get(raw.get("model_type"))
    if fam is not None and fam.load_as and raw.get("model_type") not in CONFIG_MAPPING and not trust_remote_code:
        return CONFIG_MAPPING[fam.load_as].from_dict({k: v for k, v in raw.items() if k not in ("model_type", "auto_map")})
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_target(model: str | Path, dtype: str = "bf16", device: str = "cpu", trust_remote_code: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    config = load_config(path, trust_remote_code)
    m = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    m.eval().requires_grad_(False)
    return m.to(device)


def target_fingerprint(model: str | Path) -> str:
    """Identify a target by its config + weights index (cheap: no hashing of weight bytes)."""
    path = resolve_model_path(model)
    parts = [(path / "config.json").read_text()]
    for f in sorted(path.glob("*.safetensors")):
        parts.append(f"{f.name}:{f.stat().st_size}")
    return sha256_text("\n".join(parts))[:16]


def tokenizer_fingerprint(tok) -> str:
    vocab = tok.get_vocab()
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    return sha256_text("\n".join(f"{i}\t{t}" for t, i in items))[:16]


def template_fingerprint(tok) -> str:
    return sha256_text(tok.chat_template or "")[:16]


def _read_config(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EaglenestError(f"cannot read {path}/config.json: {e}") from None


def model_config(model_path: str | Path) -> dict:
    """config.json as a dict, without importing transformers (the server engines only need sizes);
    a multimodal config's `text_config` is the language model's."""
    cfg = _read_config(model_path)
    return cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg


def normalized_rope(cfg: dict | Any) -> dict:
    """rope parameters in transformers 5 form ({"rope_type", "rope_theta", ...}) from either a
    config dict or object, whichever spelling (rope_parameters / rope_scaling + rope_theta) it uses."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    rope = get("rope_parameters")
    if not rope:
        rope = dict(get("rope_scaling") or {"rope_type": "default"})
        rope["rope_theta"] = get("rope_theta", 10000.0)
    rope = dict(rope)
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.pop("type", None)
    return rope


@dataclass(frozen=True)
class TargetFacts:
    family: Family
    model_type: str  # the language model's
    architecture: str  # config.json `architectures[0]` (else the family's): the class SGLang and vLLM instantiate
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # per-head width of the attention output (MLA: v_head_dim, not config.head_dim)
    intermediate_size: int | None
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict = field(default_factory=dict)
    logit_softcap: float | None = None
    config: dict = field(default_factory=dict, repr=False)  # the language model's config dict
    mla: dict | None = None  # MLA targets: q_lora_rank (None: a plain q_proj), kv_lora_rank, qk_nope/qk_rope/v_head_dim


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def target_facts(model: str | Path | dict | Any) -> TargetFacts:
    """Facts of a target from its checkpoint directory (or known name), a config dict, or a
    transformers config object.  An unknown family is refused by name: its norm, head and the
    engines' layer rules would be guesses."""
    if isinstance(model, dict):
        top = model
    elif isinstance(model, (str, Path)):
        top = _read_config(resolve_model_path(model))
    else:
        top = model.to_dict()
    text = top.get("text_config", top) if "num_hidden_layers" not in top else top
    mt = text.get("model_type") or top.get("model_type")
    fam = BY_MODEL_TYPE.get(mt)
    if fam is None:
        known = ", ".join(sorted(BY_MODEL_TYPE))
        raise EaglenestError(f"target model_type {mt!r} is not a known family (known: {known}); add it to eaglenest/models/families.py")
    H, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    if fam.attention == "mla":
        head_dim, kv = int(text["v_head_dim"]), heads
    else:
        head_dim, kv = int(text.get("head_dim") or H // heads), int(text.get("num_key_value_heads") or heads)
    arch = (top.get("architectures") or [fam.architecture])[0]
    cap = text.get(fam.logit_softcap_key) if fam.logit_softcap_key else None
    mla = {k: text.get(k) for k in MLA_FIELDS} if fam.attention == "mla" else None
    return TargetFacts(
        family=fam,
        model_type=mt,
        architecture=arch,
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=H,
        vocab_size=int(text["vocab_size"]),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=text.get("intermediate_size"),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(text.get("max_position_embeddings", 8192)),
        rope_parameters=normalized_rope(text),
        logit_softcap=float(cap) if cap else None,
        config=text,
        mla=mla,
    )


def final_norm(h, weight, eps: float):
    """The target's final RMS norm of a pre-norm state (vLLM's): x / rms(x) * `weight`, where
    `weight` is target_head's multiplier (Gemma's 1 + w already added)."""
    return h * h.pow(2).mean(-1, keepdim=True).add(eps).rsqrt() * weight


def soft_cap(logits, cap: float | None):
    """The target's tanh soft-capping of its final logits (Gemma 2); the identity when it has none."""
    return logits if not cap else (logits / cap).tanh() * cap


def decoder_layers(model) -> Any:
    """The decoder layers (a ModuleList) of a loaded transformers causal LM, multimodal included."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(base, "layers") and hasattr(base, "language_model"):
        base = base.language_model
    return base.layers


def eos_token_ids(model_path: str | Path, tokenizer: Any = None) -> list[int]:
    """The stop ids: ONE rule for capture, regenerate, train and eval.  The union of config.json's
    and generation_config.json's `eos_token_id`, the tokenizer's eos token, and the end-of-turn
    token the chat template puts right after an assistant message (e.g. `<|im_end|>`, `<|eot_id|>`,
    `<end_of_turn>`), found by rendering one conversation, not from a list of known strings."""
    path = Path(model_path)
    ids: list[int] = []

    def add(v) -> None:
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, int) and not isinstance(x, bool) and x >= 0:
                ids.append(x)

    for name in ("config.json", "generation_config.json"):
        if not (path / name).exists():  # generation_config.json is optional
            continue
        try:
            cfg = json.loads((path / name).read_text())
        except json.JSONDecodeError as e:
            raise EaglenestError(f"{path / name}: not valid JSON ({e})") from None
        add(cfg.get("eos_token_id"))
        add((cfg.get("text_config") or {}).get("eos_token_id"))
    if tokenizer is None and (path / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
        add(end_of_turn_id(tokenizer))
    return list(dict.fromkeys(ids))


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token a chat template puts right after an assistant message's content, or None."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    mark = "EAGLENESTENDOFTURNPROBE"
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}], tokenize=False
        )
    except TemplateError:  # a template that refuses a user/assistant pair: no end-of-turn to read off it
        return None
    k = text.find(mark)
    if k < 0:
        return None
    after = tokenizer(text[k + len(mark) :], add_special_tokens=False)["input_ids"]
    special = special_token_ids(tokenizer) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})  # any added token
    return after[0] if after and after[0] in special else None


def special_token_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's special tokens: its named ones (bos, eos, pad, unk, mask, additional) and every
    added token it marks special.  The one rule for "special" (the draft vocabulary's filler, DFlash's
    default mask token, the end-of-turn probe)."""
    ids = {int(i) for i in tokenizer.all_special_ids if i is not None}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return ids | {int(i) for i, t in added.items() if getattr(t, "special", False)}
