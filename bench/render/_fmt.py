"""Formatting helpers shared by the render modules (bench/report.py): one way to write a machine, a
number, a ratio.  They read fields with r["..."]: a missing field raises, nothing is defaulted."""

from __future__ import annotations


def num(x: float, nd: int = 0) -> str:
    """1234.5 -> '1,234' (nd=0), '1,234.5' (nd=1)."""
    return f"{x:,.{nd}f}"


def ratio(a: float, b: float, nd: int = 2) -> str:
    """a / b as '1.23x'."""
    return f"{a / b:.{nd}f}x"


def pct(a: float, b: float, nd: int = 1) -> str:
    """(a - b) / b as '+1.2 %'."""
    return f"{100 * (a - b) / b:+.{nd}f} %"


def machine(r: dict) -> str:
    """'Intel(R) Xeon(R) Processor, 2 cores, load 2.1 at start' from a result's `machine`."""
    m = r["machine"]
    return f"{m['cpu_model']}, {m['cpu_count']} cores, load {m['load_average_at_start'][0]:.1f} at start"


def cpu(r: dict) -> str:
    """The CPU model alone (the README says which CPU a number comes from)."""
    return r["machine"]["cpu_model"]


def seq(xs, nd: int = 2, sep: str = " / ") -> str:
    return sep.join(f"{x:.{nd}f}" for x in xs)


# the full demo per stage (bench/demo_time.py `run` records): blocks demo_time and demo_time_malloc
def _min(s: float) -> str:
    return f"{s / 60:.1f} min"


def cpu_kind(cpu: dict) -> str:
    return "with AMX" if cpu["amx"] else ("AVX-512 BF16, no AMX" if cpu["avx512_bf16"] else "no bf16 instructions")


def demo_block(r: dict, file: str, how: str, note: bool = True) -> list[str]:
    """A demo_time.py `collect` file's full runs: 'CPU: ... ; HOW (`bench/results/FILE`).', the table[, the note]."""
    cpu = r["cpu"]
    out = [f"CPU: {cpu['cpu_model']} ({cpu_kind(cpu)}), {cpu['cores']} cores; {how} (`bench/results/{file}`).", "",
           *demo_table(r["runs"])]
    return out + (["", r["note"]] if note and r["note"] else [])


def demo_table(runs: list[dict]) -> list[str]:
    """The full demo per stage: one column per run (demo_time.py `run` records), one row per stage and figure."""
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
    return rows


def probe_row(p: dict) -> str:
    """One stage probe of bench/demo_time.py as a table row (label, stage, commit, allocator, wall, rate, CPU, RSS)."""
    if p["stage"] == "capture":
        rate = f"{p['tokens_per_s']:,.0f} tok/s"
    elif p["stage"] == "train":
        rate = f"{p['final_tokens_per_s']:,.0f} tok/s ({p['steps']} steps)"
    else:
        rate = (f"{p['spec_tokens_per_s']:.1f} / {p['baseline_tokens_per_s']:.1f} tok/s speculative / plain, "
                f"τ {p['tau']:.3f} ({p['n_prompts']} prompts)")
    return (f"| {p['label']} | {p['stage']} | `{p['commit'][:7]}` | {p['allocator']} | {p['wall_seconds']:.1f} s | {rate} | "
            f"{p['cpu_s']:.0f} s | {p['other_cpu_s']:.0f} s | {p['peak_rss_mb'] / 1024:.1f} GB |")


def probe_table(r: dict, file: str, what: str) -> list[str]:
    """A demo_time.py `collect` file's stage probes: 'CPU: ... (`bench/results/FILE`). WHAT:', the table."""
    cpu = r["cpu"]
    return [f"CPU: {cpu['cpu_model']} ({cpu_kind(cpu)}), {cpu['cores']} cores, one session, one command at a time "
            f"(`bench/results/{file}`). {what}:", "",
            "| probe | stage | commit | allocator | wall | rate | CPU time | other work meanwhile (CPU) | peak RSS |",
            "|---|---|---|---|---:|---:|---:|---:|---:|", *(probe_row(p) for p in r["probes"])]
