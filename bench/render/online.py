"""docs/benchmarks.md: online vs offline on this CPU (bench/online.py)."""

from __future__ import annotations

from _fmt import cpu, num

FILES = ["online.json"]


def render(results: dict[str, dict]) -> str:
    r = results["online.json"]
    off, on, s, rc = r["arms"]["offline"], r["arms"]["online"], r["summary"], r["recipe"]
    d = s["tau"]["online_minus_offline"]
    m = on["online_memory"]
    return (
        f"- **Measured** (`bench/results/online.json`, {cpu(r)}, {r['machine']['cpu_count']} cores; the demo's recipe on "
        f"{num(rc['samples'])} of its {num(rc['demo_samples'])} conversations = {num(rc['prepared_tokens'])} tokens, "
        f"{on['steps']} steps, both arms in one run): offline capture {off['stages']['capture']['wall_s']:.0f} s + train "
        f"{off['stages']['train']['wall_s']:.0f} s = **{off['wall_s']:.0f} s**, peak RSS {off['peak_rss_mb'] / 1e3:.1f} GB, a "
        f"{s['feature_store_bytes_offline'] / 2**20:,.0f} MiB store; online **{on['wall_s']:.0f} s** "
        f"({s['wall_online_over_offline']:.2f}x), peak RSS {on['peak_rss_mb'] / 1e3:.1f} GB (target "
        f"{m['target_bytes'] / 2**20:,.0f} MiB, draft parameters {m['draft_bytes'] / 2**20:,.0f} MiB, feature queue ≤ "
        f"{m['queue_bytes_max'] / 2**20:,.0f} MiB), nothing on disk; **τ {s['tau']['offline']:.3f} offline vs "
        f"{s['tau']['online']:.3f} online** on {rc['eval']['limit']} MT-bench questions (paired bootstrap of the difference: "
        f"{d['diff']:+.3f}, 95 % interval [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}])."
    )
