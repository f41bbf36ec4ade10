"""Capture: run the target on exact token ids and keep the EAGLE-3 states (see run.py)."""

from eaglenest.capture.layers import CONVENTION, default_layer_ids, from_output_of, to_output_of

__all__ = ["CONVENTION", "default_layer_ids", "from_output_of", "to_output_of"]
