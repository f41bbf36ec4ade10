"""Prepare (and regenerate): conversations -> the target's chat template -> token ids and loss masks
in a DATA_DIR (parquet shards + meta.json), and its reader.

Public entry: `prepare(model=, data=, out=, ...)` (`eaglenest prepare`, options: PrepareConfig in
config.py); later stages read the result with `PreparedData(DATA_DIR)`:

    d = PreparedData(DATA_DIR)
    for s in d: s.id, s.input_ids, s.loss_mask

`eaglenest regenerate` (regenerate.py, RegenerateConfig) rewrites the assistant turns with the
target's own answers; `write_prepared` / `PreparedWriter` write the same layout.
"""

from eaglenest.data.pipeline import prepare
from eaglenest.data.store import PreparedData, PreparedWriter, Sample, write_prepared

__all__ = ["PreparedData", "PreparedWriter", "Sample", "prepare", "write_prepared"]
