"""Features: the on-disk feature store that capture writes and train reads (store.py: layout,
checksums, durability rules), and what `eaglenest features` does to stores (ops.py: stats,
convert, merge; verify on the store itself).

Public entry: `FeatureStore(FEAT_DIR)` (reads; `FeatureWriter` writes).  CLI options: config.py.
"""

from eaglenest.features.store import FeatureStore, FeatureWriter, StoreMeta, estimate_bytes

__all__ = ["FeatureStore", "FeatureWriter", "StoreMeta", "estimate_bytes"]
