"""`eaglenest sglang-plugin install|uninstall|check|command`: put eaglenest's capture plugin into an
SGLang environment, verify that environment, print the server launch commands.

install: copies the plugin (`plugin.py`) into the SGLang environment's site-packages with an entry
point SGLang loads (install.py says how).  check: the environment's SGLang against the targeted
version and the hook points the plugin uses.  command: the server launch command of each mode.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.engines.sglang import plugin
from eaglenest.engines.sglang.install import install_into, uninstall_from


def register(sub) -> None:
    p = sub.add_parser(
        "sglang-plugin",
        help="install / check eaglenest's SGLang capture plugin; print SGLang launch commands",
        description=f"eaglenest's capture plugin for SGLang {plugin.TARGET_SGLANG_VERSION}: it observes the target's "
        "prefill and writes the aux-layer inputs and the final state of each request to a staging directory "
        "(see docs/sglang.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s = p.add_subparsers(dest="plugin_command", metavar="ACTION")
    for name, helptext in (("install", "install the plugin into an SGLang environment"),
                           ("uninstall", "remove it again")):
        q = s.add_parser(name, help=helptext)
        g = q.add_mutually_exclusive_group(required=True)
        g.add_argument("--python", help="python executable of the SGLang environment (its site-packages is used)")
        g.add_argument("--target", help="a site-packages directory (or any directory on the server's PYTHONPATH)")
        q.set_defaults(func=_install if name == "install" else _uninstall)
    c = s.add_parser("check", help=f"check an SGLang installation against the targeted version ({plugin.TARGET_SGLANG_VERSION}) "
                     "and the hook points the plugin uses")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--python", help="python executable of the SGLang environment (default: this python)")
    g.add_argument("--source", help="a directory containing the `sglang` package source (e.g. an unpacked wheel)")
    c.add_argument("--allow-version-mismatch", action="store_true", help="exit 0 on another SGLang version if the hook points exist")
    c.add_argument("--cpu", action="store_true",
                   help="the environment is eaglenest's SGLang CPU environment (scripts/setup_sglang.sh): import SGLang "
                   "the way eaglenest starts it there (its launcher and sgl_kernel compatibility module on the path)")
    c.set_defaults(func=_check)
    m = s.add_parser("command", help="print the SGLang launch command for a mode")
    m.add_argument("--model", required=True, help="target checkpoint directory (as the server sees it)")
    m.add_argument("--mode", default="plugin", choices=["plugin", "stock-final", "stock-aux", "serve-draft"])
    m.add_argument("--layers", default="auto", help="aux layer ids, capture-before (i,j,k) or auto")
    m.add_argument("--num-layers", type=int, default=None, help="target layer count (read from MODEL/config.json when omitted)")
    m.add_argument("--staging", default=plugin.DEFAULT_DIR, help="plugin staging directory")
    m.add_argument("--port", type=int, default=30000)
    m.add_argument("--draft", default=None, help="serve-draft: exported draft directory")
    m.add_argument("--steps", type=int, default=3)
    m.add_argument("--topk", type=int, default=1)
    m.add_argument("--num-draft-tokens", type=int, default=None)
    m.set_defaults(func=_command)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


# ----------------------------------------------------------------------------------- install


def site_dir(python: str | None, target: str | None) -> Path:
    if target:
        d = Path(target)
        d.mkdir(parents=True, exist_ok=True)
        return d
    try:
        out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise EaglenestError(f"cannot run {python}: {e}") from None
    return Path(out.stdout.strip())


def _install(args) -> int:
    d = site_dir(args.python, args.target)
    written = install_into(d)
    print(f"installed the eaglenest SGLang capture plugin into {d}:")
    for f in written:
        print(f"  {f}")
    if args.python:
        info = probe(args.python)
        ok = info.get("plugin_installed")
        print(f"entry point {plugin.ENTRY_POINT_GROUP}:{plugin.ENTRY_POINT_NAME} {'found' if ok else 'NOT found'} by {args.python}")
        if not ok:
            return 1
    else:
        print(f"(the server's python must have {d} on its path)")
    print(f"start the server with {plugin.ENV_DIR}=DIR (default dir {plugin.DEFAULT_DIR}); "
          "`eaglenest sglang-plugin command --model TARGET` prints the full command")
    return 0


def _uninstall(args) -> int:
    d = site_dir(args.python, args.target)
    removed = uninstall_from(d)
    print("\n".join(f"removed {f}" for f in removed) or f"nothing to remove in {d}")
    return 0


# ------------------------------------------------------------------------------------- check


def probe(python: str, cpu: bool = False) -> dict:
    """Run the plugin file's `probe` inside another interpreter (it imports no eaglenest, unless
    `cpu`: then eaglenest's launcher prepares the process first, as for the servers eaglenest starts)."""
    env = None
    if cpu:
        from eaglenest.engines.sglang.server import cpu_server_pythonpath

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, cpu_server_pythonpath())),
                   **{plugin.ENV_CPU_LAUNCHER: "1"})
    try:
        out = subprocess.run([python, str(Path(plugin.__file__)), "probe"], capture_output=True, text=True, timeout=300,
                             env=env)
    except (OSError, subprocess.SubprocessError) as e:
        raise EaglenestError(f"cannot run {python}: {e}") from None
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")), None)
    if out.returncode != 0 or line is None:
        raise EaglenestError(f"probing {python} failed (exit {out.returncode}): {out.stderr.strip()[-500:]}")
    return json.loads(line)


def source_version(root: Path) -> str | None:
    v = root / "sglang" / "_version.py"
    if v.exists():
        m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", v.read_text())
        if m:
            return m.group(1)
    for meta in root.glob("sglang-*.dist-info/METADATA"):
        m = re.search(r"^Version:\s*(\S+)", meta.read_text(), re.M)
        if m:
            return m.group(1)
    v = root / "sglang" / "version.py"
    if v.exists():
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", v.read_text())
        if m:
            return m.group(1)
    return None


def check_report(source: str | None = None, python: str | None = None, cpu: bool = False) -> dict:
    if source:
        root = Path(source)
        if not (root / "sglang").is_dir():
            raise EaglenestError(f"{root} has no sglang/ package directory")
        return {"package_root": str(root), "sglang_version": source_version(root), "importable": None,
                "hook_points": plugin.check_source_tree(str(root)), "plugin_installed": None}
    return probe(python or sys.executable, cpu=cpu)


def _check(args) -> int:
    r = check_report(args.source, args.python, cpu=getattr(args, "cpu", False))
    version = r.get("sglang_version")
    if not r.get("package_root"):
        raise EaglenestError(f"no sglang package found by {args.python or sys.executable}")
    print(f"SGLang {version or '(version unknown)'} at {r['package_root']} (eaglenest targets {plugin.TARGET_SGLANG_VERSION})")
    if r.get("importable") is not None:
        print(f"import sglang: {'ok' if r['importable'] else 'fails (' + str(r.get('import_error')) + '); checked the source files'}")
    if r.get("importable"):
        src = r.get("tp_rank_source")
        print(f"tensor-parallel rank: {'read from ' + src if src else 'NOT readable (' + str(r.get('import_error')) + ')'}")
    bad = 0
    for what, ok, detail in r.get("hook_points") or []:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}{'' if ok else ': ' + detail}")
        bad += not ok
    if r.get("plugin_installed") is not None:
        print(f"plugin entry point ({plugin.ENTRY_POINT_GROUP}:{plugin.ENTRY_POINT_NAME}): "
              f"{'installed' if r['plugin_installed'] else 'not installed (eaglenest sglang-plugin install)'}")
    mismatch = version != plugin.TARGET_SGLANG_VERSION
    if mismatch:
        print(f"version: SGLang {version} is not the targeted {plugin.TARGET_SGLANG_VERSION}")
    if r.get("importable") and not r.get("tp_rank_source"):
        bad += 1
    if bad:
        print(f"{bad} hook point(s) missing: the plugin cannot work with this SGLang")
        return 1
    return 1 if mismatch and not args.allow_version_mismatch else 0


# ----------------------------------------------------------------------------------- command


def launch_command(model: str, mode: str, *, layer_ids: list[int], num_layers: int, staging: str = plugin.DEFAULT_DIR,
                   port: int = 30000, draft: str | None = None, steps: int = 3, topk: int = 1,
                   num_draft_tokens: int | None = None, architecture: str = "LlamaForCausalLM") -> str:
    """The SGLang 0.5.23 server command for one of eaglenest's modes (flags: docs/sglang.md)."""
    base = f"python -m sglang.launch_server --model-path {model} --host 127.0.0.1 --port {port}"
    if mode == "plugin":
        env = f"{plugin.ENV_DIR}={staging}"
        if layer_ids != plugin.default_layer_ids(num_layers):
            env += f" {plugin.ENV_LAYERS}={','.join(map(str, layer_ids))}"
        return f"{env} {base} --cuda-graph-backend-prefill disabled --disable-radix-cache"
    if mode == "stock-final":
        return f"{base} --enable-return-hidden-states --disable-radix-cache"
    if mode == "stock-aux":
        # --return-aux-hidden-state-layer-ids goes through set_eagle3_layers_to_capture: the model
        # family's rule decides which ids make SGLang capture these layers
        from eaglenest.export.layer_ids import rule_text, sglang_ids_for

        ids = sglang_ids_for(architecture, num_layers, layer_ids)
        if ids is None:
            raise EaglenestError(f"SGLang 0.5.23 cannot capture before layers {layer_ids} of a {architecture} model "
                                 f"({rule_text('sglang', architecture)})")
        out_of = " ".join(map(str, ids))
        return (f"{base} --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "
                f"--return-aux-hidden-state-layer-ids {out_of} --disable-radix-cache")
    if mode == "serve-draft":
        if not draft:
            raise EaglenestError("--mode serve-draft needs --draft DRAFT_DIR")
        ndt = num_draft_tokens or (steps + 1 if topk == 1 else steps * topk + 1)
        return (f"{base} --speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} "
                f"--speculative-num-steps {steps} --speculative-eagle-topk {topk} --speculative-num-draft-tokens {ndt}")
    raise EaglenestError(f"unknown mode {mode}")


def _command(args) -> int:
    from eaglenest.capture.layers import parse_layer_ids

    n, arch = args.num_layers, "LlamaForCausalLM"
    try:
        cfg = json.loads((Path(args.model) / "config.json").read_text())
        arch = (cfg.get("architectures") or [arch])[0]
        n = n or int(cfg.get("text_config", cfg)["num_hidden_layers"])
    except (OSError, ValueError, KeyError) as e:
        if n is None:
            raise EaglenestError(f"cannot read {args.model}/config.json ({e}): pass --num-layers") from None
        print(f"note: {args.model}/config.json unreadable ({e}): assuming a Llama-family model", file=sys.stderr)
    ids = parse_layer_ids(args.layers, n)
    print(launch_command(args.model, args.mode, layer_ids=ids, num_layers=n, staging=args.staging, port=args.port,
                         draft=args.draft, steps=args.steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens,
                         architecture=arch))
    return 0
