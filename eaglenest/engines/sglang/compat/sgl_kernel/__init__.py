"""eaglenest's `sgl_kernel` compatibility module for SGLang 0.5.23's CPU engine -- no kernels.

SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`) imports these names from `sgl_kernel` at start-up;
PyPI's `sgl-kernel` / `sglang-kernel` wheels are CUDA builds, and there is no CPU build on PyPI.
This module provides the names so that the imports succeed, and each one raises a clear error if
it is ever called.  It registers no `torch.ops.sgl_kernel` op, so SGLang's
`_is_intel_amx_backend_available()` is False and its AMX kernel paths stay off
(`eaglenest.engines.sglang.launcher` also forces the AMX probe off).

Where SGLang 0.5.23 imports them (`from sgl_kernel import ...`, found by importing the server's
modules with a recording stand-in) and when it would call them (the call sites are gated on the
CPU device, `_is_cpu`, not on AMX):

  copy_all_layer_kv_cache_cpu          sglang/kernels/ops/kvcache/cache_move.py (KV moves)
  assign_req_to_token_pool_cpu         sglang/srt/mem_cache/allocation.py
  assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu
                                       sglang/kernels/ops/speculative/cache_locs.py
  build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu
                                       sglang/kernels/ops/speculative/spec_tree.py
  fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu
                                       sglang/kernels/ops/speculative/eagle.py
  rotate_input_ids_cpu                 sglang/kernels/ops/speculative/multi_layer_eagle.py

Plain serving (prefill, decode, hidden states, the capture plugin) calls none of them; speculative
decoding on the CPU does (docs/sglang.md records the error).  Any other name is an ImportError, so
SGLang's own `try: from sgl_kernel import X / except ImportError` fallbacks keep working.
"""

__eaglenest_compat__ = True
__version__ = "0.0.0+eaglenest.nokernels"

NAMES = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)


class NoKernel(NotImplementedError):
    pass


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise NoKernel(
            f"sgl_kernel.{name} was called, but this sgl_kernel is eaglenest's compatibility module without "
            "kernels (SGLang's CPU kernels are not on PyPI): this SGLang feature cannot run on the CPU "
            "torch-native path (see eaglenest docs/sglang.md)"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


for _name in NAMES:
    globals()[_name] = _missing(_name)
del _name
