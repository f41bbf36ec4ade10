"""The SGLang engine (`--engine sglang`): a client of SGLang 0.5.23's native `POST /generate`, and
the capture plugin it can put into SGLang servers.  One module per concern (docs/sglang.md):

  flags.py       the `--sglang-*` flags and the one check on a server choice
  server.py      CPU servers eaglenest starts (command line, environment, the SGLang python)
  launcher.py    runs inside the SGLang virtualenv: prepares a process for SGLang's CPU engine
  compat/        put on a started server's path: the `sgl_kernel` compatibility module
  protocol.py    `/generate` request bodies and response checks
  preflight.py   what `/server_info` must say before a capture
  engine.py      SGLangEngine: capture (plugin / stock mode) and generation
  plugin.py      the capture plugin, self-contained (copied into SGLang environments)
  install.py     putting the plugin into a directory SGLang loads plugins from
  plugin_cli.py  `eaglenest sglang-plugin install|uninstall|check|command`

Which layers SGLang captures for which ids is not here: export/layer_ids.py holds the one table.
This file stays light (no torch, no eaglenest engine code) because `python -m
eaglenest.engines.sglang.launcher` imports it inside the SGLang virtualenv.
"""

from __future__ import annotations

from eaglenest.engines.sglang.flags import add_arguments

NAME = "sglang"

__all__ = ["NAME", "add_arguments", "create"]


def create(args):
    """The engine for parsed CLI arguments (engines/__init__.py discovers it by NAME and create)."""
    from eaglenest.engines.sglang.engine import create as _create

    return _create(args)
