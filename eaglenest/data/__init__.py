"""The `prepare` stage: conversations -> token ids + loss masks in a DATA_DIR, and its reader.

    from eaglenest.data import PreparedData
    d = PreparedData(DATA_DIR)
    for s in d: s.id, s.input_ids, s.loss_mask

`write_prepared` / `PreparedWriter` write the same layout for later stages (regenerate).
"""

from eaglenest.data.pipeline import prepare
from eaglenest.data.store import PreparedData, PreparedWriter, Sample, write_prepared

__all__ = ["PreparedData", "PreparedWriter", "Sample", "prepare", "write_prepared"]
