"""`eaglenest features verify|info|stats|convert|merge`: options are the fields of the configs in
eaglenest/features/config.py."""

from __future__ import annotations

import argparse
import json

from eaglenest.config import add_command


def register(sub) -> None:
    from eaglenest.features.config import ConvertConfig, InfoConfig, MergeConfig, StatsConfig, VerifyConfig

    p = sub.add_parser("features", help="inspect, verify, convert or merge feature stores",
                       description="Inspect, verify, convert or merge feature stores. Each action's options can come "
                       "from a YAML file (--config; flags win).")
    fsub = p.add_subparsers(dest="features_command", metavar="ACTION", required=True)
    add_command(
        fsub, VerifyConfig, _verify,
        "verify",
        help="re-check every checksum and shape",
        description="Re-check every sample's checksum and shapes. Damaged samples are named; with --repair they "
        "are removed from the manifest so that re-running the same `eaglenest capture` re-creates just them.",
    )
    add_command(fsub, InfoConfig, _info, "info", help="print store metadata and counts")
    add_command(
        fsub, StatsConfig, _stats,
        "stats",
        help="samples, tokens, bytes, dtype, layers, target, failures",
        description="Samples, tokens, bytes on disk (and per token), store dtype, layer ids, target fingerprint and "
        "the failures still open (samples that failed capture and are not stored yet), by reason.",
    )
    add_command(
        fsub, ConvertConfig, _convert,
        "convert",
        help="re-encode a store into another store dtype (e.g. fp8)",
        description="Write a copy of STORE in another store dtype or fp8 scheme (fp8: float8 e4m3 with a power-of-two "
        "scale per --fp8-block values, half the bytes of bf16; fp8-aux: only the aux states in fp8; an fp8 store "
        "converts to another --fp8-block, e.g. one written with one scale per token and layer). Every source checksum is "
        "checked on the way, and every sample as capture checks it (shapes, finite values), before and after "
        "re-encoding: one that fails is not copied, is recorded in OUT/failures.jsonl and makes the exit status 1. "
        "The output is an ordinary store (manifest, checksums, `verify`); re-running the same command after an "
        "interruption finishes it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_command(
        fsub, MergeConfig, _merge,
        "merge",
        help="merge stores captured on several machines into one",
        description="Merge stores of the same target, layer ids, convention, norm flag and store dtype (refused by "
        "name otherwise) into one. Every source checksum is checked, and every sample as capture checks it; a sample "
        "held by several stores (same id, same bytes) is kept once (counted); different samples under one id are "
        "an error naming both (see --on-collision); OUT/merges.jsonl records each run; failures not stored anywhere "
        "are carried over; resumable.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def _verify(cfg, args) -> int:
    from eaglenest.features import FeatureStore

    fs = FeatureStore(cfg.store)
    problems = fs.verify()
    for p in problems:
        print(f"damaged: {p['id']} (shard {p['shard']}): {p['reason']}")
    if problems and cfg.repair:
        fs.drop({p["id"] for p in problems})
        print(f"dropped {len(problems)} damaged samples; re-run `eaglenest capture` with the same arguments to re-create them")
    print(f"{len(fs) if not cfg.repair else len(fs) + len(problems)} samples checked, {len(problems)} damaged")
    return 1 if problems and not cfg.repair else 0


def _info(cfg, args) -> int:
    from eaglenest.features import FeatureStore

    fs = FeatureStore(cfg.store)
    print(json.dumps({**fs.meta.to_dict(), "scheme": fs.meta.scheme, "samples": len(fs), "tokens": fs.n_tokens,
                      "bytes": fs.bytes_on_disk()}, indent=2))
    return 0


def _stats(cfg, args) -> int:
    from eaglenest.features.ops import stats
    from eaglenest.utils import human_bytes

    st = stats(cfg.store)
    if cfg.json:
        print(json.dumps(st, indent=2))
        return 0
    rows = [
        ("samples", f"{st['samples']:,} in {st['shards']:,} shards"),
        ("tokens", f"{st['tokens']:,}" + (f" (per sample {st['sample_tokens']['min']}-{st['sample_tokens']['max']}, mean {st['sample_tokens']['mean']})" if st["sample_tokens"] else "")),
        ("bytes", f"{human_bytes(st['bytes'])} ({st['bytes_per_token']} per token)"),
        ("dtype", st["scheme"]),
        ("hidden / layers", f"{st['hidden_size']} / {st['num_layers']}, aux layer ids {st['layer_ids']} (capture-before), final state {st['final_norm']}-norm"),
        ("target", f"{st['target']} (fingerprint {st['target_fingerprint']}, engine {st['engine']})"),
        ("failures", f"{st['failures']} not stored" + (f": {', '.join(f'{k} {v}' for k, v in st['failures_by_reason'].items())}" if st["failures"] else "")),
    ]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(w)}  {v}" for k, v in rows))
    return 0


def _convert(cfg, args) -> int:
    from eaglenest.features.ops import convert

    s = convert(cfg.store, cfg.out, cfg.store_dtype, ignore_disk=cfg.ignore_disk, fp8_block=cfg.fp8_block)
    return 1 if s.damaged or s.failed.total else 0


def _merge(cfg, args) -> int:
    from eaglenest.features.ops import merge

    s = merge(cfg.stores, cfg.out, ignore_disk=cfg.ignore_disk, on_collision=cfg.on_collision)
    return 1 if s.damaged or s.failed.total else 0
