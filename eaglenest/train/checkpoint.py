"""Run directory and checkpoints: a run is never lost to a mistyped command.

RUN_DIR/checkpoints/step-NNNNNNNN/{model.safetensors, state.pt, trainer_state.json} is written
under a `.partial` name, its files and the directory fsynced, then renamed (and the parent
fsynced); `latest.json` names the newest.  Rank 0 writes.
  * a kill at any moment leaves the checkpoint latest.json names loadable: a step is re-saved
    (a run that stops right after resuming or after a periodic save) under a new name, and the
    old copy is removed only once latest.json names the new one;
  * the last `keep` checkpoints are kept (--keep-checkpoints, 0: all), older ones removed;
  * `SavePolicy` decides when: every --save-every steps and at least every --save-every-min
    minutes of training, so a crash loses at most that much.
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
import re
import secrets
import shutil
import sys
from pathlib import Path
from time import monotonic

import torch

from eaglenest import EaglenestError
from eaglenest.utils import atomic_write_bytes, atomic_write_json, fsync_dir, fsync_file, read_json

CHECKPOINT_DIR = re.compile(r"step-(\d{8})(-[0-9a-f]+)?(\.partial)?$")  # step-NNNNNNNN[-<re-save>][.partial]


class SavePolicy:
    """When to checkpoint: every `every_steps` steps (0: never by count) and once `every_min`
    minutes of training have passed since the last save (0: never by time).  The clock is this
    module's `monotonic` (tests replace it)."""

    def __init__(self, every_steps: int = 0, every_min: float = 0.0):
        self.every_steps, self.every_s = every_steps, every_min * 60.0
        self.last = monotonic()

    def due(self, step: int) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_s) and monotonic() - self.last >= self.every_s

    def reset(self) -> None:
        """Count from now (a save, or the loop's start)."""
        self.last = monotonic()


class Checkpointer:
    def __init__(self, out: Path | str, rank: int = 0, keep: int = 3):
        self.out = Path(out)
        self.dir = self.out / "checkpoints"
        self.rank = rank
        self.keep = keep  # checkpoints kept (0: all)

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
        if self.latest() == d:  # re-saving the step latest.json names: never delete it before the new copy is named
            d = d.with_name(f"{d.name}-{secrets.token_hex(4)}")
        tmp = d.with_name(d.name + ".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in model.exported_state_dict().items()}, str(tmp / "model.safetensors"))
        fsync_file(tmp / "model.safetensors")
        buf = io.BytesIO()
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "torch_rng": torch.get_rng_state(),
                    "python_rng": list(random.getstate()[1])}, buf)
        atomic_write_bytes(tmp / "state.pt", buf.getvalue())  # fsyncs the file and `tmp`
        atomic_write_json(tmp / "trainer_state.json", {"step": step, "total_steps": total_steps})
        if d.exists():  # a copy latest.json does not name (a kill before latest.json was updated)
            shutil.rmtree(d)
        os.replace(tmp, d)
        fsync_dir(self.dir)  # the rename is durable before latest.json names it
        atomic_write_json(self.dir / "latest.json", {"step": step, "dir": d.name})
        self._prune(d)
        return d

    def _prune(self, latest: Path) -> None:
        """Remove torn `.partial` copies, copies of a step that was re-saved, and all but the
        newest `keep` checkpoints.  Only after latest.json names `latest`, which is always kept."""
        done: dict[int, Path] = {}
        for p in self.dir.iterdir():
            m = CHECKPOINT_DIR.match(p.name)
            if not m or p == latest:
                continue
            if m.group(3) or int(m.group(1)) >= int(CHECKPOINT_DIR.match(latest.name).group(1)):
                shutil.rmtree(p, ignore_errors=True)  # torn, an older copy of this step, or past it (a run that went back)
            else:
                done[int(m.group(1))] = p
        if self.keep:
            for step in sorted(done, reverse=True)[self.keep - 1 :]:
                shutil.rmtree(done[step], ignore_errors=True)

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
