"""Where `make demo`'s time goes: the full demo at a given commit, per stage (issue 26).

Each `run` takes one commit's tree (`git archive` of REV into WORK/src-<sha>; imported through
PYTHONPATH with this environment's packages), runs `eaglenest demo --fresh` there as a child
process and watches the child's process tree once a second and at every stage boundary (the
demo's `== stage ==` lines): wall seconds, CPU seconds of the tree, CPU seconds the REST of the
machine used meanwhile (from /proc/stat: a busy neighbour shows here), peak RSS (largest process
and the tree's sum), processes and threads, load average.  From the demo's outputs: tokens/s per
stage, training steps, tau, greedy equality and what the verification made row-wise.  One run
writes WORK/runs/<label>.json (a full demo takes 25-35 min on 2 cores: one run per
`/work/team/heavy` call), `collect` puts runs made on this machine into one result file:

    python bench/demo_time.py run 4ccbc81 --label old        # the 23.3-min commit
    python bench/demo_time.py run main --label main
    python bench/demo_time.py collect old main [--name demo_time]   # -> bench/results/demo_time.json

`--stages` stops the demo early (e.g. `--stages prepare,capture`).  `probe` runs ONE stage's command
with the demo's settings on inputs that already exist (a prepared DATA_DIR, a feature store, a draft),
so that two commits (or two settings) can be timed back to back, A B A B, on the same inputs:

    python bench/demo_time.py probe main --stage train --steps 200 --features F --label tr-main-1
    python bench/demo_time.py probe main --stage train ... --env ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024
    python bench/demo_time.py probe main --stage capture --data D --limit 200
    python bench/demo_time.py probe main --stage eval --draft DRAFT --limit 16
WORK defaults to $EAGLENEST_DEMO_TIME_WORK or runs/demo-time (ignored by git).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

STAGE_RE = re.compile(r"^== ([a-z-]+)(?:: ([0-9.]+) s)? ==$")
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def work_root() -> Path:
    return Path(os.environ.get("EAGLENEST_DEMO_TIME_WORK", ROOT / "runs" / "demo-time"))


# --- the process tree --------------------------------------------------------------------------
def _stat(pid: int) -> dict | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None  # the process ended between the listing and the read
    rest = raw[raw.rindex(")") + 2:].split()  # fields after "(comm)"; rest[0] is field 3 (state)
    return {"ppid": int(rest[1]), "cpu": sum(int(x) for x in rest[11:15]) / TICK,  # utime stime cutime cstime
            "threads": int(rest[17]), "rss": int(rest[21]) * PAGE}


def tree(root: int) -> dict[int, dict]:
    procs = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            s = _stat(int(d))
            if s:
                procs[int(d)] = s
    keep, frontier = {}, [root]
    while frontier:
        p = frontier.pop()
        if p in procs and p not in keep:
            keep[p] = procs[p]
            frontier += [c for c, s in procs.items() if s["ppid"] == p]
    return keep


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, not idle/iowait)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / TICK  # user nice system idle iowait irq softirq steal


class Watch:
    """Samples the child's tree; `mark(stage)` closes the previous stage and opens the next."""

    def __init__(self, pid: int):
        self.pid, self.stages, self.cur = pid, {}, None
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self._open("start")
        self.th = threading.Thread(target=self._loop, daemon=True)
        self.th.start()

    def _sample(self) -> dict:
        t = tree(self.pid)
        return {"t": time.perf_counter(), "cpu": sum(s["cpu"] for s in t.values()), "busy": machine_busy_s(),
                "rss_sum": sum(s["rss"] for s in t.values()), "rss_max": max((s["rss"] for s in t.values()), default=0),
                "procs": len(t), "threads": sum(s["threads"] for s in t.values()),
                "main_threads": t[self.pid]["threads"] if self.pid in t else 0}

    def _open(self, name: str) -> None:
        s = self._sample()
        self.cur = name
        self.stages[name] = {"first": s, "last": s, "peak_rss_sum": s["rss_sum"], "peak_rss_max": s["rss_max"],
                             "max_procs": s["procs"], "max_threads": s["threads"], "max_main_threads": s["main_threads"],
                             "load_start": os.getloadavg()[0]}

    def _fold(self, s: dict) -> None:
        st = self.stages[self.cur]
        st["last"] = s
        st["peak_rss_sum"] = max(st["peak_rss_sum"], s["rss_sum"])
        st["peak_rss_max"] = max(st["peak_rss_max"], s["rss_max"])
        st["max_procs"] = max(st["max_procs"], s["procs"])
        st["max_threads"] = max(st["max_threads"], s["threads"])
        st["max_main_threads"] = max(st["max_main_threads"], s["main_threads"])

    def mark(self, name: str) -> None:
        with self.lock:
            self._fold(self._sample())
            self.stages[self.cur]["load_end"] = os.getloadavg()[0]
            self._open(name)

    def _loop(self) -> None:
        while not self.stop.wait(1.0):
            with self.lock:
                s = self._sample()
                if s["procs"]:
                    self._fold(s)

    def close(self) -> dict:
        self.stop.set()
        self.th.join()
        self.stages[self.cur]["load_end"] = os.getloadavg()[0]
        out = {}
        for name, st in self.stages.items():
            a, b = st["first"], st["last"]
            wall = b["t"] - a["t"]
            cpu = b["cpu"] - a["cpu"]
            out[name] = {
                "watched_s": round(wall, 1), "cpu_s": round(cpu, 1),
                "cores_busy": round(cpu / wall, 2) if wall > 0 else None,
                # what everything else on the machine used meanwhile (0 on an idle machine)
                "other_cpu_s": round(max(0.0, (b["busy"] - a["busy"]) - cpu), 1),
                "peak_rss_mb": round(st["peak_rss_max"] / 2**20), "peak_tree_rss_mb": round(st["peak_rss_sum"] / 2**20),
                "max_processes": st["max_procs"], "max_threads": st["max_threads"],
                "max_main_threads": st["max_main_threads"],
                "load_start": round(st["load_start"], 2), "load_end": round(st.get("load_end", float("nan")), 2),
            }
        return out


# --- one run -----------------------------------------------------------------------------------
def checkout(rev: str, work: Path) -> tuple[str, Path]:
    sha = subprocess.run(["git", "rev-parse", "--verify", rev + "^{commit}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    src = work / f"src-{sha[:12]}"
    if not (src / "eaglenest" / "__init__.py").exists():
        tmp = work / f".src-{sha[:12]}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        tmp.rename(src)
    return sha, src


def allocator(src: Path, env) -> str:
    """How the command's glibc allocator ran: the commit's own tuning (eaglenest.utils.keep_freed_heap,
    from its entry point on) unless the environment overrides it, or glibc's defaults."""
    if any(k.startswith("MALLOC_") for k in env):  # glibc's own variables: kept only if they say what keep_freed_heap does
        return "kept (MALLOC_* in the environment)" if env.get("MALLOC_MMAP_MAX_") == "0" else "the environment's MALLOC_*"
    if env.get("EAGLENEST_SYSTEM_MALLOC") == "1":
        return "glibc defaults (EAGLENEST_SYSTEM_MALLOC=1)"
    return "kept (keep_freed_heap)" if "def keep_freed_heap" in (src / "eaglenest" / "utils.py").read_text() else "glibc defaults"


def cpu_facts() -> dict:
    info = Path("/proc/cpuinfo").read_text()
    flags = re.search(r"^flags\s*:(.*)$", info, re.M).group(1).split()
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.M).group(1).strip()
    return {"cpu_model": model, "amx": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "cores": os.cpu_count()}


def stage_rates(out: Path, stage_s: dict) -> dict:
    """Tokens/s per stage from the demo's own outputs."""
    r: dict = {}
    meta_p = out / "data" / "meta.json"
    if meta_p.exists():
        meta = json.loads(meta_p.read_text())
        r["prepared_samples"], r["prepared_tokens"] = meta["n_samples"], meta["n_tokens"]
        if stage_s.get("capture"):
            r["capture_tokens_per_s"] = round(meta["n_tokens"] / stage_s["capture"], 1)
    metrics = out / "run" / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        steps = [x for x in rows if "loss" in x]
        tok = sum(x["tokens"] for x in steps)
        r["train_steps"], r["train_tokens"] = len(steps), tok
        r["train_data_wait_s"] = round(sum(x.get("data_wait_s", 0.0) for x in steps), 1)
        if stage_s.get("train"):
            r["train_tokens_per_s"] = round(tok / stage_s["train"], 1)
            r["train_steps_per_s"] = round(len(steps) / stage_s["train"], 3)
        evals = [x for x in rows if "eval_acc" in x]
        if evals:
            r["final_heldout_acc"] = evals[-1]["eval_acc"]
    rep_p = out / "report.json"
    if rep_p.exists():
        rep = json.loads(rep_p.read_text())
        for k in ("tau", "n_prompts", "generated_tokens", "spec_wall_s", "spec_tokens_per_s", "baseline_prompts",
                  "baseline_tokens", "baseline_wall_s", "baseline_tokens_per_s", "speedup", "greedy_matches_baseline",
                  "greedy_mismatches", "workers", "attention", "accept_per_position"):
            if k in rep:
                r[k] = rep[k]
        v = rep.get("verification")
        if v:
            r["verification"] = {"attention": v.get("attention"), "exact": v.get("exact"),
                                 "rowwise_linears": [x["example"] + " " + "x".join(map(str, x["shape"]))
                                                     for x in (v.get("rowwise") or {}).get("linears", [])],
                                 "all_linears_rowwise": (v.get("rowwise") or {}).get("all_linears"),
                                 "probe_seconds": (v.get("probe_result") or {}).get("seconds")}
        r["eval_prompts_per_s"] = round(rep["n_prompts"] / stage_s["eval"], 4) if stage_s.get("eval") else None
    return r


def run(args) -> int:
    work = work_root()
    work.mkdir(parents=True, exist_ok=True)
    sha, src = checkout(args.rev, work)
    label = args.label or sha[:12]
    out = work / f"demo-{label}"
    log = work / f"{label}.log"
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "eaglenest", "demo", "--out", str(out), "--fresh"] + (["--quick"] if args.quick else [])
    print(f"[demo_time] {label}: {sha} from {src}; log {log}", flush=True)
    t0, started = time.perf_counter(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    busy0 = machine_busy_s()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally below ends the demo too
    p = subprocess.Popen(cmd, cwd=src, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    try:
        return _watch_run(args, p, sha, label, cmd, out, log, t0, started, busy0, allocator(src, env))
    finally:
        if p.poll() is None:  # this script was stopped: the demo (its own session) must not run on
            os.killpg(p.pid, signal.SIGTERM)
            p.wait()


def _watch_run(args, p, sha, label, cmd, out, log, t0, started, busy0, alloc: str) -> int:
    w = Watch(p.pid)
    demo_s, stopped, tail = {}, None, []
    stop_after = set(args.stages.split(",")) if args.stages else None

    def pump(stream, f):
        buf = b""
        for chunk in iter(lambda: stream.read1(65536), b""):
            f.write(chunk)
            f.flush()
            buf += chunk
            *lines, buf = re.split(rb"[\r\n]", buf)
            for raw in lines:
                yield raw.decode(errors="replace").strip()

    with open(log, "wb") as f:
        out_thread_lines: list[str] = []

        def drain_stdout():
            for line in pump(p.stdout, f):
                out_thread_lines.append(line)

        th = threading.Thread(target=drain_stdout, daemon=True)
        th.start()
        for line in pump(p.stderr, f):
            tail = (tail + [line])[-40:]
            m = STAGE_RE.match(line)
            if not m:
                continue
            name, secs = m.group(1), m.group(2)
            if secs is None:
                w.mark(name)
                print(f"[demo_time] {time.perf_counter() - t0:7.0f} s  start {name}", flush=True)
            else:
                demo_s[name] = float(secs)
                w.mark("between")
                print(f"[demo_time] {time.perf_counter() - t0:7.0f} s  done  {name} {secs} s", flush=True)
                if stop_after is not None and stop_after <= set(demo_s):
                    stopped = name
                    os.killpg(p.pid, signal.SIGTERM)
                    break
        rc = p.wait()
        th.join(timeout=10)
    watched = w.close()
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0 and stopped is None:
        print("\n".join(tail), file=sys.stderr)
        print(f"[demo_time] the demo exited with {rc}; log {log}", file=sys.stderr)
        return 1
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() and stopped is None else {}
    from bench.common import machine

    rec = {
        "label": label, "rev": args.rev, "commit": sha, "allocator": alloc, "started": started, "command": " ".join(cmd),
        "note": args.note, "stopped_after": stopped,
        "cpu": cpu_facts(), "machine": machine(),
        "stage_seconds": demo_s,  # the demo's own timings (what `make demo` prints)
        "total_seconds": (report.get("demo") or {}).get("total_seconds"),
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(ru.ru_utime + ru.ru_stime, 1),
        "other_cpu_seconds": round(max(0.0, machine_busy_s() - busy0 - (ru.ru_utime + ru.ru_stime)), 1),
        "peak_rss_mb": round(ru.ru_maxrss / 1024),  # the largest single process (kB on Linux)
        "stages": {k: v for k, v in watched.items() if k not in ("start", "between")},
        "rates": stage_rates(out, demo_s),
        "recipe": (report.get("demo") or {}).get("recipe"),
    }
    runs = work_root() / "runs"
    runs.mkdir(exist_ok=True)
    (runs / f"{label}.json").write_text(json.dumps(rec, indent=2) + "\n")
    print(json.dumps({k: rec[k] for k in ("label", "commit", "stage_seconds", "total_seconds", "cpu_seconds",
                                          "other_cpu_seconds", "peak_rss_mb")}, indent=1))
    print(f"[demo_time] wrote {runs / (label + '.json')}", flush=True)
    if not args.keep:  # the feature store is ~2.5 GB; the report, metrics and draft stay
        shutil.rmtree(out / "features", ignore_errors=True)
    return 0


# --- probes: one stage's command at a commit -----------------------------------------------------
DEMO_TRAIN = ["--ttt-steps", "3", "--draft-vocab", "8192", "--lr", "0.001", "--epochs", "2", "--batch-tokens", "1024",
              "--eval-fraction", "0.05"]  # the full preset's train flags (eaglenest/demo.py); --dtype: demo_train_dtype()


def demo_train_dtype() -> str:
    """The dtype the demo trains in on this CPU (bf16 autocast where the CPU has bf16 matrix
    instructions, fp32 elsewhere), read from the demo's own rule, not repeated here."""
    from eaglenest.demo import PRESETS, _train_dtype

    return _train_dtype(PRESETS["full"]["dtype"], "cpu")


DEMO_EVAL = ["--bench", "mtbench", "--steps", "3", "--topk", "1", "--temperature", "0", "--max-new-tokens", "128",
             "--workers", "2"]


def probe(args) -> int:
    from eaglenest.models.fetch import fetch

    work = work_root()
    sha, src = checkout(args.rev, work)
    label = args.label or f"probe-{args.stage}-{sha[:12]}"
    model = str(fetch("smollm2"))
    tmp = work / f"probe-{label}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if args.stage == "capture":
        argv = ["capture", "--model", model, "--data", args.data, "--out", str(tmp / "features"), "--device", "cpu",
                "--limit", str(args.limit)]
    elif args.stage == "train":
        argv = ["train", "--model", model, "--features", args.features, "--out", str(tmp / "run"), "--device", "cpu",
                *DEMO_TRAIN, "--dtype", demo_train_dtype(), "--max-steps", str(args.steps), "--eval-every", str(args.steps)]
    else:
        argv = ["eval", "--model", model, "--draft", args.draft, "--out", str(tmp / "report.json"), "--device", "cpu",
                *DEMO_EVAL, "--limit", str(args.limit), "--baseline-limit", str(args.limit)]
    argv += args.flag
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONUNBUFFERED="1", **extra_env)
    cmd = [sys.executable, "-m", "eaglenest", *argv]
    t0 = time.perf_counter()
    with open(work / f"{label}.log", "wb") as f:
        p = subprocess.Popen(cmd, cwd=src, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            w = Watch(p.pid)
            rc = p.wait()
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait()
    watched = w.close()["start"]
    wall = time.perf_counter() - t0
    if rc != 0:
        print(f"[demo_time] probe exited with {rc}; log {work / (label + '.log')}", file=sys.stderr)
        return 1
    rec = {"kind": "probe", "label": label, "stage": args.stage, "rev": args.rev, "commit": sha, "env": extra_env,
           "allocator": allocator(src, env),
           "flags": args.flag, "command": " ".join(cmd), "note": args.note, "cpu": cpu_facts(),
           "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "wall_seconds": round(wall, 1), **watched}
    if args.stage == "capture":
        n = sum(json.loads(x)["n_tokens"] for x in (tmp / "features" / "manifest.jsonl").read_text().splitlines() if x.strip())
        rec.update(tokens=n, tokens_per_s=round(n / wall, 1))
    elif args.stage == "train":
        rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [x for x in rows if "loss" in x]
        rec.update(steps=len(steps), tokens=sum(x["tokens"] for x in steps),
                   last_loss=steps[-1]["loss"], final_tokens_per_s=round(steps[-1]["tokens_per_s"], 1))
    else:
        rep = json.loads((tmp / "report.json").read_text())
        rec.update({k: rep.get(k) for k in ("tau", "n_prompts", "generated_tokens", "spec_wall_s", "spec_tokens_per_s",
                                            "baseline_wall_s", "baseline_tokens_per_s", "greedy_matches_baseline")})
        rec["verification_rowwise"] = [x["example"] for x in ((rep.get("verification") or {}).get("rowwise") or {}).get("linears", [])]
    runs = work / "runs"
    runs.mkdir(exist_ok=True)
    (runs / f"{label}.json").write_text(json.dumps(rec, indent=2) + "\n")
    print(json.dumps({k: rec.get(k) for k in ("label", "stage", "env", "flags", "wall_seconds", "cpu_s", "other_cpu_s",
                                              "tokens_per_s", "final_tokens_per_s", "steps", "tau")}))
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


# --- collect -----------------------------------------------------------------------------------
def collect(args) -> int:
    from bench.common import write_result

    recs = [json.loads((work_root() / "runs" / f"{lab}.json").read_text()) for lab in args.labels]
    for r in recs:  # records written before the field existed: derived from the same commit's tree
        if "allocator" not in r:
            r["allocator"] = allocator(checkout(r["commit"], work_root())[1], r.get("env", {}))
    models = {r["cpu"]["cpu_model"] for r in recs}
    if len(models) != 1:
        raise SystemExit(f"runs from different CPUs ({sorted(models)}): collect compares one machine's runs")
    runs = [r for r in recs if r.get("kind") != "probe"]
    probes = [r for r in recs if r.get("kind") == "probe"]
    for r in runs:
        if r.get("stopped_after") or r.get("recipe") is None:
            raise SystemExit(f"run {r['label']} stopped after {r.get('stopped_after')}: not a full demo")
    compare = {}
    if runs:
        base = runs[0]
        for r in runs[1:]:
            c = {st: {"seconds": [base["stage_seconds"][st], r["stage_seconds"][st]],
                      "ratio": round(r["stage_seconds"][st] / base["stage_seconds"][st], 3) if base["stage_seconds"][st] else None}
                 for st in base["stage_seconds"] if st in r["stage_seconds"]}
            c["same_recipe"] = r["recipe"] == base["recipe"]
            compare[f"{r['label']}_vs_{base['label']}"] = c
    result = {"what": "the full `eaglenest demo` (the `make demo` preset) per stage, one run per commit, and stage "
                      "probes (one stage's command with the demo's settings), on this machine",
              "cpu": recs[0]["cpu"], "runs": runs, "compare": compare, "probes": probes, "note": args.note}
    write_result(args.name, result)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the demo at one commit, watched per stage (-> WORK/runs/LABEL.json)")
    r.add_argument("rev", help="a git revision of this repository")
    r.add_argument("--label", help="the run's name (default: the short commit)")
    r.add_argument("--stages", help="stop after these stages are done (comma list), e.g. prepare,capture")
    r.add_argument("--keep", action="store_true", help="keep the feature store afterwards (~2.5 GB)")
    r.add_argument("--note", default="", help="free text recorded with the run (no figures: bench/report.py --check refuses them)")
    r.add_argument("--quick", action="store_true", help="the demo's --quick preset (a smoke test of this script)")
    r.set_defaults(func=run)
    q = sub.add_parser("probe", help="one stage's command at one commit on existing inputs (-> WORK/runs/LABEL.json)")
    q.add_argument("rev")
    q.add_argument("--stage", required=True, choices=["capture", "train", "eval"])
    q.add_argument("--label")
    q.add_argument("--data", help="capture: a prepared DATA_DIR")
    q.add_argument("--features", help="train: a feature store")
    q.add_argument("--draft", help="eval: an exported draft")
    q.add_argument("--limit", type=int, default=200, help="capture: samples; eval: prompts (all decoded both ways)")
    q.add_argument("--steps", type=int, default=200, help="train: optimizer steps")
    q.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment of the command")
    q.add_argument("--flag", action="append", default=[], help="extra argument of the command (repeat)")
    q.add_argument("--keep", action="store_true")
    q.add_argument("--note", default="", help="free text recorded with the probe (no figures: bench/report.py --check refuses them)")
    q.set_defaults(func=probe)
    c = sub.add_parser("collect", help="runs (by label) -> bench/results/NAME.json; the first is the base")
    c.add_argument("labels", nargs="+")
    c.add_argument("--name", default="demo_time")
    c.add_argument("--note", default="", help="free text recorded in the result (no figures: bench/report.py --check refuses them)")
    c.set_defaults(func=collect)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
