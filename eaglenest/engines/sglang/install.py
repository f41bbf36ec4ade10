"""Putting eaglenest's capture plugin where SGLang 0.5.23 loads plugins from: `plugin.py` is copied
into a directory on the server's path (an SGLang environment's site-packages, or the path of a
server eaglenest starts) as the top-level module `eaglenest_sglang_capture`, together with a
minimal `*.dist-info` whose `entry_points.txt` registers it in SGLang's general-plugin group
`sglang.srt.plugins` -- the mechanism SGLang uses to load plugins in every server process
(`load_plugins()`).  The plugin does nothing unless the server runs with
EAGLENEST_SGLANG_CAPTURE_DIR set."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from eaglenest import __version__
from eaglenest.engines.sglang import plugin

DIST_DIR_GLOB = "eaglenest_sglang_capture-*.dist-info"


def plugin_source() -> str:
    src = Path(plugin.__file__).read_text(encoding="utf-8")
    return f"# installed by eaglenest {__version__} from eaglenest/engines/sglang/plugin.py -- do not edit\n" + src


def install_into(d: Path) -> list[Path]:
    """Write the module and its dist-info into `d`; returns the files written."""
    uninstall_from(d)
    mod = d / f"{plugin.MODULE_NAME}.py"
    mod.write_text(plugin_source(), encoding="utf-8")
    info = d / f"{plugin.MODULE_NAME}-{__version__}.dist-info"
    info.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: {plugin.DIST_NAME}\nVersion: {__version__}\n"
                    f"Summary: eaglenest capture plugin for SGLang {plugin.TARGET_SGLANG_VERSION}\n",
        "entry_points.txt": f"[{plugin.ENTRY_POINT_GROUP}]\n{plugin.ENTRY_POINT_NAME} = {plugin.MODULE_NAME}:register\n",
        "top_level.txt": f"{plugin.MODULE_NAME}\n",
        "INSTALLER": "eaglenest\n",
    }
    for name, text in files.items():
        (info / name).write_text(text, encoding="utf-8")
    written = [mod] + [info / n for n in files]
    rows = []
    for f in written:
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        rows.append(f"{f.relative_to(d)},sha256={digest},{f.stat().st_size}")
    rows.append(f"{(info / 'RECORD').relative_to(d)},,")
    (info / "RECORD").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return written + [info / "RECORD"]


def uninstall_from(d: Path) -> list[Path]:
    removed = []
    for f in [d / f"{plugin.MODULE_NAME}.py", *d.glob(DIST_DIR_GLOB)]:
        if f.is_dir():
            shutil.rmtree(f)
            removed.append(f)
        elif f.exists():
            f.unlink()
            removed.append(f)
    cache = d / "__pycache__"
    for f in cache.glob(f"{plugin.MODULE_NAME}.*.pyc") if cache.is_dir() else []:
        f.unlink()
    return removed
