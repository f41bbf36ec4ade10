"""The hf engine's device -> host copies (issue 13): two reused host buffers, the copy of batch i
overlapping the forward of batch i+1, a wait only where the host reads a batch or reuses its
buffer unread.  The CUDA half (pinned buffers, side stream, events) sits behind a three-method
interface; here a recorder stands in for it so the schedule is checked on any CPU."""

import pytest
import torch

from eaglenest.capture.run import run_capture
from eaglenest.engines.base import Request
from eaglenest.engines.hf import HFEngine
from eaglenest.features import FeatureStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Recorder:
    """CudaCopies' interface; copies happen at once, 'events' are copy numbers; every call logged."""

    def __init__(self):
        self.log, self.n = [], 0

    def empty(self, numel, dtype):
        self.log.append(("alloc", numel))
        return torch.empty(numel, dtype=dtype)

    def copy(self, pairs):
        self.n += 1
        for dst, src in pairs:
            dst.copy_(src)
        self.log.append(("copy", self.n))
        return self.n

    def wait(self, event):
        self.log.append(("wait", event))


def _engine(tiny_llama_dir, ops):
    e = HFEngine(str(tiny_llama_dir), device="cpu", host_ops=ops)
    k = iter(range(1, 10**6))
    e.base.register_forward_pre_hook(lambda m, a: ops.log.append(("forward", next(k))))
    return e


def _samples(n=8, T=40):
    from types import SimpleNamespace as NS

    g = torch.Generator().manual_seed(1)
    return [NS(id=f"s{i}", input_ids=torch.randint(3, 300, (T,), generator=g).tolist(), loss_mask=[1] * T) for i in range(n)]


def test_capture_reuses_two_buffers_and_waits_only_when_reading(tiny_llama_dir, tmp_path):
    rec = Recorder()
    with _engine(tiny_llama_dir, rec) as e:
        s = run_capture(e, _samples(), tmp_path / "f", batch_tokens=80)  # 4 batches of 2 x 40 tokens
    assert s.stored == 8
    log = rec.log
    pos = {ev: i for i, ev in enumerate(log)}
    n = sum(1 for x in log if x[0] == "copy")
    assert n == 4 and sum(1 for x in log if x[0] == "forward") == 4
    assert [x for x in log if x[0] == "alloc"] == [("alloc", 2 * 40 * 4 * 64)] * 2  # two slots, then reused
    for k in range(1, n + 1):
        assert pos[("wait", k)] > pos[("copy", k)]
        assert log[pos[("copy", k)] + 1] != ("wait", k)  # not synchronized right after the copy
        if k < n:  # batch k is read only after batch k+1's forward was started
            assert pos[("wait", k)] > pos[("forward", k + 1)]
    # the same store as the plain CPU path (no recorder)
    with HFEngine(str(tiny_llama_dir), device="cpu") as e:
        run_capture(e, _samples(), tmp_path / "g", batch_tokens=80)
    a, b = FeatureStore(tmp_path / "f"), FeatureStore(tmp_path / "g")
    assert [(x["id"], x["sha256"]) for x in a.entries] == [(x["id"], x["sha256"]) for x in b.entries]


def test_a_buffer_reused_unread_is_read_first(tiny_llama_dir):
    rec = Recorder()
    reqs = [[Request(s.id, s.input_ids)] for s in _samples(3)]
    with _engine(tiny_llama_dir, rec) as e:
        handles = [e.capture_async(r) for r in reqs]  # the third reuses the first's buffer before anyone read it
        assert rec.log.index(("wait", 1)) < rec.log.index(("copy", 3))
        assert ("wait", 2) not in rec.log
        got = [h.result()[0] for h in handles]
        ref = [e.capture(r)[0] for r in reqs]
    for g, r in zip(got, ref):
        assert torch.equal(g.aux_hidden_states, r.aux_hidden_states) and torch.equal(g.last_hidden_state, r.last_hidden_state)
