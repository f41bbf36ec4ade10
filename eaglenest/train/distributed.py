"""The process group of a `torchrun` launch, and collectives that put their tensors where the
group's backend needs them: NCCL reduces CUDA tensors only, gloo CPU tensors (its CUDA support
is partial), whatever device the model lives on.

The group's timeout (how long a rank waits in a collective before torch kills the job) comes
from the run's own timeouts, not the backend's default (NCCL's is 10 minutes): a rank may wait
for a slow one up to --online-timeout before every rank stops together, and for rank 0's
evaluation and checkpoint, which the other ranks wait for in their next collective."""

from __future__ import annotations

import os
from datetime import timedelta

import torch

EVAL_AND_SAVE_S = 1800.0  # allowance for rank 0's evaluation and checkpoint (and set-up reads) while the others wait


def collective_timeout(cfg) -> float:
    """Seconds a rank waits in a collective: --dist-timeout, or (0, the default) --online-timeout
    (online runs) + EVAL_AND_SAVE_S.  `cfg` is a TrainConfig."""
    if cfg.dist_timeout:
        return float(cfg.dist_timeout)
    return (cfg.online_timeout if cfg.online else 0.0) + EVAL_AND_SAVE_S


def collective_device(backend: str) -> torch.device:
    """The device a tensor must be on to go through a collective of `backend`."""
    if str(backend).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Distributed:
    """rank / world size from the torchrun environment (WORLD_SIZE > 1 starts the group: NCCL when
    the run uses CUDA, gloo otherwise, with a collective timeout of `timeout_s` seconds; a group the
    caller already started is used as it is)."""

    def __init__(self, device: str = "auto", timeout_s: float = EVAL_AND_SAVE_S):
        import torch.distributed as dist

        self.owns = False
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            on_cuda = torch.cuda.is_available() and device in ("auto", "cuda") or device.startswith("cuda:")
            if on_cuda:  # before the group: NCCL binds each rank to its current device
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl" if on_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
            self.owns = True
        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.rank = self.dist.get_rank() if self.dist else 0
        self.world = self.dist.get_world_size() if self.dist else 1
        self.backend = self.dist.get_backend() if self.dist else None
        self.device = collective_device(self.backend) if self.dist else None

    def all_reduce_sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor over ranks, in place; all in flight at once (one collective per tensor,
        no flat copy).  A tensor on another device than the group's goes through a copy there."""
        if self.world == 1:
            return
        staged = [t if t.device == self.device else t.to(self.device) for t in tensors]
        works = [self.dist.all_reduce(s, async_op=True) for s in staged]
        for w in works:
            w.wait()
        for t, s in zip(tensors, staged):
            if s is not t:
                t.copy_(s)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """A new tensor (on t's device) holding the sum of t over ranks."""
        t = t.clone()
        self.all_reduce_sum_([t])
        return t

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s values of t on every rank (in place; returned for convenience)."""
        if self.world > 1:
            s = t if t.device == self.device else t.to(self.device)
            self.dist.broadcast(s, src)
            if s is not t:
                t.copy_(s)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            self.dist.barrier()

    def close(self) -> None:
        if self.owns and self.dist is not None:
            self.dist.destroy_process_group()
            self.owns = False
