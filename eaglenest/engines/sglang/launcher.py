"""Start SGLang 0.5.23's CPU engine on its torch-native path, on every CPU:

    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=<eaglenest>:<eaglenest/engines/sglang/compat> \\
        .venv-sglang/bin/python -m eaglenest.engines.sglang.launcher --model-path M --device cpu ...

(the arguments are SGLang's own `launch_server` arguments; `eaglenest.engines.sglang.server.server_command`
builds the whole line).  Runs in the SGLang virtualenv: stdlib and torch only; of eaglenest only the
parent packages' `__init__` files load, and they import nothing but the stdlib (tests/test_sglang_modules.py).

Why a launcher (facts from SGLang 0.5.23's source, see docs/sglang.md):

  * SGLang's CPU kernels (`sgl_kernel`) ship on PyPI for CUDA only; eaglenest gives SGLang an
    importable `sgl_kernel` with no kernels (`compat/sgl_kernel`).  Every CPU kernel call
    is gated on `sglang.srt.utils.common.cpu_has_amx_support()`, i.e. the module-level
    `is_amx_tile_supported = torch.cpu._is_amx_tile_supported()` (read once, when that module is
    imported) and a registered `torch.ops.sgl_kernel.convert_weight_packed`.  On an Intel CPU with
    AMX the first half is true, and a kernel package that did register ops would route matmuls,
    norms and attention into kernels.  `force_torch_native()` makes the probe answer False before
    SGLang is imported, so the gate is off whatever the CPU and whatever `sgl_kernel` holds.
  * PyPI's torchvision 0.28 (the release that pairs with torch 2.13) is built against CUDA torch:
    its `_C` extension does not load on the CPU torch.  torchvision supports that (its ops then
    raise "Couldn't load custom C++ ops"), except that `torchvision/_meta_registrations.py`
    registers fake kernels for `torchvision::nms` and `torchvision::qnms` without checking, and
    that import fails ("operator torchvision::nms does not exist").  SGLang imports torchvision
    unconditionally (`sglang/srt/configs/__init__.py` -> `multimodal/internvl_utils.py`).
    `declare_torchvision_schemas()` declares those two schemas, with no kernel, so the import
    works and a call still fails.
  * SGLang starts its scheduler and detokenizer with multiprocessing's "spawn": a spawned child
    first imports the parent's `__main__` module by name, so this module runs
    `prepare_process()` again (as `__mp_main__`) in every SGLang process before SGLang loads
    there.  That is why SGLang's `launch_server` runs through `runpy` with `alter_sys=False`.
"""

from __future__ import annotations

import os
import runpy
import sys

SCHEMAS = {  # torchvision 0.28 csrc/ops/nms.cpp, quantized/cpu/qnms_kernel.cpp (TORCH_LIBRARY_FRAGMENT)
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBS: list = []  # a torch.library.Library must stay alive for its definitions to stay registered


def force_torch_native() -> bool:
    """Make `torch.cpu._is_amx_tile_supported()` answer False in this process (before SGLang is
    imported).  Returns what the CPU itself reports, for the log."""
    import torch

    probe = torch.cpu._is_amx_tile_supported
    original = getattr(probe, "__eaglenest_original__", probe)
    try:
        has_amx = bool(original())
    except Exception:  # an old torch without the probe: SGLang's own try/except gives False too
        has_amx = False

    def no_amx() -> bool:
        return False

    no_amx.__eaglenest_original__ = original
    torch.cpu._is_amx_tile_supported = no_amx
    return has_amx


def declare_torchvision_schemas() -> list[str]:
    """When torchvision is installed but its compiled ops do not load on this torch, declare the op
    schemas whose fake kernels torchvision registers unconditionally.  Returns the names declared
    (none where torchvision is absent or its ops load, e.g. a CPU build of torchvision)."""
    import glob
    import importlib.util

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.origin:
        return []
    for lib in glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so")):
        try:
            torch.ops.load_library(lib)
            return []  # torchvision's own ops are here: nothing to declare
        except OSError:
            continue  # a CUDA build on the CPU torch (libtorch_cuda missing): declare below
    missing = [n for n in SCHEMAS if not hasattr(torch.ops.torchvision, n)]
    if missing:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            lib.define(SCHEMAS[name])
        _LIBS.append(lib)
    return missing


def prepare_process() -> dict:
    """Everything an SGLang process needs before `import sglang` (idempotent)."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    return {"cpu_reports_amx": force_torch_native(), "torchvision_schemas": declare_torchvision_schemas()}


def main(argv: list[str], facts: dict) -> None:
    print(f"eaglenest sglang launcher: torch-native CPU path (the CPU reports AMX: {facts['cpu_reports_amx']}; "
          f"forced off), torchvision schemas declared: {facts['torchvision_schemas'] or 'none needed'}",
          file=sys.stderr, flush=True)
    sys.argv = ["sglang.launch_server", *argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ in ("__main__", "__mp_main__"):  # the launch, and every process SGLang spawns from it
    _facts = prepare_process()
    if __name__ == "__mp_main__":  # the server log shows which processes were prepared
        print(f"eaglenest sglang launcher: prepared spawned process {os.getpid()} (AMX probe forced off)",
              file=sys.stderr, flush=True)
if __name__ == "__main__":
    main(sys.argv[1:], _facts)
