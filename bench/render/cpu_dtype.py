"""docs/benchmarks.md: bf16 autocast vs fp32 for the real training step (bench/train_cpu_dtype.py)."""

from __future__ import annotations

from _fmt import cpu, num, seq

FILES = ["train_cpu_dtype.json"]


def render(results: dict[str, dict]) -> str:
    r = results["train_cpu_dtype.json"]
    f, b, acc = r["runs"]["fp32"], r["runs"]["bf16"], r["heldout_acc_after_steps"]
    return (
        f"- `train --dtype bf16` runs bf16 autocast on the CPU. On CPUs with bf16 matrix instructions (Intel AMX or "
        f"AVX512-BF16: `grep -o 'amx_bf16\\|avx512_bf16' /proc/cpuinfo`) the real training step (demo recipe, real "
        f"SmolLM2 features, {cpu(r)}) is {r['bf16_speedup']['first_epoch']:.2f}x fp32's "
        f"({num(b['first_epoch']['tokens_per_s'])} vs {num(f['first_epoch']['tokens_per_s'])} tok/s; "
        f"{num(b['argmax_cached']['tokens_per_s'])} vs {num(f['argmax_cached']['tokens_per_s'])} once the target's argmax "
        f"is cached), with losses within {100 * r['loss_max_rel_diff_first_epoch']:.1f} % over {r['steps_per_phase']} "
        f"steps and held-out accuracy per TTT position after {acc['steps']} steps {seq(acc['bf16'], 3)} (bf16) vs "
        f"{seq(acc['fp32'], 3)} (fp32) (`bench/results/train_cpu_dtype.json`). Elsewhere bf16 is emulated and slower, so "
        f"`--dtype auto` stays fp32 on CPUs and `eaglenest demo` picks bf16 only where those instructions exist. In runs "
        f"of more than one epoch the trainer computes the target's full-vocabulary argmax once per micro-batch and reuses "
        f"it ({f['argmax_cached']['tokens_per_s'] / f['first_epoch']['tokens_per_s']:.2f}x in fp32 on SmolLM2)."
    )
