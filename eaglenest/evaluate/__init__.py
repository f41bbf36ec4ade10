"""Evaluate: EAGLE-3 speculative decoding of a draft over its target on MT-bench or a prompt file:
tau, acceptance per position, speedup against plain decoding, and greedy equivalence.

Public entry: `run.evaluate(args)` -> the report dict, also written to args.out (`eaglenest eval`;
args: EvalConfig's fields (config.py) plus the evaluators' flags).  specdec.py is the decoder,
verification.py makes its verification exact (the probe, the report's `verification` block) with the
row-wise forwards of rowwise/, mtbench.py the prompts; engines other than transformers plug in as
`engine_<name>.py` modules."""
