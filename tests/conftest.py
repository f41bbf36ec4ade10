"""Shared fixtures.  `smollm2` is the real target (fetched once per machine into the cache);
`tiny_llama_dir` is a random-weight Llama for fast unit tests only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("EAGLENEST_NO_PROGRESS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# `make test` runs two pytest-xdist workers.  Each gets its share of the cores (two OpenMP pools of
# all cores on one machine spin against each other), set before anything imports torch, and its
# own core for vLLM's CPU worker (vLLM binds it to a fixed core by default, the same for every server).
if os.environ.get("PYTEST_XDIST_WORKER"):
    from eaglenest.utils import usable_cpu_ids  # import-light: no torch yet

    _n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _cpus = usable_cpu_ids()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(_cpus) // _n)))
    _i = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_cpus[_i % len(_cpus)]))

# Tests call `cli.main` in this process, which does not pass through the process entry (`cli.run`)
# that tunes glibc's allocator: tune it here too, so in-process capture, training and eval run as
# the CLI runs them (without it the MLA draft's training spent more time in the kernel faulting
# pages in than in torch).  Process-local (mallopt), so the
# subprocesses tests/test_malloc.py counts keep glibc's defaults.
from eaglenest.utils import keep_freed_heap  # noqa: E402  (import-light: no torch yet)

keep_freed_heap()


# Which tests share a worker (`--dist loadfile`, widened below): a file's tests (module fixtures such
# as a served model are built once), the SGLang live files (a server at TP 2 takes both cores) and
# the quick demo's users (built once per worker).  xdist's own `loadgroup` marks do not group under
# pytest 9 (checked: a marked group ran on both workers), so the scheduler is given the groups.
XDIST_GROUPS = {
    "tests/test_demo.py": "quick_demo",
    "tests/test_vllm_live_eval.py": "quick_demo",
    "tests/test_sglang_live.py": "sglang",
    "tests/test_sglang_live_deepseek.py": "sglang",
    "tests/test_sglang_live_serve.py": "sglang",
}
# the longest groups first (by make test's --durations under two workers; no result file records them):
# each worker takes the next one as it frees up, so no long file is left to run alone at the end
XDIST_FIRST = ("tests/test_vllm_live_kinds.py", "quick_demo", "sglang", "tests/test_vllm_live_dflash.py", "tests/test_family_vllm.py")


def _xdist_scope(nodeid: str) -> str:
    f = nodeid.split("::", 1)[0]
    return XDIST_GROUPS.get(f, f)


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist the hook does not exist
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist", "no") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Grouped(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_scope(nodeid)

    return Grouped(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """In xdist's workers (which collect, each the same list): XDIST_FIRST's order first; the scheduler
    keeps it (--no-loadscope-reorder) and the short files fill in around them."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = lambda it: XDIST_FIRST.index(s) if (s := _xdist_scope(it.nodeid)) in XDIST_FIRST else len(XDIST_FIRST)  # noqa: E731
    items.sort(key=rank)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """Path of the real SmolLM2-135M-Instruct HF checkpoint."""
    from eaglenest.models.fetch import fetch

    return fetch("smollm2")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2) -> Path:
    """An 8-layer random Llama (hidden 64) that shares SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=49152,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(d)
    AutoTokenizer.from_pretrained(smollm2).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def smol_data(tmp_path_factory, smollm2) -> Path:
    """24 real ShareGPT conversations prepared for SmolLM2 (max 256 tokens)."""
    from eaglenest.data import prepare

    out = tmp_path_factory.mktemp("smol_data")
    prepare(model=str(smollm2), data=["sharegpt:"], out=out, max_length=256, limit=24, verbose=False)
    return out


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory) -> Path:
    """`eaglenest demo --quick` run once per session (its draft is also what the vLLM agreement test serves)."""
    from eaglenest.cli import main

    out = tmp_path_factory.mktemp("quick_demo") / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--device", "cpu"]) == 0
    return out


@pytest.fixture(scope="module")
def one_torch_thread():
    """Opted into by modules of tiny-tensor tests (`pytest.mark.usefixtures`): one intra-op thread,
    since a second only adds OpenMP contention (60x slower on a busy 2-core machine)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


FIVE_LAYERS = [2, 9, 15, 21, 28]  # spread_layer_ids(30, 5): DFlash's default five on SmolLM2


@pytest.fixture(scope="session")
def smol_store_5(tmp_path_factory, smollm2, smol_data) -> Path:
    """The 24 samples captured by the hf engine in fp32, stored in fp32, at five layers (a DFlash
    store, and tight enough to compare with HF's own hidden_states at 1e-3)."""
    from eaglenest.cli import main

    out = tmp_path_factory.mktemp("feat5") / "f"
    assert main(["capture", "--model", str(smollm2), "--data", str(smol_data), "--out", str(out), "--batch-tokens", "1024",
                 "--device", "cpu", "--dtype", "fp32", "--store-dtype", "fp32",
                 "--layers", ",".join(map(str, FIVE_LAYERS))]) == 0
    return out


@pytest.fixture(scope="session")
def smol_regen(tmp_path_factory, smollm2):
    """learning_helpers.QUESTIONS with SmolLM2's own greedy answers (hf engine, fp32, REGEN_NEW
    tokens): what the learning tests over-fit drafts on and then decode (learning_helpers.Regenerated)."""
    from learning_helpers import regenerate_questions

    return regenerate_questions(smollm2, tmp_path_factory.mktemp("smol_regen"))
