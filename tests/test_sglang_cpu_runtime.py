"""eaglenest's SGLang CPU runtime without a server: the launcher's AMX forcing and torchvision
schemas, the `sgl_kernel` compatibility module and the server command line (the per-family
layer-id rules: tests/test_layer_ids.py, checked live in tests/test_sglang_live*.py)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from eaglenest.engines.sglang import launcher as sglang_launch
from eaglenest.engines.sglang import server as eng
from eaglenest.engines.sglang.engine import SGLangEngine
from sglang_live import sglang_python

COMPAT = Path(eng.COMPAT_DIR)


def test_force_torch_native_overrides_a_probe_that_reports_amx(monkeypatch):
    """This CPU has no AMX; the probe is made to report it, as an Intel AMX machine would."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert torch.cpu._is_amx_tile_supported() is True
    assert sglang_launch.force_torch_native() is True  # what the CPU reports, for the log
    assert torch.cpu._is_amx_tile_supported() is False
    assert sglang_launch.force_torch_native() is True  # idempotent: still reports the CPU, still forces False
    assert torch.cpu._is_amx_tile_supported() is False


@pytest.mark.skipif(sglang_python() is None, reason="needs the SGLang environment's torchvision (.venv-sglang)")
def test_torchvision_imports_on_the_cpu_torch_only_with_the_declared_schemas():
    """PyPI's torchvision 0.28 (CUDA-linked) in the CPU environment: its import fails on its own,
    works after declare_torchvision_schemas(), and its ops still refuse to run."""
    import json
    import subprocess

    code = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
out = {}
if sys.argv[2] == "declare":
    from eaglenest.engines.sglang.launcher import declare_torchvision_schemas
    out["declared"] = declare_torchvision_schemas()
try:
    import torch, torchvision, torchvision.transforms
    out["import"] = "ok"
    try:
        torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
        out["nms"] = "ran"
    except Exception as e:
        out["nms"] = type(e).__name__
except Exception as e:
    out["import"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""
    got = {}
    for how in ("bare", "declare"):
        r = subprocess.run([str(sglang_python()), "-c", code, str(Path(eng.REPO_ROOT)), how], capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-1500:]
        got[how] = json.loads(r.stdout.strip().splitlines()[-1])
    assert "operator torchvision::nms does not exist" in got["bare"]["import"]
    assert got["declare"]["declared"] == ["nms", "qnms"] and got["declare"]["import"] == "ok"
    assert got["declare"]["nms"] != "ran"


@pytest.fixture
def compat_sgl_kernel(monkeypatch):
    monkeypatch.syspath_prepend(str(COMPAT))
    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)
    mod = importlib.import_module("sgl_kernel")
    yield mod
    sys.modules.pop("sgl_kernel", None)


def test_compat_sgl_kernel_names_raise_and_unknown_names_do_not_exist(compat_sgl_kernel):
    k = compat_sgl_kernel
    assert k.__eaglenest_compat__ and k.__file__.startswith(str(COMPAT))
    for name in k.NAMES:
        with pytest.raises(NotImplementedError, match=f"sgl_kernel.{name} was called.*without kernels"):
            getattr(k, name)(torch.zeros(1))
    with pytest.raises(ImportError):  # SGLang's try/except-ImportError fallbacks keep working
        exec("from sgl_kernel import rmsnorm", {})
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")  # SGLang's AMX backend probe stays False


@pytest.mark.skipif(sglang_python() is None, reason="needs the installed SGLang 0.5.23 (.venv-sglang)")
def test_compat_names_are_names_sglang_0_5_23_imports():
    site = Path(sglang_python()).parent.parent / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    roots = list(site.glob("site-packages/sglang"))
    assert roots, site
    import ast

    imported = set()
    for f in roots[0].rglob("*.py"):
        try:
            tree = ast.parse(f.read_text(errors="ignore"))
        except SyntaxError:
            continue
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "sgl_kernel"
                     for a in n.names}
    spec = importlib.util.spec_from_file_location("compat_check", COMPAT / "sgl_kernel" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = mod.NAMES
    assert set(names) <= imported, set(names) - imported


def test_server_command_cpu_torch_native_loopback():
    cmd = eng.server_command("py", "/m", port=1234, dtype="fp32", mode="plugin")
    s = " ".join(cmd)
    assert cmd[:3] == ["py", "-m", "eaglenest.engines.sglang.launcher"]
    assert "--host 127.0.0.1" in s and "0.0.0.0" not in s and "--device cpu --attention-backend torch_native" in s
    assert "--dtype float32" in s and "--disable-radix-cache" in cmd and "--sleep-on-idle" in cmd
    assert "--disable-radix-cache" not in eng.server_command("py", "/m", port=1, mode="generate")
    spec = eng.server_command("py", "/m", port=1, speculative={"algorithm": "EAGLE3", "draft": "/d", "steps": 3, "topk": 1, "draft_tokens": 4})
    assert ("--speculative-algorithm EAGLE3 --speculative-draft-model-path /d --speculative-num-steps 3 "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4") in " ".join(spec)


def test_plugin_mode_refuses_an_unobserved_architecture(tmp_path, tiny_llama_dir):
    import json
    import shutil

    from eaglenest import EaglenestError

    d = tmp_path / "gemma"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["Gemma2ForCausalLM"]}))
    with SGLangEngine(d, urls=["http://127.0.0.1:9"]) as e:
        with pytest.raises(EaglenestError, match="does not observe Gemma2ForCausalLM.*Qwen3MoeForCausalLM"):
            e._check_servers()
