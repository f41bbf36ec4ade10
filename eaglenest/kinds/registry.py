"""The registry of draft kinds: one `DraftKind` object per kind, keyed by its name.

The trainer, export, check-draft and eval ask `get(name)` (or `detect(config.json)`) for the kind
and call its hooks; none of them tests a kind's name.  The built-in kinds are modules named in
`BUILTIN`, imported by name on the first lookup (like transformers' Auto classes), so this module
imports none of them and no kind module is imported by the stages that use it: a new kind is one
module that calls `register(...)` when imported (a test may register one directly).

`DraftKind` lists every hook with its default; a kind overrides what it does differently.
"""

from __future__ import annotations

import importlib

from eaglenest import EaglenestError

# kind name -> module that registers it (imported on first use)
BUILTIN = {"eagle3": "eaglenest.kinds.eagle3", "dflash": "eaglenest.kinds.dflash"}
# what a config.json without our record and without another kind's marks is (other trainers' EAGLE-3 drafts),
# and what a config written before the `kind` field existed was
DEFAULT = "eagle3"

_KINDS: dict[str, "DraftKind"] = {}


class DraftKind:
    """One draft kind's hooks, by stage.  Method arguments: `cfg` the DraftConfig, `tc` the run's
    TrainConfig, `raw` a draft's config.json as written."""

    name: str = ""
    title: str = ""  # in messages: "an EAGLE-3 draft"

    config_class: type | None = None  # the kind's DraftConfig subclass (draft/config.py): only its own fields

    # --- train -----------------------------------------------------------------------------------
    aux_count: int | None = None  # the number of target layers the draft reads, when fixed
    online_layers: str = "auto"  # what --layers auto captures in an online run (capture/layers.py parse_layer_ids)
    default_init_head: str = "target"  # --init-head auto
    needs_teacher: bool = True  # trains against the target's distribution (else hard labels)

    def check_train_options(self, tc) -> None:
        """Refuse TrainConfig options this kind cannot train (EaglenestError)."""

    def train_config(self, tcfg, draft_vocab_size: int, layer_ids: list[int], tc):
        """The run's config: the target `tcfg`'s shape and vocabulary (DraftConfig.from_target) with
        this kind's own fields from the run's options `tc`."""
        return self.config_class.from_target(tcfg, draft_vocab_size, layer_ids, shape=tc.draft_shape, kind=self.name)

    def model(self, cfg, embed_weight=None):
        raise NotImplementedError

    def init_model(self, model, qk_gain: float = 1.0) -> None:
        """Kind-specific initialization after the generic N(0, 0.02) (train/setup.py init_weights)."""

    def objective(self, tc, cfg, *, teacher, device, autocast, attn, recompute, argmax_room):
        raise NotImplementedError

    def bind_objective(self, objective, model) -> None:
        """Hand the objective what it needs from the built model."""

    def step_denominators(self, objective, data, step):
        """This rank's loss normalizers of a step (train/trainer.py)."""
        return data.denom

    def serve_steps(self, positions: int, tc) -> int:
        """The serve steps the training log predicts tau for."""
        return tc.predicted_steps()

    def export_extra(self, train: dict) -> dict:
        """Kind-specific keys of the exported `eaglenest` block, from the run's train options."""
        return {}

    # --- the draft directory --------------------------------------------------------------------
    default_engines: tuple[str, ...] | None = None  # engines `export` checks by default (None: all)
    vllm_method: str = ""  # vLLM's --speculative-config method
    sglang_algorithm: str = ""  # SGLang's --speculative-algorithm

    def expected_tensors(self, cfg) -> dict:
        raise NotImplementedError

    def hf_config(self, cfg, extra: dict | None, engines) -> dict:
        raise NotImplementedError

    def claims(self, raw: dict) -> bool:
        """Whether another trainer's config.json (no `eaglenest` block) is a draft of this kind."""
        return False

    def read_config(self, raw: dict, draft_dir):
        """Another trainer's config.json as a DraftConfig."""
        raise NotImplementedError

    def tensor_name(self, key: str) -> str:
        """A checkpoint tensor's name under ours (another trainer's spelling)."""
        return key

    def complete_tensors(self, cfg, tensors: dict, lm_head_weight) -> None:
        """Fill what the engines take from the target when the file lacks it (load_draft)."""

    def layout(self, cfg) -> str:
        return self.title

    def load_refusal(self, raw: dict) -> str | None:
        """Why eaglenest's own decoder cannot run this draft (None: it can)."""
        return None

    # --- check-draft and eval -------------------------------------------------------------------
    def judge(self, r, raw: dict, cfg, tensors: dict | None, model=None, trained=None) -> None:
        """check-draft: add each consumer's problems to the Report `r` (export/check.py)."""
        raise NotImplementedError

    def check_fits(self, cfg, num_layers: int, where: str) -> None:
        """Refuse (EaglenestError) target layers that do not fit an N-layer target (eval)."""

    def eval_steps(self, args, cfg, given) -> int | None:
        """eval's draft steps for this draft (None: --steps or the default chain)."""
        return None

    def decoder(self, target, draft, eos, args, **kw):
        """eaglenest's own speculative decoder for this draft (eval --engine hf)."""
        raise NotImplementedError


def register(kind: DraftKind) -> DraftKind:
    """Make `kind` findable by its name (a later registration of the same name replaces it)."""
    if not kind.name:
        raise EaglenestError(f"internal: a draft kind needs a name ({type(kind).__name__})")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    _KINDS.pop(name, None)


def _load_builtins() -> None:
    for name, module in BUILTIN.items():
        if name not in _KINDS:
            importlib.import_module(module)


def names() -> list[str]:
    _load_builtins()
    return list(_KINDS)


def get(name: str | None) -> DraftKind:
    """The kind registered as `name` (None: DEFAULT)."""
    name = name or DEFAULT
    if name not in _KINDS:
        if name in BUILTIN:
            importlib.import_module(BUILTIN[name])
        else:
            _load_builtins()
    if name not in _KINDS:
        raise EaglenestError(f"unknown draft kind {name!r} (one of {', '.join(names())})")
    return _KINDS[name]


def detect(raw: dict) -> DraftKind:
    """The kind of a draft's config.json: our own record, else the first other kind that claims
    it, else DEFAULT (what other trainers' EAGLE-3 drafts are)."""
    ours = (raw.get("eaglenest") or {}).get("draft_config")
    if ours is not None:
        return get(ours.get("kind"))
    _load_builtins()
    for kind in list(_KINDS.values()):
        if kind.name != DEFAULT and kind.claims(raw):
            return kind
    return get(DEFAULT)
