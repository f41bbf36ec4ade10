"""The draft layer's shape: chosen per target family, overridable by flags, printed by `train`.

The draft is one decoder layer at the target's hidden size (both engines feed it the target's
embeddings and fuse the aux states to that width).  Its attention kind (`--draft-attention`:
gqa = Llama attention, mla = DeepSeek-V2 latent attention, auto = the target family's kind) and
its attention and MLP widths are free choices, and copying the target's config fields is right
only for Llama-like targets:

  * GQA targets (Llama, Qwen, Gemma, ...): the target's heads, KV heads, head_dim and
    intermediate_size (what SpecForge and the EAGLE reference do).
  * MLA targets (DeepSeek-V2/V3, Kimi-K2, GLM-4-MoE-Lite): their config's `head_dim` is
    `qk_rope_head_dim` (64 in DeepSeek-V3) and `intermediate_size` is the dense FFN of the first
    layers.  The published Kimi-K2.5 EAGLE-3 draft (engines.md §4) uses the target's heads,
    head_dim = `v_head_dim` (128), KV heads = heads, and intermediate 12288 = 12/7 x hidden;
    those are the defaults here (`Family.draft_intermediate_ratio`).
  * MLA drafts (`--draft-attention mla`): on an MLA target, the target's heads and latent sizes
    (q_lora_rank, kv_lora_rank, qk_nope/qk_rope/v_head_dim) and its intermediate_size: the
    published Kimi-K2.5 MLA draft's config (TorchSpec `kimi_k25_eagle3_mla.json`: 64 heads, 1536 /
    512 / 128 / 64 / 128, intermediate 18432 = the target's).  A target without q_lora_rank gets
    3 x kv_lora_rank (DeepSeek-V3's 1536 / 512; SGLang's MLA draft needs a q_lora_rank).  On a
    non-MLA target: DeepSeek-V2's proportions in units of the target's head_dim d (the paper's
    d_c = 4d, d_R = d/2, q rank 3 d_c; nope = v = d), the target's heads and intermediate_size.

Layers: both engines load drafts with more than one layer, but read different norms in layers
>= 1 (SGLang 0.5.23 llama_eagle3.py: `hidden_norm`; vLLM 0.32 llama_eagle3.py: `input_layernorm`),
and eaglenest's draft (draft/model.py) has exactly one; so the layer count is not a choice here.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglenest import EaglenestError

from eaglenest.models.target import MLA_FIELDS

FLAGS = {  # DraftShape field -> command-line flag
    "num_attention_heads": "--draft-heads",
    "num_key_value_heads": "--draft-kv-heads",
    "head_dim": "--draft-head-dim",
    "intermediate_size": "--draft-intermediate-size",
    "q_lora_rank": "--draft-q-lora-rank",
    "kv_lora_rank": "--draft-kv-lora-rank",
    "qk_nope_head_dim": "--draft-qk-nope-head-dim",
    "qk_rope_head_dim": "--draft-qk-rope-head-dim",
    "v_head_dim": "--draft-v-head-dim",
}
GQA_ONLY = ("num_key_value_heads", "head_dim")  # MLA's keys and values come from the latent
ATTENTION_CHOICES = ["gqa", "mla", "auto"]


@dataclass(frozen=True)
class DraftShape:
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    source: dict  # field -> where its value came from (printed at the start of training)
    attention: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    def attention_fields(self) -> dict:
        """The DraftConfig fields of the attention kind (MLA sizes None for gqa)."""
        return {"attention": self.attention, **{k: getattr(self, k) for k in MLA_FIELDS}}

    def fields(self) -> tuple[str, ...]:
        """The fields that mean something for this kind (what describe() prints)."""
        if self.attention == "mla":
            return tuple(k for k in FLAGS if k not in GQA_ONLY)
        return tuple(k for k in FLAGS if k not in MLA_FIELDS)


def resolve_attention(choice: str, facts) -> str:
    """`auto` = the target family's own attention kind (mla for DeepSeek/Kimi/GLM-Lite targets)."""
    if choice == "auto":
        return facts.family.attention
    if choice not in ("gqa", "mla"):
        raise EaglenestError(f"--draft-attention must be one of {', '.join(ATTENTION_CHOICES)} (got {choice!r})")
    return choice


def default_shape(facts, attention: str = "gqa") -> DraftShape:
    """The family's default for a target (`models.target.TargetFacts`) and an attention kind."""
    fam = facts.family
    attention = resolve_attention(attention, facts)
    src = {}
    if fam.attention == "mla":
        why = f"{fam.name} (MLA): heads = target heads, head_dim = v_head_dim, KV heads = heads"
        heads, kv, hd = facts.num_attention_heads, facts.num_attention_heads, facts.head_dim
        src.update(num_attention_heads=why, num_key_value_heads=why, head_dim=why)
    else:
        heads, kv, hd = facts.num_attention_heads, facts.num_key_value_heads, facts.head_dim
        src.update(num_attention_heads="target", num_key_value_heads="target", head_dim="target")
    mla = {}
    if attention == "mla":
        mla, why = _mla_default(facts)
        src.update({k: why for k in MLA_FIELDS}, num_attention_heads="target")
        kv, hd = heads, mla["v_head_dim"]
        src.update(num_key_value_heads="MLA: = heads", head_dim="MLA: = v_head_dim")
    if attention == "mla" and fam.attention == "mla" and facts.intermediate_size:
        inter = int(facts.intermediate_size)
        src["intermediate_size"] = "target (the published Kimi-K2.5 MLA draft's choice)"
    elif fam.draft_intermediate_ratio:
        inter = max(64, round(facts.hidden_size * fam.draft_intermediate_ratio / 64) * 64)
        src["intermediate_size"] = f"{fam.name}: {fam.draft_intermediate_ratio:.4g} x hidden (the published Kimi-K2.5 draft's ratio)"
    elif facts.intermediate_size:
        inter = int(facts.intermediate_size)
        src["intermediate_size"] = "target"
    else:
        raise EaglenestError(f"target ({fam.name}) has no intermediate_size: pass {FLAGS['intermediate_size']}")
    return DraftShape(heads, kv, hd, inter, src, attention, **mla)


def _mla_default(facts) -> tuple[dict, str]:
    if facts.mla is not None and facts.mla.get("kv_lora_rank"):
        m = {k: (int(v) if v is not None else None) for k, v in facts.mla.items()}
        why = f"target ({facts.family.name})"
        if m["q_lora_rank"] is None:
            m["q_lora_rank"] = 3 * m["kv_lora_rank"]
            why += "; q_lora_rank = 3 x kv_lora_rank (the target has none; SGLang's MLA draft needs one)"
        return m, why
    d = facts.head_dim
    return ({"q_lora_rank": 12 * d, "kv_lora_rank": 4 * d, "qk_nope_head_dim": d, "qk_rope_head_dim": max(2, d // 2), "v_head_dim": d},
            f"DeepSeek-V2 proportions of the target's head_dim {d} (kv rank 4d, rope d/2, q rank 12d)")


def draft_shape(facts, overrides: dict | None = None, attention: str = "gqa") -> DraftShape:
    """The family default with `overrides` ({field: int}, e.g. from the flags) applied and validated."""
    base = default_shape(facts, attention)
    values = {k: getattr(base, k) for k in FLAGS}
    source = dict(base.source)
    meant = base.fields()
    for k, v in (overrides or {}).items():
        if k not in FLAGS:
            raise EaglenestError(f"unknown draft shape field {k!r} (one of {', '.join(FLAGS)})")
        if v is not None:
            if k not in meant:
                raise EaglenestError(f"{FLAGS[k]} does not apply to a {base.attention} draft (--draft-attention {base.attention})")
            values[k], source[k] = int(v), f"{FLAGS[k]}"
    if base.attention == "mla":
        values.update(num_key_value_heads=values["num_attention_heads"], head_dim=values["v_head_dim"])
        rope_type = facts.rope_parameters.get("rope_type", "default")
        if rope_type not in ("default", "yarn"):
            raise EaglenestError(f"--draft-attention mla on a target with rope_type {rope_type!r}: both engines' MLA layers apply "
                                 "DeepSeek's YaRN to any scaled rope, so such a draft could not be served as trained")
    for k in meant:
        if values[k] < 1:
            raise EaglenestError(f"{FLAGS[k]} must be at least 1 (got {values[k]})")
    if values["num_attention_heads"] % values["num_key_value_heads"]:
        raise EaglenestError(
            f"draft heads {values['num_attention_heads']} must be a multiple of its KV heads {values['num_key_value_heads']} "
            f"({FLAGS['num_attention_heads']}, {FLAGS['num_key_value_heads']})"
        )
    rope_key = "qk_rope_head_dim" if base.attention == "mla" else "head_dim"
    if values[rope_key] % 2:
        raise EaglenestError(f"{FLAGS[rope_key]} must be even (rotary embedding), got {values[rope_key]}")
    return DraftShape(**values, source=source, attention=base.attention)


def describe(shape: DraftShape, facts) -> str:
    kind = {"gqa": "Llama attention", "mla": "MLA attention"}[shape.attention]
    lines = [f"draft shape for a {facts.family.name} target (hidden {facts.hidden_size}, 1 layer, {kind}; --draft-attention):"]
    for k in shape.fields():
        lines.append(f"  {k} = {getattr(shape, k)}  [{shape.source[k]}; {FLAGS[k]} to change]")
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
                   help="MLP width (default: the target's intermediate_size; MLA targets: 12/7 x hidden for a gqa draft, "
                   "the target's for an mla draft)")
    for k, what in (("q_lora_rank", "query latent rank"), ("kv_lora_rank", "KV latent rank (the cached compressed KV)"),
                    ("qk_nope_head_dim", "per-head q/k width without rope"), ("qk_rope_head_dim", "rope width of q/k (cached, shared by heads)"),
                    ("v_head_dim", "per-head value width")):
        g.add_argument(FLAGS[k], type=int, default=None, metavar="N",
                       help=f"mla drafts: {what} (default: the MLA target's; other targets: DeepSeek-V2 proportions of head_dim)")


def overrides_from_args(args) -> dict:
    """{field: value} for the shape flags given on the command line."""
    values = {k: getattr(args, flag[2:].replace("-", "_"), None) for k, flag in FLAGS.items()}
    return {k: v for k, v in values.items() if v is not None}
