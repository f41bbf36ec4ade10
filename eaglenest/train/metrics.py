"""Training metrics: RUN_DIR/metrics.jsonl is the source (one fsynced line per step; plots and
resume read it); `--report-to tensorboard` mirrors every scalar to RUN_DIR/tb as well."""

from __future__ import annotations

import json
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.utils import append_jsonl_durable, atomic_write_bytes, read_jsonl_tolerant


def chain_tau(accept: list[float]) -> list[float]:
    """tau(k) = 1 + sum_{i<k} prod_{j<=i} a_j for k = 1..len(accept): the mean tokens per verification
    of a k-step chain whose position-j draft is accepted with probability a_j given the earlier ones."""
    tau, run, out = 1.0, 1.0, []
    for a in accept:
        run *= a
        tau += run
        out.append(tau)
    return out


def summarize(per: list[dict], serve_steps: int | None = None) -> dict:
    """Per-TTT-position loss, accuracy (the target's argmax matched: acceptance at temperature 0)
    and the chain tau they predict; with the alpha sums (ttt_forward's want_alpha), the acceptance
    at temperature 1 per position: `alpha` = E[sum_v min(p_v, q_v)] (the draft samples its tokens
    from q: our decoder, vLLM's draft_sample_method=probabilistic) and `alpha_argmax` = E[p(argmax q)]
    (the draft proposes its argmax: SGLang, vLLM's default), each with its chain tau.  `tau_t0`,
    `tau_t1`, `tau_t1_argmax`: the predicted tau at `serve_steps` (capped at the TTT steps).
    Teacher-forced on the data's own tokens: an estimate, calibrated in bench/results/losses.json."""
    n = [max(1.0, p["count"]) for p in per]
    out = {"loss": [p["loss_sum"] / max(1.0, p["loss_count"]) for p in per], "acc": [p["correct"] / c for p, c in zip(per, n)]}
    out["expected_tau"] = chain_tau(out["acc"])
    if per and "alpha_sum" in per[0]:
        out["alpha"] = [p["alpha_sum"] / c for p, c in zip(per, n)]
        out["alpha_argmax"] = [p["p_argmax_sum"] / c for p, c in zip(per, n)]
        out["expected_tau_t1"] = chain_tau(out["alpha"])
        out["expected_tau_t1_argmax"] = chain_tau(out["alpha_argmax"])
    if serve_steps and per:
        k = min(serve_steps, len(per))
        out["serve_steps"] = k
        out["tau_t0"] = out["expected_tau"][k - 1]
        if "alpha" in out:
            out["tau_t1"] = out["expected_tau_t1"][k - 1]
            out["tau_t1_argmax"] = out["expected_tau_t1_argmax"][k - 1]
    return out


def describe_eval(ev: dict) -> str:
    """One line for the console at each evaluation."""
    f = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    s = f"held-out accept per position: T0 {f(ev['acc'])}"
    if "alpha" in ev:
        s += f" | T1 {f(ev['alpha'])} (argmax drafts {f(ev['alpha_argmax'])})"
    if "serve_steps" in ev:
        s += f"; predicted tau at {ev['serve_steps']} steps: T0 {ev['tau_t0']:.3f}"
        if "tau_t1" in ev:
            s += f", T1 {ev['tau_t1']:.3f} (argmax drafts {ev['tau_t1_argmax']:.3f})"
    return s


def prefix_keys(d: dict, p: str) -> dict:
    return {p + k: v for k, v in d.items()}


class MetricsLog:
    """Rank 0's metrics sink.  `start(step)`: a fresh run (step 0) starts an empty log; a resumed
    run drops the lines past its checkpoint (they are recomputed identically)."""

    def __init__(self, out: Path | str, report_to: str = "jsonl"):
        self.path = Path(out) / "metrics.jsonl"
        self.tb = None
        if report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise EaglenestError("--report-to tensorboard needs the tensorboard package: pip install 'eaglenest[tensorboard]'") from None
            self.tb = SummaryWriter(str(Path(out) / "tb"))
        elif report_to != "jsonl":
            raise EaglenestError(f"--report-to must be jsonl or tensorboard (got {report_to})")

    def start(self, step: int) -> None:
        if step == 0:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            rows = read_jsonl_tolerant(self.path)  # a kill mid-append leaves a torn last line
            keep = [r for r in rows if r["step"] <= step]
            atomic_write_bytes(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep).encode())

    def log(self, rec: dict) -> None:
        append_jsonl_durable(self.path, [rec])
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, rec["step"])
                elif isinstance(v, list):
                    for j, x in enumerate(v):
                        self.tb.add_scalar(f"{k}/{j}", x, rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
            self.tb = None
