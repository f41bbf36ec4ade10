"""The draft layer's shape: chosen per target family, overridable by flags, printed by `train`.

The draft is one Llama decoder layer at the target's hidden size (both engines feed it the
target's embeddings and fuse the aux states to that width).  Its attention and MLP widths are
free choices, and copying the target's config fields is right only for Llama-like targets:

  * GQA targets (Llama, Qwen, Gemma, ...): the target's heads, KV heads, head_dim and
    intermediate_size (what SpecForge and the EAGLE reference do).
  * MLA targets (DeepSeek-V2/V3, Kimi-K2, GLM-4-MoE-Lite): their config's `head_dim` is
    `qk_rope_head_dim` (64 in DeepSeek-V3) and `intermediate_size` is the dense FFN of the first
    layers.  The published Kimi-K2.5 EAGLE-3 draft (engines.md §4) uses the target's heads,
    head_dim = `v_head_dim` (128), KV heads = heads, and intermediate 12288 = 12/7 x hidden;
    those are the defaults here (`Family.draft_intermediate_ratio`).

Layers: both engines load drafts with more than one layer, but read different norms in layers
>= 1 (SGLang 0.5.23 llama_eagle3.py: `hidden_norm`; vLLM 0.32 llama_eagle3.py: `input_layernorm`),
and eaglenest's draft (draft/model.py) has exactly one; so the layer count is not a choice here.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglenest import EaglenestError

FLAGS = {  # DraftShape field -> command-line flag
    "num_attention_heads": "--draft-heads",
    "num_key_value_heads": "--draft-kv-heads",
    "head_dim": "--draft-head-dim",
    "intermediate_size": "--draft-intermediate-size",
}


@dataclass(frozen=True)
class DraftShape:
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    source: dict  # field -> where its value came from (printed at the start of training)


def default_shape(facts) -> DraftShape:
    """The family's default for a target (`models.target.TargetFacts`)."""
    fam = facts.family
    src = {}
    if fam.attention == "mla":
        why = f"{fam.name} (MLA): heads = target heads, head_dim = v_head_dim, KV heads = heads"
        heads, kv, hd = facts.num_attention_heads, facts.num_attention_heads, facts.head_dim
        src.update(num_attention_heads=why, num_key_value_heads=why, head_dim=why)
    else:
        heads, kv, hd = facts.num_attention_heads, facts.num_key_value_heads, facts.head_dim
        src.update(num_attention_heads="target", num_key_value_heads="target", head_dim="target")
    if fam.draft_intermediate_ratio:
        inter = max(64, round(facts.hidden_size * fam.draft_intermediate_ratio / 64) * 64)
        src["intermediate_size"] = f"{fam.name}: {fam.draft_intermediate_ratio:.4g} x hidden (the published Kimi-K2.5 draft's ratio)"
    elif facts.intermediate_size:
        inter = int(facts.intermediate_size)
        src["intermediate_size"] = "target"
    else:
        raise EaglenestError(f"target ({fam.name}) has no intermediate_size: pass {FLAGS['intermediate_size']}")
    return DraftShape(heads, kv, hd, inter, src)


def draft_shape(facts, overrides: dict | None = None) -> DraftShape:
    """The family default with `overrides` ({field: int}, e.g. from the flags) applied and validated."""
    base = default_shape(facts)
    values = {k: getattr(base, k) for k in FLAGS}
    source = dict(base.source)
    for k, v in (overrides or {}).items():
        if k not in FLAGS:
            raise EaglenestError(f"unknown draft shape field {k!r} (one of {', '.join(FLAGS)})")
        if v is not None:
            values[k], source[k] = int(v), f"{FLAGS[k]}"
    for k, v in values.items():
        if v < 1:
            raise EaglenestError(f"{FLAGS[k]} must be at least 1 (got {v})")
    if values["num_attention_heads"] % values["num_key_value_heads"]:
        raise EaglenestError(
            f"draft heads {values['num_attention_heads']} must be a multiple of its KV heads {values['num_key_value_heads']} "
            f"({FLAGS['num_attention_heads']}, {FLAGS['num_key_value_heads']})"
        )
    if values["head_dim"] % 2:
        raise EaglenestError(f"{FLAGS['head_dim']} must be even (rotary embedding), got {values['head_dim']}")
    return DraftShape(**values, source=source)


def describe(shape: DraftShape, facts) -> str:
    lines = [f"draft shape for a {facts.family.name} target (hidden {facts.hidden_size}, 1 Llama layer):"]
    for k, flag in FLAGS.items():
        lines.append(f"  {k} = {getattr(shape, k)}  [{shape.source[k]}; {flag} to change]")
    return "\n".join(lines)


def add_arguments(p) -> None:
    g = p.add_argument_group("draft shape (defaults per target family; printed at the start of training)")
    g.add_argument(FLAGS["num_attention_heads"], type=int, default=None, metavar="N",
                   help="attention heads (default: the target's)")
    g.add_argument(FLAGS["num_key_value_heads"], type=int, default=None, metavar="N",
                   help="KV heads (default: the target's; MLA targets: = heads)")
    g.add_argument(FLAGS["head_dim"], type=int, default=None, metavar="N",
                   help="per-head width (default: the target's head_dim; MLA targets: v_head_dim)")
    g.add_argument(FLAGS["intermediate_size"], type=int, default=None, metavar="N",
                   help="MLP width (default: the target's intermediate_size; MLA targets: 12/7 x hidden)")


def overrides_from_args(args) -> dict:
    """{field: value} for the shape flags given on the command line."""
    values = {k: getattr(args, flag[2:].replace("-", "_"), None) for k, flag in FLAGS.items()}
    return {k: v for k, v in values.items() if v is not None}
