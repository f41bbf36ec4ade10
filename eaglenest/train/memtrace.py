"""Peak tensor memory of a piece of code, counted op by op, on any device (the meta device included,
where nothing is allocated: a 163,840-token vocabulary at 8K tokens costs nothing to measure).

`LiveTensorBytes` is a TorchDispatchMode: every storage an op creates is counted from its creation
to the death of the last tensor that holds it (autograd's saved tensors included: a tensor's Python
object lives as long as its C++ tensor), and the peak of the live sum is kept.  Tensors that exist
before the mode (weights, inputs) and views of them are not counted.  What is measured: tensor
storages; not the allocator's caching or fragmentation (tests/test_losses.py)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest: tuple[int, str, tuple] = (0, "", ())  # (bytes, dtype, shape) of the largest storage created
        self.largest_by_dtype: dict[str, tuple[int, tuple]] = {}  # dtype -> (bytes, shape)
        self._refs: dict[int, int] = {}
        self._size: dict[int, int] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata  # the storage's identity (data pointers are all 0 on meta)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ins = {self._key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            k = self._key(t)
            if k in self._refs:
                self._refs[k] += 1
            elif k in ins:  # a view (or an in-place result) of a tensor made before the mode
                continue
            else:
                n = t.untyped_storage().nbytes()
                self._refs[k], self._size[k] = 1, n
                self.live += n
                self.peak = max(self.peak, self.live)
                dt = str(t.dtype).replace("torch.", "")
                if n > self.largest[0]:
                    self.largest = (n, dt, tuple(t.shape))
                if n > self.largest_by_dtype.get(dt, (0,))[0]:
                    self.largest_by_dtype[dt] = (n, tuple(t.shape))
            weakref.finalize(t, self._drop, k)
        return out

    def _drop(self, k: int) -> None:
        self._refs[k] -= 1
        if self._refs[k] == 0:
            self.live -= self._size.pop(k)
            del self._refs[k]

    def reset_peak(self) -> None:
        self.peak = self.live
