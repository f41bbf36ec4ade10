"""Draft: the EAGLE-3 draft head that train fits and export writes: `Eagle3Draft(DraftConfig)`
(model.py, read top to bottom; the kinds are its flags: EAGLE 3.1's fc_norm / norm_output, and
the MLA attention of mla.py beside it), its attention kernels (kernels.py: chunked and flex causal
attention for training), its per-family shape (shape.py) and its reduced vocabulary (vocab.py).

Public entry: `Eagle3Draft(DraftConfig(...))`.
"""

from eaglenest.draft.model import DraftConfig, Eagle3Draft
from eaglenest.draft.vocab import build_vocab, check_vocab

__all__ = ["DraftConfig", "Eagle3Draft", "build_vocab", "check_vocab"]
