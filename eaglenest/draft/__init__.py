"""Draft: the draft models train fits and export writes -- the EAGLE-3 head `Eagle3Draft(DraftConfig)`
(model.py, read top to bottom; EAGLE 3.1's fc_norm / norm_output are its flags, and the MLA
attention of mla.py its other attention) and its sibling the DFlash block drafter `DFlashDraft`
(dflash.py), their attention kernels (kernels.py: chunked and flex causal attention for training,
DFlash's block attention), the per-family shape (shape.py) and the reduced vocabulary (vocab.py).

Public entry: `draft_model(DraftConfig(...))` (the class its `kind` names).
"""

from eaglenest.draft.model import DraftConfig, Eagle3Draft
from eaglenest.draft.vocab import build_vocab, check_vocab

KINDS = ("eagle3", "dflash")


def draft_model(cfg: DraftConfig, embed_weight=None):
    """The draft model of `cfg.kind` (EAGLE-3 or DFlash) on the target's embeddings."""
    if cfg.kind == "dflash":
        from eaglenest.draft.dflash import DFlashDraft

        return DFlashDraft(cfg, embed_weight=embed_weight)
    if cfg.kind != "eagle3":
        from eaglenest import EaglenestError

        raise EaglenestError(f"unknown draft kind {cfg.kind!r} (one of {', '.join(KINDS)})")
    return Eagle3Draft(cfg, embed_weight=embed_weight)


__all__ = ["KINDS", "DraftConfig", "Eagle3Draft", "build_vocab", "check_vocab", "draft_model"]
