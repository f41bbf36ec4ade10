"""docs/benchmarks.md: the feature store's read path at the seed's shape (bench/loader.py)."""

from __future__ import annotations

import math

from _fmt import cpu, num

FILES = ["loader_bf16.json", "loader_fp8.json"]


def render(results: dict[str, dict]) -> str:
    b, f = results["loader_bf16.json"], results["loader_fp8.json"]

    def run(r):
        return (f"{r['loader_mb_per_s']:.0f} MB/s = {num(r['tokens_per_s'])} tokens/s (**{r['ratio_to_disk']:.2f}x** the disk) "
                f"from the {r['store_dtype']} store with {r['threads']} loader thread{'s' * (r['threads'] > 1)}")

    def tok_per_core(r):  # tokens one loader core delivers: bytes/token x CPU seconds per GB
        return 1e9 / (r["cpu_s_per_gb"] * r["bytes_per_token"])

    loads = [x["loadavg_before"][0] for r in (b, f) for x in r["runs"]]
    return (
        f"**Feeding the GPUs** (`bench/loader.py`, `bench/results/loader_{{bf16,fp8}}.json`): a synthetic store at the "
        f"seed's shape (hidden {b['hidden']}, samples of {num(b['store']['sample_tokens'][0])}-{num(b['store']['sample_tokens'][1])} "
        f"tokens, {b['store']['bytes'] / 1e9:.1f} GB bf16 / {f['store']['bytes'] / 1e9:.1f} GB fp8) read cold the way "
        f"`eaglenest train` reads it (its schedule's shuffled micro-batches, collated with their row plans by its prefetcher's "
        f"`--loader-threads`), {b['read_gb_per_run']:g} GB per run, "
        f"against the disk's raw O_DIRECT sequential read in the same run. Measured on {cpu(b)} ({b['machine']['cpu_count']} "
        f"cores, load {min(loads):.1f}-{max(loads):.1f} at the loader runs' starts): the disk read {num(b['disk_mb_per_s'])} MB/s "
        f"(bf16 run) and {num(f['disk_mb_per_s'])} MB/s (fp8 run) raw; the loader delivered {run(b)} and {run(f)}. The cost "
        f"that does not depend on the load is CPU time: {b['cpu_s_per_gb']:.1f} CPU-s per GB of bf16 "
        f"(~{num(tok_per_core(b))} tokens/s per loader core) and {f['cpu_s_per_gb']:.1f} per GB of fp8 "
        f"(~{num(tok_per_core(f))} tokens/s per core; fp8 holds half the bytes per token). Matching this disk takes "
        f"~{b['cores_to_match_disk']:.1f} cores for bf16 and ~{f['cores_to_match_disk']:.1f} for fp8 (`cores_to_match_disk`). "
        f"**The goal ({b['goal']}) is {'met' if min(b['ratio_to_disk'], f['ratio_to_disk']) >= 0.8 else 'not met'} on "
        f"{b['machine']['cpu_count']} shared cores**; a GPU node needs about {math.ceil(b['cores_to_match_disk'])} (bf16) or "
        f"{math.ceil(f['cores_to_match_disk'])} (fp8) loader cores per disk of this speed (`--loader-threads`); not run on a "
        f"GPU node."
    )
