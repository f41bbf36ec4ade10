"""A draft directory, whatever its kind: writing it (`save_draft`) and reading it once
(`read_draft` -> `DraftDir`: the kind, its config, tensor names and layer ids), for ours and for
drafts written by other trainers.

DRAFT_DIR/config.json + DRAFT_DIR/model.safetensors (bf16 weights, never embed_tokens).  What the
keys and the config are is the kind's (eaglenest/kinds/: EAGLE-3's portable layout both SGLang and
vLLM load, DFlash's for vLLM); its registry says which kind a config.json is (`kinds.detect`).
Every kind writes the `eaglenest` block, our own exact DraftConfig (engines ignore unknown keys),
and the aux layer ids so that each engine captures the trained layers (export/layer_ids.py).
export/check.py judges how each engine will use a draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglenest import EaglenestError
from eaglenest.draft.config import DraftConfig
from eaglenest.export.layer_ids import ENGINES, trained_layers
from eaglenest.kinds.common import WEIGHT_DTYPE  # noqa: F401 -- re-exported: the dtype of every kind's weights
from eaglenest.kinds.registry import DraftKind, detect
from eaglenest.kinds.registry import get as get_kind
from eaglenest.utils import atomic_write_json, read_json


def expected_tensors(cfg: DraftConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The checkpoint's tensors (name -> (shape, dtype)) for the draft's kind."""
    return get_kind(cfg.kind).expected_tensors(cfg)


def hf_config(cfg: DraftConfig, extra: dict | None = None, engines=ENGINES) -> dict:
    """config.json for the draft's kind; refuses (EaglenestError) layers one of `engines` cannot capture."""
    return get_kind(cfg.kind).hf_config(cfg, extra, engines)


def save_draft(model, out: Path | str, extra: dict | None = None, engines=ENGINES) -> Path:
    """Write the draft; refuses (EaglenestError) a layer set one of `engines` cannot serve."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in model.exported_state_dict().items():
        v = v.detach().cpu()
        sd[k] = v.to(WEIGHT_DTYPE) if v.is_floating_point() else v
        sd[k] = sd[k].contiguous()
    exp = expected_tensors(model.cfg)
    sd = {k: v for k, v in sd.items() if k in exp or k not in ("d2t", "t2d")}  # no mapping for a full vocabulary
    if set(sd) != set(exp):
        raise EaglenestError(f"internal: export keys differ from the contract: {sorted(set(sd) ^ set(exp))}")
    config = hf_config(model.cfg, extra, engines)  # before any file is written: refuses unservable layers
    tmp = out / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    atomic_write_json(out / "config.json", config)
    return out


@dataclass
class DraftDir:
    """One read of a draft directory: eval, check-draft, load_draft and the engines' launchers
    take this instead of reading config.json again."""

    path: Path
    raw: dict  # config.json as written
    kind: DraftKind
    cfg: DraftConfig  # aux_layer_ids [] until `resolve` when another trainer's config omits them
    tensor_names: list[str] | None  # under our names (the kind's spelling); None without model.safetensors

    @property
    def ours(self) -> bool:
        return "eaglenest" in self.raw

    @property
    def layer_ids(self) -> list[int]:
        return list(self.cfg.aux_layer_ids)

    def resolve(self, num_layers: int) -> "DraftDir":
        """Fill the trained layers and the target's layer count for an N-layer target."""
        resolve_aux_layers(self.raw, self.cfg, num_layers)
        return self

    def tensors(self) -> dict[str, torch.Tensor]:
        return read_draft_tensors(self.path, self.kind)


def read_draft(draft_dir: "Path | str | DraftDir") -> DraftDir:
    """Read a draft directory's config.json (and its tensor names) once.  A draft from another
    trainer gets the engines' defaults for what it leaves out (target_hidden_size = hidden_size,
    draft_vocab_size = vocab_size, head_dim = hidden / heads); its aux layers stay [] unless given
    (`DraftDir.resolve` fills them once the target's layer count is known)."""
    if isinstance(draft_dir, DraftDir):
        return draft_dir
    draft_dir = Path(draft_dir)
    raw = read_json(draft_dir / "config.json", "draft config")
    kind = detect(raw)
    if "eaglenest" in raw and "draft_config" in raw["eaglenest"]:
        cfg = DraftConfig.from_dict(raw["eaglenest"]["draft_config"])
    else:
        cfg = kind.read_config(raw, draft_dir)
    path = draft_dir / "model.safetensors"
    names = None
    if path.exists():
        try:
            with safe_open(str(path), framework="pt") as f:
                names = [kind.tensor_name(k) for k in f.keys()]
        except Exception:  # noqa: BLE001 -- a torn file: read_draft_tensors says so when the weights are read
            names = None
    return DraftDir(draft_dir, raw, kind, cfg, names)


def resolve_aux_layers(raw: dict, cfg: DraftConfig, num_layers: int) -> DraftConfig:
    """Fill a draft's trained layers and target layer count for an N-layer target (export/layer_ids.py
    `trained_layers`: our record, else the other trainer's convention, else the canonical layers)."""
    if not cfg.aux_layer_ids:
        cfg.aux_layer_ids = trained_layers(raw, num_layers)[0]
    if not cfg.target_num_layers:
        cfg.target_num_layers = num_layers
    return cfg


def read_draft_tensors(draft_dir: Path | str, kind: "DraftKind | str | None" = None) -> dict[str, torch.Tensor]:
    """The draft's tensors under our names (the kind's `tensor_name`: EAGLE-3 reads speculators'
    `layers.0.` as `midlayer.`; DFlash keeps `layers.N.`)."""
    kind = kind if isinstance(kind, DraftKind) else get_kind(kind)
    path = Path(draft_dir) / "model.safetensors"
    if not path.exists():
        raise EaglenestError(f"{path} not found: not an exported draft")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {kind.tensor_name(k): f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a torn or foreign file
        raise EaglenestError(f"{path}: cannot read the weights ({type(e).__name__}: {e})") from None


def load_draft(
    draft_dir: "Path | str | DraftDir",
    embed_weight: torch.Tensor | None = None,
    target_config=None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    lm_head_weight: torch.Tensor | None = None,
):
    """Load a draft (ours or another trainer's); `embed_weight` is the target's input embedding
    matrix, which the draft uses like both engines do when sizes match (an `embed_tokens` in the
    file is not used: check-draft says when vLLM would use it instead); `lm_head_weight`, the
    target's output head, serves a draft that ships none where the engines share the target's."""
    d = read_draft(draft_dir)
    why = d.kind.load_refusal(d.raw)
    if why:
        raise EaglenestError(f"{d.path}: {why}")
    cfg = d.cfg
    if target_config is not None:
        d.resolve(target_config.num_hidden_layers)
    tensors = d.tensors()
    tensors.pop("embed_tokens.weight", None)
    d.kind.complete_tensors(cfg, tensors, lm_head_weight)
    model = d.kind.model(cfg, embed_weight=embed_weight)
    if "d2t" not in tensors and cfg.draft_vocab_size == cfg.vocab_size:  # full vocabulary: identity mapping
        model.set_vocab(torch.zeros(cfg.vocab_size, dtype=torch.int64), torch.ones(cfg.vocab_size, dtype=torch.bool))
        tensors.update(d2t=model.d2t, t2d=model.t2d)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens", "rotary"))]
    if missing or unexpected:
        raise EaglenestError(f"{d.path}: draft weights do not match the {d.kind.layout(cfg)} layout "
                             f"(missing {missing}, unexpected {unexpected})")
    return model.to(device=device, dtype=dtype).eval()
