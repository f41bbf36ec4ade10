"""The on-disk feature store (see store.py for the layout and its durability rules)."""

from eaglenest.features.store import FeatureStore, FeatureWriter, StoreMeta, estimate_bytes

__all__ = ["FeatureStore", "FeatureWriter", "StoreMeta", "estimate_bytes"]
