"""Evaluation: EAGLE-3 speculative decoding (tau, acceptance per position, speedup) on MT-bench
or a prompt file.  `specdec` is the decoder, `mtbench` the prompts, `run` the `eaglenest eval`
command (engines other than transformers plug in as `engine_<name>.py` modules)."""
