"""Run `eaglenest train` under torchrun with spies (used by tests/test_distributed.py):
`python -m torch.distributed.run ... tests/dist_spy.py SPY_DIR train ARGS...`.
Records, per rank, every tensor given to a collective (its device and the group's backend) and
every sample the feature store read (or, online, the hf engine captured), into SPY_DIR/rank-<RANK>.json.  The product reads its rank
from the torchrun environment itself; the spy reads RANK only to name its file."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from eaglenest.cli import main
from eaglenest.features import FeatureStore

spy = {"collectives": [], "reads": {"sample": [], "input_ids": [], "loss_mask": []}}


def wrap_collective(name):
    orig = getattr(dist, name)

    def f(tensor, *a, **kw):
        spy["collectives"].append({"op": name, "device": str(tensor.device), "backend": str(dist.get_backend())})
        return orig(tensor, *a, **kw)

    setattr(dist, name, f)


def wrap_read(name, key):
    orig = getattr(FeatureStore, name)

    def f(self, i, *a, **kw):
        spy["reads"][key].append(int(i))
        return orig(self, i, *a, **kw)

    setattr(FeatureStore, name, f)


def wrap_capture():
    from eaglenest.engines.hf import HFEngine

    orig = HFEngine.capture

    def f(self, batch):
        spy["captured"] += [r.id for r in batch]
        return orig(self, batch)

    HFEngine.capture = f


spy["captured"] = []  # online training: the sample ids this rank's hf engine captured, in order
wrap_capture()
for op in ("all_reduce", "broadcast"):
    wrap_collective(op)
wrap_read("__getitem__", "sample")
wrap_read("input_ids", "input_ids")
wrap_read("loss_mask", "loss_mask")
rc = main(sys.argv[2:])
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
(Path(sys.argv[1]) / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(spy))
sys.exit(rc)
