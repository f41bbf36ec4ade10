#!/usr/bin/env bash
# The ONE prepared GPU run (H200): every measurement in one call, < 9 minutes.
#
# Before the call, on the CPU machine (repo root), fetch SpecForge's wheel into the ignored .whl/
# folder (it is pure Python; all it imports on our path -- torch, triton, transformers,
# huggingface_hub, safetensors, accelerate, psutil, yaml -- is already on the H200 image, so
# no other wheel is needed; --no-deps because it pins torch 2.11 / sglang / wandb ...):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl specforge==0.2.0
#   (and pytest's wheels for an image without it: the same flags with `pytest pluggy iniconfig packaging pygments`)
#
# Then, through the device tool:  run(command="bash bench/gpu_run.sh", carry=[".whl"], timeout_s=600)
# What comes back from $OUT: results.tgz (every result JSON; repacked after each item, so a cut-short
# call still returns what finished), gpu_run.log, summary.txt.  Unpack results.tgz into bench/results/
# and commit.  A second call runs the items the first did not reach: ONLY="seq32768 seq65536 capture".
#
# Order = value: the CUDA checks of the training step's kernels (compiled flex with compacted queries
# == eager; the fused loss's Triton kernels in bf16 == the torch path), then ours vs SpecForge 0.2.0 at
# 8192, 2048 and 32768 tokens -- each (implementation, length) in a fresh process, each with a
# torch.profiler table per category (GEMM, attention, elementwise, loss, optimizer, idle) in its JSON
# and in summary.txt -- then ours alone at 65536 and 131072, then the capture.  Each item gets
# min(its cap, what is left of BUDGET_S); out-of-memory and timeouts are recorded as the reason in the
# JSON, and an item that no longer fits is skipped (skipped.jsonl says which).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench/results/gpu}
RES="$OUT/res"
mkdir -p "$RES"
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-530}
START=$(date +%s)
export PYTHONUNBUFFERED=1 EAGLENEST_NO_PROGRESS=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache  # shared by the fresh processes: later compiles hit it
LOG="$OUT/gpu_run.log"
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

# the device's copy of the tree may lose file modes: without this its results record a dirty tree (and
# bench/report.py --check refuses them); what still differs is logged
git config core.fileMode false 2>/dev/null
git update-index -q --refresh >/dev/null 2>&1
{ echo "git: $(git rev-parse --short HEAD 2>&1)"; git status --porcelain 2>&1 | head -20; } | tee -a "$LOG"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv; "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee -a "$LOG"

if ls .whl/specforge-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/specforge-*.whl 2>&1 | tail -2 | tee -a "$LOG"
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
  "$PY" -c "import specforge.algorithms.eagle3.model, specforge.optimizer; print('specforge importable')" 2>&1 | tail -1 | tee -a "$LOG"
else
  say "no .whl/specforge-*.whl carried: SpecForge runs will record the import error"
fi
# the image may lack pytest (the numerics check): its wheels ride in .whl too, installed only where missing
if ! "$PY" -c "import pytest" 2>/dev/null && ls .whl/pytest-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-cache-dir --find-links .whl --target /tmp/site-pytest pytest 2>&1 | tail -2 | tee -a "$LOG"
  export PYTHONPATH="$PYTHONPATH:/tmp/site-pytest"
fi

# run CAP_S NAME CMD...: with a timeout of min(CAP_S, budget left - 10 s); skipped below 45 s
run() {
  local cap=$1 name=$2; shift 2
  local l; l=$(left)
  local t=$(( cap < l - 10 ? cap : l - 10 ))
  if [ "$t" -lt 45 ]; then say "SKIP $name (${l}s left)"; echo "{\"skipped\": \"$name\", \"left_s\": $l}" >> "$RES/skipped.jsonl"; return; fi
  say "START $name (timeout ${t}s)"
  BENCH_BUDGET_S=$t timeout -k 10 "$t" "$@" >> "$LOG" 2>&1
  say "END $name rc=$?"
  tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null
}

# DRY=1: the same flow on the CPU with the tiny shape (checks the script, not the GPU)
if [ "${DRY:-0}" = 1 ]; then SHAPE=tiny; S=(128 256 512 1024 768); CAP="--shape tiny --samples 8 --min-len 32 --max-len 128 --batch-tokens 512"
else SHAPE=llama8b; S=(2048 8192 32768 131072 65536); CAP="--shape llama8b --samples 40"; fi
TS="-m bench train_step --shape $SHAPE --ttt 7 --results-dir $RES"
ran() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
# 1. the training step's kernels on CUDA: compiled flex (compacted queries, gradients through the
#    log-sum-exp) == eager; the fused loss's Triton kernels in bf16 == the torch path
ran numerics && run 90 numerics "$PY" -m pytest -q -x tests/test_fastpath.py tests/test_loss_kernels.py -k "cuda" -p no:cacheprovider
# 2. ours vs SpecForge, fresh process per implementation and length, a profiler table each
for i in 1 0 2; do
  ran "seq${S[$i]}" && run 280 "seq${S[$i]}" "$PY" $TS --impl both --seq "${S[$i]}" --steps 3 --warmup 1 --timeout 110 --timeout-specforge 170
done
# 3. ours alone at lengths SpecForge does not fit, then the capture
ran "seq${S[4]}" && run 110 "seq${S[4]}" "$PY" $TS --impl ours --seq "${S[4]}" --steps 2 --warmup 1 --timeout 100
ran "seq${S[3]}" && run 160 "seq${S[3]}" "$PY" $TS --impl ours --seq "${S[3]}" --steps 2 --warmup 1 --timeout 150
ran capture && run 100 capture "$PY" -m bench capture_gpu $CAP --results-dir "$RES"

# summary table (last lines of the call's output): speed, memory, and where each step's time went
"$PY" - "$RES" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, sys, glob, os
rows, prof = [], []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "train_step_*.json")), key=lambda p: json.load(open(p))["seq"]):
    r = json.load(open(f))
    o, s = r.get("ours", {}), r.get("specforge", {})
    fmt = lambda d: f"{d['tokens_per_s']:>9.0f} {d['peak_gib']:>7.1f}" if "tokens_per_s" in d else f"{str(d.get('reason', '-'))[:40]:>17}"
    rows.append(f"{r['seq']:>7} | ours {fmt(o)} | specforge {fmt(s)} | x{r.get('speedup', '-')}")
    for impl in ("ours", "specforge"):
        p = r.get(f"{impl}_detail", {}).get("profile")
        if p:
            cats = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in p["seconds"].items())
            prof.append(f"{r['seq']:>7} {impl:>9}: wall {p['wall_s'] * 1e3:.0f} ms = {cats}, idle {p['idle_s'] * 1e3:.0f} (ms)")
print("    seq |      tok/s  peakGiB |           tok/s  peakGiB | speedup")
print("\n".join(rows))
print("\n".join(prof))
for f in glob.glob(os.path.join(sys.argv[1], "skipped.jsonl")):
    print("skipped:", open(f).read().strip().replace("\n", "; "))
for f in glob.glob(os.path.join(sys.argv[1], "capture_*.json")):
    c = json.load(open(f))
    print(f"capture: plain {c['plain_forward_tokens_per_s']:.0f} tok/s, capture {c['capture_tokens_per_s']:.0f} ({c['ratio']}x)")
EOF
tar czf "$OUT/results.tgz" -C "$RES" . && rm -rf "$RES"
say "done"
