"""SGLang servers eaglenest starts on this machine's CPU (`--sglang-serve`, eval's SGLang evaluator,
the live tests): SGLang's CPU engine on its torch-native path, from `.venv-sglang` (made by
`scripts/setup_sglang.sh`), launched through `launcher.py` with the `sgl_kernel` compatibility
module (`compat/`) on its path, on a free 127.0.0.1 port; for capture, with the plugin installed
where SGLang's `load_plugins()` finds it.  Flags and facts: docs/sglang.md."""

from __future__ import annotations

import os
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.engines.server import ServerProcess
from eaglenest.engines.sglang import plugin
from eaglenest.engines.sglang.install import install_into

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_VENV = REPO_ROOT / ".venv-sglang"
COMPAT_DIR = Path(__file__).resolve().parent / "compat"  # holds eaglenest's sgl_kernel
LAUNCHER = "eaglenest.engines.sglang.launcher"
DEFAULT_MAX_TOTAL_TOKENS = 32768  # KV-cache tokens of a started server (SGLang would take ~70% of the RAM)


def refuse_cpu_mla(cfg: dict, path) -> None:
    """--sglang-serve starts SGLang's CPU engine (torch-native attention), whose MLA prefill attends
    over the compressed latent KV pool instead of the per-head k/v it is given (0.5.23,
    torch_native_backend.py forward_extend; docs/sglang.md): DeepSeek-V2/V3/Kimi states and tokens
    come out wrong (or the first prefill fails on real shapes).  Refused, not warned about."""
    from eaglenest.models.target import target_facts

    fam = target_facts(cfg).family
    if fam.attention == "mla":
        raise EaglenestError(
            f"{path}: a {fam.name} target (MLA attention) cannot be served correctly by SGLang 0.5.23's CPU engine "
            "(its torch-native MLA prefill attends over the latent KV cache, not the per-head keys and values; see "
            "docs/sglang.md): serve it on GPUs and pass --sglang-url, or use --engine hf / vllm")


def find_sglang_python(explicit: str | None = None) -> Path:
    """The python of the SGLang virtualenv: --sglang-python, $EAGLENEST_SGLANG_PYTHON, or ./.venv-sglang."""
    p = Path(explicit or os.environ.get("EAGLENEST_SGLANG_PYTHON") or DEFAULT_VENV / "bin" / "python")
    if not p.exists():
        raise EaglenestError(f"SGLang python not found at {p}: run `bash scripts/setup_sglang.sh` (creates .venv-sglang) "
                             "or pass --sglang-python / set EAGLENEST_SGLANG_PYTHON")
    return p


def cpu_server_pythonpath() -> list[Path]:
    """What a CPU server started by eaglenest has on its path besides `eaglenest`: the sgl_kernel
    compatibility module (and, for `sglang-plugin check --cpu`, eaglenest itself)."""
    return [REPO_ROOT, COMPAT_DIR]


def server_command(python, model_path, *, port: int, dtype: str = "bf16", mode: str = "generate",
                   max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS, speculative: dict | None = None,
                   extra: list[str] | None = None) -> list[str]:
    """The command line of a CPU server (SGLang 0.5.23 flags, through eaglenest's launcher).
    mode: "plugin" (capture through the plugin: no radix cache), "stock" (final states as JSON),
    "generate"; `speculative` = {"algorithm": A, "draft": DIR, "steps": S, "topk": K, "draft_tokens": D} serves
    a draft (A: the draft kind's sglang_algorithm, kinds/registry.py)."""
    cmd = [str(python), "-m", LAUNCHER, "--model-path", str(model_path), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--attention-backend", "torch_native",
           "--dtype", {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype),
           "--disable-overlap-schedule", "--sleep-on-idle", "--random-seed", "0",
           "--max-total-tokens", str(max_total_tokens), "--cuda-graph-backend-prefill", "disabled"]
    if mode == "plugin":
        cmd += ["--disable-radix-cache"]
    elif mode == "stock":
        cmd += ["--enable-return-hidden-states", "--disable-radix-cache"]
    elif mode != "generate":
        raise ValueError(mode)
    if speculative:
        cmd += ["--speculative-algorithm", speculative["algorithm"], "--speculative-draft-model-path", str(speculative["draft"]),
                "--speculative-num-steps", str(speculative["steps"]), "--speculative-eagle-topk", str(speculative["topk"]),
                "--speculative-num-draft-tokens", str(speculative["draft_tokens"])]
    return cmd + list(extra or [])


def start_server(cmd_factory, *, workdir: Path, log_file=None, startup_timeout: float = 600.0,
                 capture_dir: Path | None = None, layer_ids: list[int] | None = None) -> ServerProcess:
    """A started CPU server.  With `capture_dir`, eaglenest's capture plugin is on the server's path
    (installed into the directory that holds `eaglenest`, where SGLang's `load_plugins()` finds its
    entry point) and active, writing there."""
    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    if capture_dir is not None:
        env[plugin.ENV_DIR] = str(capture_dir)
        if layer_ids is not None:
            env[plugin.ENV_LAYERS] = ",".join(map(str, layer_ids))
    srv = ServerProcess("sglang", cmd_factory, workdir=workdir, log_file=log_file, startup_timeout=startup_timeout,
                        env=env, pythonpath=[COMPAT_DIR])
    if capture_dir is not None:
        install_into(srv.path_dir)
    return srv.start()

