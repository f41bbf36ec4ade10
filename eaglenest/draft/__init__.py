"""Draft: the draft models train fits and export writes -- the EAGLE-3 head `Eagle3Draft(Eagle3Config)`
(model.py, read top to bottom; EAGLE 3.1's fc_norm / norm_output are its flags, and the MLA
attention of mla.py its other attention) and its sibling the DFlash block drafter
`DFlashDraft(DFlashConfig)` (dflash.py), the fields every kind's config has (config.py:
`DraftConfig`, whose `from_dict` returns the class a config's `kind` names), the pieces they share
(layers.py), their attention kernels (kernels.py: chunked and flex causal attention for training,
DFlash's block attention), the per-family shape (shape.py) and the reduced vocabulary (vocab.py).

Public entry: `draft_model(cfg)` (the model its `kind` names: eaglenest/kinds/).
"""

from eaglenest.draft.config import DraftConfig
from eaglenest.draft.model import Eagle3Config, Eagle3Draft
from eaglenest.draft.vocab import build_vocab, check_vocab


def draft_model(cfg: DraftConfig, embed_weight=None):
    """The draft model of `cfg.kind` (its kind's module, eaglenest/kinds/) on the target's embeddings."""
    from eaglenest.kinds.registry import get

    return get(cfg.kind).model(cfg, embed_weight=embed_weight)


__all__ = ["DraftConfig", "Eagle3Config", "Eagle3Draft", "build_vocab", "check_vocab", "draft_model"]
