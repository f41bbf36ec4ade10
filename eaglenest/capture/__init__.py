"""Capture: run the target (through any engine) on exactly the prepared token ids and keep the
states of the aux layers (EAGLE-3's three by default, any number with --layers) plus the final
state, in a resumable feature store.

Public entry: `run.run_capture(engine, data, out, ...)` (`eaglenest capture`, options: CaptureConfig
in config.py).  layers.py owns the layer-id convention (capture-before: id k = HF hidden_states[k]).
"""

from eaglenest.capture.layers import CONVENTION, default_layer_ids, from_output_of, spread_layer_ids, to_output_of

__all__ = ["CONVENTION", "default_layer_ids", "from_output_of", "spread_layer_ids", "to_output_of"]
