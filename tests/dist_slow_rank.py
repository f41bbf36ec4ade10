"""Run `eaglenest train` under torchrun with one slow rank (tests/test_train_reliability.py):
`python -m torch.distributed.run ... tests/dist_slow_rank.py train ARGS...` with
  SLOW_RANK, SLOW_SAMPLE   that rank's hf engine never answers for that sample (a hung server);
  DEFAULT_PG_TIMEOUT_S     torch's default collective timeout for a group started without one,
                           shorter than --online-timeout as NCCL's 10 min is against 600 s.
The product reads its rank and its timeouts itself; the harness reads RANK only to pick the slow one."""

import os
import sys
import threading
from datetime import timedelta

import torch.distributed.distributed_c10d as c10d

from eaglenest.cli import main
from eaglenest.engines.hf import HFEngine

c10d.default_pg_timeout = timedelta(seconds=float(os.environ["DEFAULT_PG_TIMEOUT_S"]))
real_capture = HFEngine.capture


def capture(self, batch):
    if os.environ["RANK"] == os.environ["SLOW_RANK"] and any(r.id == os.environ["SLOW_SAMPLE"] for r in batch):
        threading.Event().wait()  # never answers; the loader's thread is a daemon, the process can still exit
    return real_capture(self, batch)


HFEngine.capture = capture
sys.exit(main(sys.argv[1:]))
