"""Can the feature store feed the trainer as fast as the disk reads?  Seed-shaped synthetic store.

    python bench/loader.py [--dtype bf16 fp8] [--gb 10] [--threads 1 2] [--dir DIR] [--batch-tokens 8192]

Per store dtype, in one run:
  1. a synthetic store at the seed's shape (hidden 7168: aux [T, 3H] + final [T, H]; samples of
     500-8,000 tokens, uniform) of >= --gb GB, written through FeatureWriter in capture-sized
     shards (random values; fp8 stores hold the encoding of random bf16 states);
  2. the disk's raw sequential read bandwidth over the same shard files, with O_DIRECT (no page
     cache), before and after the loader runs;
  3. for each --threads N: the store's pages evicted (posix_fadvise DONTNEED on its files: cold,
     without dropping anyone else's cache), then, in a fresh process, the first --read-gb of an
     epoch of optimizer steps read the way `eaglenest train` reads them: its Schedule (length-bucketed
     micro-batches in shuffled order, so a random part of the store), its StoreSource (collate and the
     row plan of each micro-batch, pinned where an accelerator exists) behind its Prefetcher with
     `--loader-threads N` (train/loader.py), the loop taking each step as soon as it is ready;
  4. the store is deleted (the disk is shared).
Bytes are store bytes (what the disk must deliver): tokens x bytes_per_token(7168, dtype).
Result: bench/results/loader_<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import common  # noqa: E402  (bench/common.py)

HIDDEN = 7168


def build_store(root: Path, dtype: str, gb: float, min_len: int, max_len: int, seed: int) -> tuple[int, int]:
    """Write the synthetic store; returns (samples, tokens)."""
    import torch

    from eaglenest.capture.run import plan_batches
    from eaglenest.features.store import FeatureWriter, StoreMeta, bytes_per_token, encode_sample

    g = torch.Generator().manual_seed(seed)
    per_tok = bytes_per_token(HIDDEN, dtype)
    lengths = []
    while sum(lengths) * per_tok < gb * 1e9:
        lengths.append(int(torch.randint(min_len, max_len + 1, (1,), generator=g)))
    meta = StoreMeta(target="synthetic-7168", target_fingerprint="synthetic", hidden_size=HIDDEN, num_layers=61,
                     layer_ids=[2, 30, 58], final_norm="post", dtype=dtype, engine="synthetic", vocab_size=163840)
    w = FeatureWriter(root, meta)
    # one pool of random states, encoded once; samples are slices of it at random offsets
    pool = torch.randn(max_len + 4096, 4 * HIDDEN, generator=g).bfloat16()
    enc = encode_sample({"input_ids": torch.zeros(len(pool)), "loss_mask": torch.zeros(len(pool)),
                         "aux_hidden_states": pool[:, : 3 * HIDDEN], "last_hidden_state": pool[:, 3 * HIDDEN :]}, dtype, meta.fp8_block)
    t0 = time.time()
    for bi, batch in enumerate(plan_batches(lengths, 8192)):  # capture's shard sizes at --batch-tokens 8192
        samples = []
        for i in batch:
            T, off = lengths[i], int(torch.randint(0, 4096, (1,), generator=g))
            t = {k: v[off : off + T].clone() for k, v in enc.items()}  # safetensors refuses shared storage
            t["input_ids"] = torch.randint(0, 163840, (T,), generator=g, dtype=torch.int32)
            t["loss_mask"] = torch.ones(T, dtype=torch.uint8)
            samples.append((f"s{i}", t))
        w.write_batch(samples, encoded=True)
        if bi % 20 == 0:
            print(f"  building {dtype}: {len(w.done)}/{len(lengths)} samples, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return len(lengths), sum(lengths)


def evict(root: Path) -> None:
    """Drop the store's clean pages from the page cache (only these files)."""
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_read_mb_s(files: list[Path], limit_bytes: float, chunk: int = 8 << 20) -> dict:
    """Sequential O_DIRECT reads of `files` (up to limit_bytes) into an aligned buffer."""
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    n, t0 = 0, time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            while n < limit_bytes:
                got = os.readv(fd, [buf])
                n += got
                if got < chunk:
                    break
        finally:
            os.close(fd)
        if n >= limit_bytes:
            break
    dt = time.perf_counter() - t0
    return {"mb_per_s": round(n / dt / 1e6, 1), "bytes": n, "seconds": round(dt, 2), "method": "O_DIRECT sequential, 8 MiB reads"}


def run_loader(root: Path, threads: int, batch_tokens: int, seed: int, read_gb: float, ttt: int) -> dict:
    """The trainer's data path over the first `read_gb` of epoch 0, in this (fresh) process."""
    import torch

    from eaglenest.features import FeatureStore
    from eaglenest.features.store import bytes_per_token
    from eaglenest.train.data import Schedule
    from eaglenest.train.loader import Prefetcher, StoreSource

    fs = FeatureStore(root)
    lengths = fs.lengths()
    per_tok = bytes_per_token(HIDDEN, fs.meta.dtype)
    schedule = Schedule(lengths, list(range(len(fs))), batch_tokens, 1, seed, max(lengths))
    steps, n = 0, 0
    for b in schedule.epoch_order(0):  # one micro-batch per step (grad_accum 1)
        if n >= read_gb * 1e9:
            break
        steps, n = steps + 1, n + sum(lengths[i] for i in b) * per_tok
    pin = torch.cuda.is_available()  # as the trainer: pinned only where an accelerator exists
    tokens, pinned_ok = 0, True
    load0 = os.getloadavg()
    cpu0 = common.cpu_seconds()
    t0 = time.perf_counter()
    with Prefetcher(StoreSource(fs, schedule, ttt, max(lengths), pin=pin), threads=threads, end=steps) as loader:
        for s in range(steps):
            d = loader.get(s)
            tokens += d.n_tokens
            pinned_ok &= (not pin) or all(b.aux.is_pinned() for b in d.batches)
    dt = time.perf_counter() - t0
    cpu = common.cpu_seconds() - cpu0
    gb = tokens * per_tok / 1e9
    return {"threads": threads, "steps": steps, "tokens": tokens, "seconds": round(dt, 2),
            "tokens_per_s": round(tokens / dt, 1), "loader_mb_per_s": round(tokens * per_tok / dt / 1e6, 1),
            "cpu_s": round(cpu, 2), "cpu_s_per_gb": round(cpu / gb, 3),
            "pinned": pin and pinned_ok, "loadavg_before": [round(x, 2) for x in load0], "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--gb", type=float, default=10.0, help="store size per dtype, GB")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="the trainer's --loader-threads, one run each")
    ap.add_argument("--read-gb", type=float, default=3.0, help="GB each loader run reads (micro-batches in the epoch's shuffled order)")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="trainer micro-batch tokens")
    ap.add_argument("--ttt", type=int, default=7, help="TTT steps of the row plans the loader builds")
    ap.add_argument("--min-len", type=int, default=500)
    ap.add_argument("--max-len", type=int, default=8000)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"), help="where the synthetic store is written (and deleted)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results-dir", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one loader run in this (fresh) process
    a = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    if a.child:
        print(json.dumps(run_loader(Path(a.child), a.threads[0], a.batch_tokens, a.seed, a.read_gb, a.ttt)))
        return

    from eaglenest.features.store import bytes_per_token

    if a.results_dir:
        common.RESULTS = Path(a.results_dir)
    for dtype in a.dtype:
        root = Path(a.dir) / f"eaglenest_loader_{dtype}_{os.getpid()}"
        try:
            t = time.time()
            n_samples, n_tokens = build_store(root, dtype, a.gb, a.min_len, a.max_len, a.seed)
            build_s = time.time() - t
            files = sorted((root / "shards").glob("*.safetensors"))
            store_bytes = sum(f.stat().st_size for f in files)
            disk = [disk_read_mb_s(files, store_bytes)]
            runs = []
            for n in a.threads:
                evict(root)
                out = subprocess.run([sys.executable, __file__, "--child", str(root), "--threads", str(n), "--batch-tokens",
                                      str(a.batch_tokens), "--seed", str(a.seed), "--read-gb", str(a.read_gb), "--ttt", str(a.ttt)],
                                     env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True, text=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"{dtype} threads {n}: {runs[-1]['loader_mb_per_s']} MB/s, {runs[-1]['tokens_per_s']} tok/s", file=sys.stderr, flush=True)
            disk.append(disk_read_mb_s(files, store_bytes))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        disk_mb = round(sum(d["mb_per_s"] for d in disk) / len(disk), 1)
        best = max(runs, key=lambda r: r["loader_mb_per_s"])
        common.write_result(f"loader_{dtype}", {
            "kind": "loader",
            "hidden": HIDDEN,
            "store_dtype": dtype,
            "bytes_per_token": bytes_per_token(HIDDEN, dtype),
            "store": {"samples": n_samples, "tokens": n_tokens, "bytes": store_bytes, "sample_tokens": [a.min_len, a.max_len],
                      "build_s": round(build_s, 1)},
            "batch_tokens": a.batch_tokens, "ttt": a.ttt,
            "read_gb_per_run": a.read_gb,
            "disk_mb_per_s": disk_mb,
            "disk_runs": disk,
            "loader_mb_per_s": best["loader_mb_per_s"],
            "tokens_per_s": best["tokens_per_s"],
            "threads": best["threads"],
            "ratio_to_disk": round(best["loader_mb_per_s"] / disk_mb, 3),
            # CPU time per GB is what the loader costs regardless of how busy the machine was:
            # cores needed to read at the disk's speed = disk GB/s x CPU seconds per GB
            "cpu_s_per_gb": best["cpu_s_per_gb"],
            "cores_to_match_disk": round(disk_mb / 1e3 * min(r["cpu_s_per_gb"] for r in runs), 2),
            "goal": ">= 0.8x the disk's raw sequential read bandwidth",
            "runs": runs,
            "shared_machine": "2 cores shared with other jobs (see loadavg per run): CPU-bound numbers are pessimistic",
        })


if __name__ == "__main__":
    main()
