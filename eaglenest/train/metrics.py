"""Training metrics: RUN_DIR/metrics.jsonl is the source (one fsynced line per step; plots and
resume read it); `--report-to tensorboard` mirrors every scalar to RUN_DIR/tb as well."""

from __future__ import annotations

import json
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.utils import append_jsonl_durable, atomic_write_bytes, read_jsonl_tolerant


def summarize(per: list[dict]) -> dict:
    """Per-TTT-position loss/accuracy and the acceptance length they imply for chain drafting."""
    loss = [p["loss_sum"] / max(1.0, p["loss_count"]) for p in per]
    acc = [p["correct"] / max(1.0, p["count"]) for p in per]
    tau, run = 1.0, 1.0
    taus = []
    for a in acc:  # tau(k) = 1 + sum_i prod_{j<=i} acc_j  (step accuracies as conditional acceptances)
        run *= a
        tau += run
        taus.append(tau)
    return {"loss": loss, "acc": acc, "expected_tau": taus}


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
