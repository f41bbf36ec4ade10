"""What every draft kind's config has: the target it drafts for (hidden size, vocabularies, rope,
layers read) and its decoder layers' shape.  A kind's own fields live in its subclass (EAGLE-3's
`Eagle3Config` in draft/model.py, DFlash's `DFlashConfig` in draft/dflash.py), and `kind` names the
subclass through the registry (eaglenest/kinds/registry.py `DraftKind.config_class`), so a config
written to JSON reads back as the class it was."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary (embeddings, t2d)
    draft_vocab_size: int  # lm_head rows
    target_hidden_size: int
    aux_layer_ids: list[int]  # capture-before convention (see eaglenest/capture/layers.py)
    target_num_layers: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    target_architecture: str | None = None  # the target's class: the engines' layer-id rules depend on it (export/layer_ids.py)
    num_hidden_layers: int = 1  # decoder layers (EAGLE-3: exactly one)
    # the registered kind this config is (its subclass sets the default; a kind that reuses another's config class,
    # as a test's toy kind does, sets it); configs written before the field existed are EAGLE-3 drafts
    kind: str = ""

    def __post_init__(self):
        if type(self) is DraftConfig:
            raise TypeError("DraftConfig holds what every kind's config has: build a kind's (Eagle3Config, DFlashConfig, "
                            "... : the registry's config_class)")

    @classmethod
    def from_target(cls, tcfg, draft_vocab_size: int, aux_layer_ids: list[int], shape: dict | None = None,
                    attention: str = "gqa", **own) -> "DraftConfig":
        """The target's hidden size, vocabulary and rope (exactly as the target has it); the layer's
        attention sizes / MLP width per target family, with `shape` overrides (draft/shape.py);
        `own`: the kind's own fields."""
        from eaglenest.draft.shape import draft_shape
        from eaglenest.models.target import target_facts

        f = target_facts(tcfg)
        s = draft_shape(f, shape, attention)
        get = tcfg.get if isinstance(tcfg, dict) else (lambda k, d=None: getattr(tcfg, k, d))
        return cls(
            hidden_size=f.hidden_size,
            intermediate_size=s.intermediate_size,
            num_attention_heads=s.num_attention_heads,
            num_key_value_heads=s.num_key_value_heads,
            head_dim=s.head_dim,
            vocab_size=f.vocab_size,
            draft_vocab_size=min(draft_vocab_size, f.vocab_size),
            target_hidden_size=f.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            target_num_layers=f.num_layers,
            rms_norm_eps=f.rms_norm_eps,
            hidden_act="silu",  # a Llama layer whatever the target: SGLang's LlamaMLP supports only silu
            max_position_embeddings=f.max_position_embeddings,
            rope_parameters=f.rope_parameters,
            bos_token_id=get("bos_token_id"),
            eos_token_id=get("eos_token_id"),
            target_architecture=f.architecture,
            **cls.attention_fields(s),
            **own,
        )

    @classmethod
    def attention_fields(cls, shape) -> dict:
        """This class's fields of the attention kind `shape` (draft/shape.py DraftShape) stands for:
        none here (Llama attention, the sizes above); EAGLE-3's MLA option adds its own."""
        if shape.attention != "gqa":
            from eaglenest import EaglenestError

            raise EaglenestError(f"a {cls.__name__} has Llama (gqa) attention only (asked for {shape.attention})")
        return {}

    @property
    def rope_dim(self) -> int:
        """Rotary width (the whole head; a kind with another attention overrides it)."""
        return self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Decoding cache per position and layer: K and V of every KV head."""
        return 2 * self.num_key_value_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        """The config `d` describes, as its kind's class (the base class dispatches on `kind`; a
        subclass reads its own).  Unknown keys are dropped and missing optional ones default: run dirs
        and exports written before a field existed, or when the kinds' fields were one union, load as
        what they were."""
        if cls is DraftConfig:
            from eaglenest.kinds.registry import get

            cls = get(d.get("kind")).config_class
        # an empty or missing kind keeps the class's own
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__ and (k != "kind" or v)})
