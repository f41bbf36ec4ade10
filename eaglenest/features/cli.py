"""`eaglenest features verify|info FEAT_DIR`."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("features", help="inspect or verify a feature store", description="Inspect or verify a feature store.")
    fsub = p.add_subparsers(dest="features_command", metavar="ACTION", required=True)
    v = fsub.add_parser(
        "verify",
        help="re-check every checksum and shape",
        description="Re-check every sample's checksum and shapes. Damaged samples are named; with --repair they "
        "are removed from the manifest so that re-running the same `eaglenest capture` re-creates just them.",
    )
    v.add_argument("store", help="feature store directory")
    v.add_argument("--repair", action="store_true", help="drop damaged samples from the manifest")
    v.set_defaults(func=_verify)
    i = fsub.add_parser("info", help="print store metadata and counts")
    i.add_argument("store", help="feature store directory")
    i.set_defaults(func=_info)


def _verify(args) -> int:
    from eaglenest.features import FeatureStore

    fs = FeatureStore(args.store)
    problems = fs.verify()
    for p in problems:
        print(f"damaged: {p['id']} (shard {p['shard']}): {p['reason']}")
    if problems and args.repair:
        fs.drop({p["id"] for p in problems})
        print(f"dropped {len(problems)} damaged samples; re-run `eaglenest capture` with the same arguments to re-create them")
    print(f"{len(fs) if not args.repair else len(fs) + len(problems)} samples checked, {len(problems)} damaged")
    return 1 if problems and not args.repair else 0


def _info(args) -> int:
    from eaglenest.features import FeatureStore

    fs = FeatureStore(args.store)
    print(json.dumps({**fs.meta.to_dict(), "samples": len(fs), "tokens": fs.n_tokens, "bytes": fs.bytes_on_disk()}, indent=2))
    return 0
