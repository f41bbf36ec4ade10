"""README block `demo_time`: the full demo per stage, per commit, from bench/results/demo_time.json."""

from __future__ import annotations

FILES = ["demo_time.json"]


def _min(s: float) -> str:
    return f"{s / 60:.1f} min"


def render(results: dict[str, dict]) -> str:
    r = results["demo_time.json"]
    runs = r["runs"]
    cpu = r["cpu"]
    head = "| | " + " | ".join(f"{x['label']} (`{x['commit'][:7]}`)" for x in runs) + " |"
    rows = [head, "|---|" + "---:|" * len(runs)]

    def row(name, fn):
        rows.append(f"| {name} | " + " | ".join(fn(x) for x in runs) + " |")

    row("prepare", lambda x: f"{x['stage_seconds']['prepare']:.0f} s")
    row("capture", lambda x: f"{x['stage_seconds']['capture']:.0f} s ({x['rates']['capture_tokens_per_s']:,.0f} tok/s)")
    row("train", lambda x: f"{x['stage_seconds']['train']:.0f} s ({x['rates']['train_steps']:,} steps, "
                           f"{x['rates']['train_tokens_per_s']:,.0f} tok/s)")
    row("eval", lambda x: f"{x['stage_seconds']['eval']:.0f} s ({x['rates']['n_prompts']} prompts; "
                          f"{x['rates']['spec_tokens_per_s']:.1f} / {x['rates']['baseline_tokens_per_s']:.1f} tok/s per process)")
    row("**total**", lambda x: f"**{_min(x['total_seconds'])}**")
    row("CPU time of the demo", lambda x: f"{x['cpu_seconds'] / 60:.0f} min")
    row("CPU time of other work meanwhile", lambda x: f"{x['other_cpu_seconds'] / 60:.0f} min")
    row("peak RSS (largest process)", lambda x: f"{x['peak_rss_mb'] / 1024:.1f} GB")
    row("τ (all MT-bench first turns)", lambda x: f"{x['rates']['tau']:.3f} ({x['rates']['n_prompts']})")
    row("greedy == plain greedy", lambda x: f"{x['rates']['greedy_matches_baseline']} "
                                            f"({x['rates']['baseline_prompts']} prompts decoded both ways)")
    kind = "with AMX" if cpu["amx"] else ("AVX-512 BF16, no AMX" if cpu["avx512_bf16"] else "no bf16 instructions")
    out = [f"CPU: {cpu['cpu_model']} ({kind}), {cpu['cores']} cores; one run per column, same machine, "
           f"same session (`bench/results/demo_time.json`).", "", *rows]
    return "\n".join(out)
