"""`eaglenest train --model TARGET --features FEAT_DIR --out RUN_DIR` (also under torchrun)."""

from __future__ import annotations

import argparse
import dataclasses

from eaglenest import EaglenestError


def register(sub) -> None:
    from eaglenest.train.trainer import TrainConfig

    d = TrainConfig(model="", features="", out="")
    p = sub.add_parser(
        "train",
        help="train the EAGLE-3 draft head with training-time test",
        description="Train an EAGLE-3 draft (one Llama layer over the target's fused aux states) with training-time "
        "test on a feature store. Logs per-position loss/accuracy to RUN_DIR/metrics.jsonl and PNG plots; "
        "checkpoints in RUN_DIR/checkpoints. Multi-GPU/CPU: torchrun --nproc-per-node N -m eaglenest train ...",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="target checkpoint directory or known name (smollm2)")
    p.add_argument("--features", required=True, help="feature store written by `eaglenest capture`")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--config", default=None, help="YAML file with any of these options (command-line flags win)")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="unrolled draft steps (k)")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help="draft vocabulary size (capped at the target's)")
    p.add_argument("--epochs", type=float, default=d.epochs, help="passes over the training split")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW, beta2 0.95)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up steps (0: 3%% of the run)")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help="padded tokens per micro-batch")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step (global)")
    p.add_argument("--max-len", type=int, default=d.max_len, help="truncate samples to this many tokens")
    p.add_argument("--eval-fraction", type=float, default=d.eval_fraction, help="held-out share of samples (by id hash)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between held-out evals (0: ~10 per run)")
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "bf16", "fp32"], help="auto: bf16 autocast on CUDA, fp32 on CPU; bf16 also works on CPUs with AVX512-BF16/AMX")
    p.add_argument("--init-head", default=d.init_head, choices=["target", "random"], help="initialize lm_head/norm from the target's")
    p.add_argument("--fc-init", default=d.fc_init, choices=["scaled", "high", "random"], help="fc init: scaled = whitened by the aux features' RMS; high = scaled + identity on the high aux layer")
    p.add_argument("--freeze-head", action="store_true", help="keep lm_head at the target's rows (faster; EAGLE-1 style)")
    p.add_argument("--resume", action="store_true", help="continue from RUN_DIR's latest checkpoint")
    p.add_argument("--attn-impl", default=d.attn_impl, choices=["auto", "eager", "chunked", "flex"],
                   help="TTT attention: auto = flex on CUDA, eager on CPU; chunked = flash-style in plain torch (all equal)")
    p.add_argument("--recompute", default=d.recompute, choices=["auto", "none", "layer"],
                   help="activation checkpointing of each TTT step (auto: on CUDA when activations would not fit)")
    p.add_argument("--logits-chunk", type=int, default=d.logits_chunk, help="rows of draft logits alive at once (0: auto)")
    from eaglenest.draft import shape

    shape.add_arguments(p)
    p.set_defaults(func=_run)


def config_from_args(args) -> "TrainConfig":  # noqa: F821
    from eaglenest.train.trainer import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {}
    if args.config:
        import yaml

        try:
            with open(args.config) as f:
                y = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise EaglenestError(f"{args.config}: cannot read YAML config ({e})") from None
        bad = sorted(set(y) - fields)
        if bad:
            raise EaglenestError(f"{args.config}: unknown option(s) {bad}; valid: {sorted(fields)}")
        values.update(y)
    defaults = TrainConfig(model="", features="", out="")
    for k in fields:
        v = getattr(args, k, None)
        # a flag given on the command line (differs from its default) wins over the YAML file
        if v is not None and (k not in values or v != getattr(defaults, k)):
            values[k] = v
    from eaglenest.draft.shape import overrides_from_args

    values["draft_shape"] = {**(values.get("draft_shape") or {}), **overrides_from_args(args)}
    cfg = TrainConfig(**values)
    for name in ("ttt_steps", "draft_vocab", "batch_tokens", "grad_accum", "max_len"):
        if getattr(cfg, name) <= 0:
            raise EaglenestError(f"--{name.replace('_', '-')} must be positive (got {getattr(cfg, name)})")
    if not 0 <= cfg.eval_fraction < 1:
        raise EaglenestError(f"--eval-fraction must be in [0, 1) (got {cfg.eval_fraction})")
    return cfg


def _run(args) -> int:
    from eaglenest.train.trainer import Trainer

    res = Trainer(config_from_args(args)).fit()
    if res["checkpoint"]:
        print(res["checkpoint"])
    return 0
