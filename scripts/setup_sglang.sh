#!/usr/bin/env bash
# Install SGLang 0.5.23 for its CPU engine (torch-native path) into its own virtualenv,
# .venv-sglang, next to the main .venv, from PyPI packages and the local torch wheel only.
# Idempotent: a second run only checks that SGLang's server modules import (a few seconds).
#
#   bash scripts/setup_sglang.sh             # creates/repairs ./.venv-sglang
#   SGLANG_VENV=/some/dir bash scripts/setup_sglang.sh
#
# What it installs (see docs/sglang.md):
#   * torch==2.13.0 (this machine's local CPU wheel; SGLang's metadata pins 2.14.1, which is not
#     needed for the torch-native path), sglang==0.5.23 with --no-deps (its metadata pulls CUDA
#     kernel wheels, flash-attn and flashinfer), and the runtime it imports at start-up, pinned in
#     scripts/sglang-cpu-requirements.txt (also --no-deps: the file is the full closure);
#   * torchvision==0.28.0 --no-deps: SGLang imports it unconditionally; PyPI's build is
#     CUDA-linked, so its compiled ops do not load on the CPU torch, and eaglenest's launcher
#     (eaglenest/engines/sglang/launcher.py) declares the two op schemas torchvision's import needs;
#   * no kernel package: eaglenest's `sgl_kernel` compatibility module
#     (eaglenest/engines/sglang/compat) is put on the server's path when eaglenest starts it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"
TORCHVISION_VERSION="0.28.0"
REQS="$ROOT/scripts/sglang-cpu-requirements.txt"
PY="${PYTHON:-python3}"
PIP=(--disable-pip-version-check --progress-bar off --no-input)

say() { echo "setup_sglang: $*"; }

check() {
  # import the server's modules the way eaglenest starts them (launcher first, compat sgl_kernel)
  PYTHONPATH="$ROOT:$ROOT/eaglenest/engines/sglang/compat" SGLANG_USE_CPU_ENGINE=1 \
    "$VENV/bin/python" - "$SGLANG_VERSION" "$TORCH_VERSION" <<'PY' 2>/dev/null
import sys, importlib.metadata as md
want, want_torch = sys.argv[1], sys.argv[2]
from eaglenest.engines.sglang import launcher as sglang_launch
sglang_launch.prepare_process()
if md.version("sglang") != want:
    raise SystemExit(f"sglang {md.version('sglang')} installed, want {want}")
import torch
if not torch.__version__.startswith(want_torch):
    raise SystemExit(f"torch {torch.__version__} installed, want {want_torch}")
import sgl_kernel
if not getattr(sgl_kernel, "__eaglenest_compat__", False):
    raise SystemExit(f"sgl_kernel comes from {sgl_kernel.__file__}, not eaglenest's compatibility module")
import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, sglang.srt.models.llama  # noqa: E401
from sglang.srt.utils.common import cpu_has_amx_support
assert not cpu_has_amx_support()
print(f"sglang {want}, torch {torch.__version__}")
PY
}

if [ -x "$VENV/bin/python" ] && out="$(check)"; then
  say "already set up at $VENV: $out"
  exit 0
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
say "installing torch==$TORCH_VERSION, sglang==$SGLANG_VERSION (--no-deps) and its CPU runtime into $VENV"
"$VENV/bin/python" -m pip install "${PIP[@]}" --quiet "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip install "${PIP[@]}" --quiet --no-deps "sglang==$SGLANG_VERSION" \
  "torchvision==$TORCHVISION_VERSION" -r "$REQS"
# a kernel wheel would shadow the compatibility module and route into CUDA code
for pkg in sgl-kernel sglang-kernel; do
  if "$VENV/bin/python" -m pip show "$pkg" >/dev/null 2>&1; then
    say "uninstalling $pkg (CUDA kernels; the CPU path uses eaglenest's sgl_kernel compatibility module)"
    "$VENV/bin/python" -m pip uninstall -y --disable-pip-version-check "$pkg" >/dev/null
  fi
done

if out="$(check)"; then
  say "ok in $(( $(date +%s) - start )) s: $out"
else
  say "FAILED: SGLang does not import in $VENV; the error follows" >&2
  PYTHONPATH="$ROOT:$ROOT/eaglenest/engines/sglang/compat" SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c \
    "from eaglenest.engines.sglang import launcher; launcher.prepare_process(); import sglang.srt.entrypoints.http_server" >&2 || true
  exit 1
fi
