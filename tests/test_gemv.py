"""The row-invariant bf16 matrix-vector kernel (evaluate/gemv.py) and its place in exact verification.

On CI's CPU kinds (AVX512-BF16 on both) the kernel must build and run, as on any x86-64 CPU with AVX2 +
FMA (its second build: an AVX2-only AMD EPYC, most laptops); elsewhere these tests skip, saying why.  Row-invariance is asserted bit for bit: the kernel promises it by construction (one
fixed instruction sequence per output), unlike a library GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_kind import bf16_matrix_cpu, cpu_kind
from helpers_eval import load_tiny, plain_greedy, random_draft

from eaglenest import EaglenestError
from eaglenest.evaluate import exact, gemv
from eaglenest.evaluate.specdec import SpecDecoder
from eaglenest.utils import cpu_flags

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def kernel():
    lib, why = gemv.load()
    if lib is None:
        if cpu_kind():
            pytest.fail(f"the gemv kernel must run on a {cpu_kind()} CPU (one CI runs on): {why}")
        pytest.skip(f"gemv kernel unavailable here: {why}")
    return lib


# (N, K, bias): SmolLM2's shapes, Qwen-style biases, K not a multiple of 32 (masked tail), N not of 4
SHAPES = [(576, 576, False), (192, 576, True), (1536, 576, False), (576, 1536, False), (7, 100, True), (33, 1000, False)]


@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_kernel_is_a_linear_and_row_invariant(kernel, n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(1, m, k, generator=g).bfloat16()
        y = gemv.linear(x, w, b)
        assert y.shape == (1, m, n) and y.dtype == torch.bfloat16
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        # bf16 output rounding (2^-9 relative) plus fp32 accumulation: far below an indexing bug's O(1)
        assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-2
        one_by_one = torch.cat([gemv.linear(x[:, i : i + 1], w, b) for i in range(m)], dim=1)
        assert torch.equal(y, one_by_one), f"{m} rows differ from {m} one-row calls"
        torch.set_num_threads(2)
        try:
            assert torch.equal(gemv.linear(x, w, b), y), "the thread count changed an output"
        finally:
            torch.set_num_threads(1)


def test_kernel_refuses_what_it_cannot_compute(kernel):
    w = torch.randn(8, 64).bfloat16()
    with pytest.raises(ValueError, match="bf16 CPU"):
        gemv.linear(torch.randn(1, 64), w)
    with pytest.raises(ValueError, match="features"):
        gemv.linear(torch.randn(1, 32).bfloat16(), w)


def test_prepare_puts_the_linears_on_the_kernel_and_verification_is_exact(kernel, tiny_llama_dir):
    """exact.prepare (--linears auto): every bf16 Linear of the target runs 1..k-row forwards in the
    kernel; the per-shape and end-to-end probes (which call the installed forwards) find
    verification bit-identical; speculative greedy == plain greedy; long prefills keep torch's bf16 GEMM
    where the CPU has bf16 matrix instructions and run in an fp32 GEMM where it has not."""
    m = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    v = exact.prepare(m, rows=4)
    assert v["linears"]["kernel"] == "eaglenest-gemv" and v["linears"]["max_rows"] == 4
    lin = [x for x in m.modules() if isinstance(x, torch.nn.Linear)]
    assert v["linears"]["modules"] == len(lin) and all(x.__dict__["forward"].func is exact._linear_by_kernel for x in lin)
    assert not any(any(p["differing"].values()) for p in v["probe_result"]["linears"])
    assert v["exact"] is True and "gemv kernel" in exact.summary(v)
    down = m.model.layers[0].mlp.down_proj
    x5 = torch.randn(1, 5, down.in_features).bfloat16()
    if bf16_matrix_cpu():  # 5 > k rows: torch's GEMM, as before
        assert torch.equal(down(x5), F.linear(x5, down.weight)) and "bf16 GEMM" in v["linears"]["prefill"]
    else:  # torch would emulate the bf16 GEMM: the same values in fp32, rounded back
        assert torch.equal(down(x5), F.linear(x5.float(), down.weight.float()).bfloat16()) and "fp32 GEMM" in v["linears"]["prefill"]
    d = random_draft(m, draft_vocab=4096)
    for p in ([1, 500, 600, 700, 800], list(range(1, 40, 3))):
        with SpecDecoder(m, d, set(), steps=3) as sd:
            assert sd.generate(p, 24).output_ids == plain_greedy(m, p, 24)


@pytest.mark.skipif(bf16_matrix_cpu(), reason="bf16 matrix instructions: prefills already run torch's bf16 GEMM")
def test_bf16_prefill_env_keeps_torchs_gemm(kernel, tiny_llama_dir, monkeypatch):
    """EAGLENEST_BF16_PREFILL=1 (the other arm of bench/eval_prefill.py) keeps F.linear for long prefills."""
    monkeypatch.setenv("EAGLENEST_BF16_PREFILL", "1")
    m = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    v = exact.prepare(m, rows=4)
    down = m.model.layers[0].mlp.down_proj
    x5 = torch.randn(1, 5, down.in_features).bfloat16()
    assert torch.equal(down(x5), F.linear(x5, down.weight)) and "EAGLENEST_BF16_PREFILL" in v["linears"]["prefill"]
    assert v["exact"] is True


def test_auto_leaves_large_verifications_to_torch_and_kernel_forces_it(kernel, tiny_llama_dir):
    """Above GEMV_AUTO_MAX_ROWS verified rows (large trees) `auto` keeps torch's GEMM, saying why;
    `--linears kernel` installs the kernel for them anyway, and verification is still exact."""
    many = exact.GEMV_AUTO_MAX_ROWS[gemv.isa()] + 4
    m = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    v = exact.prepare(m, rows=many, topk=4)
    assert v["linears"]["kernel"] == "torch" and f"verification of {many} rows" in v["linears"]["why"]
    m = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    v = exact.prepare(m, rows=many, topk=4, linears="kernel")
    assert v["linears"]["kernel"] == "eaglenest-gemv" and v["linears"]["max_rows"] == many
    assert v["exact"] is True, v["probe_result"]["end_to_end"]


def test_linears_torch_keeps_f_linear_and_kernel_is_refused_where_it_cannot_build(tiny_llama_dir, tmp_path, monkeypatch):
    m = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    v = exact.prepare(m, rows=4, linears="torch")
    assert v["linears"] == {"kernel": "torch", "why": "--linears torch"}
    # (a shape torch computes batch-dependently here may still run row by row: exact.set_rowwise)
    assert not any(getattr(x.__dict__.get("forward"), "func", None) is exact._linear_by_kernel for x in m.modules())
    with pytest.raises(EaglenestError, match="--linears must be one of"):
        exact.prepare(m, rows=4, linears="fast")
    # no working compiler and no built kernel in the cache: 'kernel' is refused, 'auto' says why it fell back
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    gemv.load.cache_clear()
    try:
        m2 = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
        flags = set(cpu_flags().split())
        if "avx512_bf16" in flags or {"avx2", "fma"} <= flags:  # a CPU the kernel targets
            with pytest.raises(EaglenestError, match="could not build"):
                exact.prepare(m2, rows=4, linears="kernel")
            v2 = exact.prepare(m2, rows=4)
            assert v2["linears"]["kernel"] == "torch" and "could not build" in v2["linears"]["why"]
        else:
            with pytest.raises(EaglenestError, match="neither AVX512-BF16 nor AVX2"):
                exact.prepare(m2, rows=4, linears="kernel")
    finally:
        gemv.load.cache_clear()
