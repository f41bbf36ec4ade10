"""docs/benchmarks.md: host memory of CPU training (bench/train_cpu_memory.py)."""

from __future__ import annotations

from _fmt import num

FILES = ["train_cpu_memory.json"]


def render(results: dict[str, dict]) -> str:
    r = results["train_cpu_memory.json"]
    before, after = (next(x for x in r["runs"] if x["mode"] == m) for m in ("before", "after"))
    return (
        f"- Host memory: variable-length batches make oneDNN build a JIT kernel per matmul shape (kept up to "
        f"{num(int(before['onednn_cache']))} by default) and fragment glibc's heap, so a CPU run's private RSS grows "
        f"({before['rss_anon_mb_peak'] / 1e3:.1f} GB after {before['steps']} steps of the demo recipe). eaglenest caps the "
        f"kernel cache at {after['onednn_cache']} (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, set at import unless you set it) and "
        f"trims the heap every {after['trim_every']} CPU steps: {after['rss_anon_mb_peak'] / 1e3:.1f} GB peak over "
        f"{after['steps']} steps, at {num(after['tokens_per_s'])} vs {num(before['tokens_per_s'])} tok/s "
        f"(`bench/results/train_cpu_memory.json`)."
    )
