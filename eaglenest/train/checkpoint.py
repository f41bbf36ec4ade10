"""Run directory and checkpoints: a run is never lost to a mistyped command.

RUN_DIR/checkpoints/step-NNNNNNNN/{model.safetensors, state.pt, trainer_state.json} is written
under a `.partial` name and renamed; `latest.json` names the newest.  Rank 0 writes.
  * `train` into a RUN_DIR that holds checkpoints needs `--resume` (continue) or `--overwrite`
    (start over); otherwise it stops before touching anything.
  * `--resume` compares the run's recorded identity (the options in RESUME_FIXED, the draft's
    shape, the target's and the store's fingerprints) with this invocation's and refuses, naming
    the fields, when the data order or the model would change.
  * loading is strict: a checkpoint missing a tensor, or holding an unknown one, is an error.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import sys
from pathlib import Path

import torch

from eaglenest import EaglenestError
from eaglenest.utils import atomic_write_bytes, atomic_write_json, read_json


class Checkpointer:
    def __init__(self, out: Path | str, rank: int = 0):
        self.out = Path(out)
        self.dir = self.out / "checkpoints"
        self.rank = rank

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        p = self.dir / "latest.json"
        return self.dir / read_json(p, "checkpoint index")["dir"] if p.exists() else None

    def latest_step(self) -> int:
        """The step of the newest complete checkpoint (0: none)."""
        p = self.dir / "latest.json"
        return int(read_json(p, "checkpoint index")["step"]) if p.exists() else 0

    def holds_checkpoints(self) -> bool:
        return (self.dir / "latest.json").exists() or any(self.dir.glob("step-*"))

    def prepare(self, resume: bool, overwrite: bool) -> None:
        """Refuse to start a fresh run over checkpoints unless told to (`--overwrite` clears them)."""
        if resume or not self.holds_checkpoints():
            return
        if not overwrite:
            latest = self.latest()
            what = f"checkpoints up to {latest.name}" if latest else "checkpoints"
            raise EaglenestError(f"{self.out} holds {what}: pass --resume to continue that run, --overwrite to start over, "
                                 "or choose another --out")
        if self.rank == 0:
            shutil.rmtree(self.dir)
            for name in ("metrics.jsonl", "final.json", "tb"):
                p = self.out / name
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)

    def save(self, step: int, total_steps: int, model, opt, sched) -> Path | None:
        if self.rank != 0:
            return None
        from safetensors.torch import save_file

        d = self.dir / f"step-{step:08d}"
        tmp = d.with_name(d.name + ".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in model.exported_state_dict().items()}, str(tmp / "model.safetensors"))
        buf = io.BytesIO()
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "torch_rng": torch.get_rng_state(),
                    "python_rng": list(random.getstate()[1])}, buf)
        atomic_write_bytes(tmp / "state.pt", buf.getvalue())
        atomic_write_json(tmp / "trainer_state.json", {"step": step, "total_steps": total_steps})
        if d.exists():
            shutil.rmtree(d)
        os.replace(tmp, d)
        atomic_write_json(self.dir / "latest.json", {"step": step, "dir": d.name})
        return d

    def load(self, model, opt, sched) -> int:
        """Restore the latest checkpoint into model/optimizer/scheduler/RNG; its step (0: none)."""
        from safetensors.torch import load_file

        d = self.latest()
        if d is None:
            return 0
        sd = load_file(str(d / "model.safetensors"))
        want = set(model.state_dict())
        missing, unexpected = sorted(want - set(sd)), sorted(set(sd) - want)
        if missing or unexpected:
            raise EaglenestError(f"{d / 'model.safetensors'}: does not match the draft (missing {missing or 'none'}, "
                                 f"unexpected {unexpected or 'none'})")
        try:
            model.load_state_dict(sd, strict=True)
        except RuntimeError as e:  # shape mismatches
            raise EaglenestError(f"{d / 'model.safetensors'}: does not match the draft ({str(e).splitlines()[-1].strip()})") from None
        st = torch.load(d / "state.pt", weights_only=True)
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        torch.set_rng_state(st["torch_rng"])
        random.setstate((3, tuple(st["python_rng"]), None))
        step = read_json(d / "trainer_state.json")["step"]
        if self.rank == 0:
            print(f"resumed from {d} at step {step}", file=sys.stderr)
        return step


def check_resume(saved: dict, now: dict, where: Path) -> None:
    """Refuse a resume whose identity (see the module docstring) differs from the run's, naming
    every differing field.  A field the saved run did not record is not compared."""
    diff = []
    for group in sorted(set(saved) & set(now)):
        a, b = saved[group], now[group]
        if isinstance(a, dict) and isinstance(b, dict):
            diff += [f"{group}.{k}: run {a[k]!r}, now {b[k]!r}" for k in sorted(set(a) & set(b)) if a[k] != b[k]]
        elif a != b:
            diff.append(f"{group}: run {a!r}, now {b!r}")
    if diff:
        raise EaglenestError(f"--resume would change the data order or the model of {where}: {'; '.join(diff)}. "
                             "Resume with the run's values, or --overwrite / another --out to start a new run")
