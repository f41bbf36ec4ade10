"""Our vLLM plugin that repairs vLLM 0.32's CPU `expand` fallback (eaglenest/engines/vllm_fixes.py).

Without it, vLLM on a CPU without triton-cpu divides each speculative position's target logits by
uninitialized memory at temperature > 0 (the rejection sampler expands temperature, top-k and top-p
with that fallback), so its speculative sampling is neither lossless nor comparable with ours.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from eaglenest.engines.vllm import server_process
from eaglenest.engines.vllm_fixes import expand_kernel_impl, fallback_is_broken
from vllm_helpers import requires_vllm, vllm_python


def _reference(vals: list, cu: list[int], replace_from, replace_to) -> list:
    out, start = [], 0
    for v, end in zip(vals, cu):
        out += [replace_to if v == replace_from else v] * (end - start)
        start = end
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_equals_the_loop_reference_in_place_for_every_dtype(dtype):
    vals = torch.tensor([3, -1, 0, 7], dtype=dtype)
    cu = torch.tensor([2, 2, 5, 9], dtype=torch.int32)  # the second request has no draft token
    out = torch.full((9,), 99, dtype=dtype)
    before = out.data_ptr()
    expand_kernel_impl(out, vals, cu, -1, 1)
    assert out.data_ptr() == before and out.dtype == dtype
    assert out.tolist() == _reference(vals.tolist(), cu.tolist(), -1, 1)


def test_the_probe_tells_a_copy_and_drop_fallback_from_a_correct_one():
    def copy_and_drop(output, input_val, cu, rf, rt, MAX_NUM_TOKENS=None):  # what vLLM 0.32's does to a float output
        expand_kernel_impl(output.to(torch.int64), input_val.to(torch.int64), cu, rf, rt)

    def raises(*a, **k):
        raise RuntimeError("no such op")

    assert fallback_is_broken(copy_and_drop)
    assert fallback_is_broken(raises)
    assert not fallback_is_broken(expand_kernel_impl)


PROBE = r"""
import importlib.metadata as md, json, torch
from vllm.plugins import load_general_plugins
load_general_plugins()                      # what vLLM's workers do, then:
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from vllm.triton_utils import HAS_TRITON
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
cu = torch.tensor([3, 6, 7], dtype=torch.int32)
print(json.dumps({
    "entry_points": [e.value for e in md.entry_points(group="vllm.general_plugins")],
    "has_triton": HAS_TRITON,
    "temperature": expand_batch_to_tokens(torch.tensor([1.0, 0.5, -1.0]), cu, 7, replace_from=-1, replace_to=1).tolist(),
    "top_k": expand_batch_to_tokens(torch.tensor([0, 5, 9], dtype=torch.int32), cu, 7).tolist(),
    "top_p": expand_batch_to_tokens(torch.tensor([1.0, 0.25, 0.5]), cu, 7).tolist(),
}))
"""


@pytest.mark.vllm
@requires_vllm
def test_vllm_servers_get_the_plugin_and_the_rejection_sampler_expands_correctly(tmp_path):
    """In the environment our vLLM servers get (engines/vllm.server_process), vLLM discovers the
    plugin by its own entry-point lookup and the rejection sampler's expansion of temperature,
    top-k and top-p over the draft positions is exact."""
    server = server_process(lambda port: ["true"], workdir=tmp_path)
    r = subprocess.run([str(vllm_python()), "-c", PROBE], env=server._env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert "eaglenest.engines.vllm_fixes:register" in got["entry_points"]
    assert got["temperature"] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 1.0]
    assert got["top_k"] == [0, 0, 0, 5, 5, 5, 9]
    assert got["top_p"] == [1.0, 1.0, 1.0, 0.25, 0.25, 0.25, 0.5]
    if not got["has_triton"]:  # the CPU fallback path: the plugin said what it did
        assert "eaglenest vllm_fixes:" in r.stderr
