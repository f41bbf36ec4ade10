"""Linears for exact verification (evaluate/rowwise/linears.py): row by row, or in the gemv kernel, for
forwards of up to max_rows rows; the GEMM of longer forwards (prefills); what `--linears` installs.

Which path a forward took shows in its outputs: F.linear is patched to add a mark (for batched calls,
or per dtype), so these checks hold on any CPU.  The kernel's own tests are test_native_gemv.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_kind import bf16_matrix_cpu, gemv_cpu
from helpers_eval import load_tiny, plain_greedy, random_draft
from test_native_gemv import _script, kernel  # noqa: F401 -- the kernel fixture and a script writer

from eaglenest import EaglenestError
from eaglenest.evaluate import verification
from eaglenest.evaluate.rowwise import linears
from eaglenest.evaluate.specdec import SpecDecoder
from eaglenest.native import gemv

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _marked(mark):
    """F.linear plus mark(x): which call computed an output shows in it."""
    native = F.linear

    def linear(x, w, b=None):
        return native(x, w, b) + mark(x)

    return linear


def test_set_rowwise_makes_verification_sized_forwards_one_row_calls(monkeypatch):
    lin = torch.nn.Linear(64, 48)
    monkeypatch.setattr(F, "linear", _marked(lambda x: 1.0 if x.numel() // x.shape[-1] > 1 else 0.0))  # batched calls
    linears.set_rowwise(lin, 4)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for m in (1, 2, 3, 4, 5):
            x = torch.randn(1, m, 64, generator=g)
            one_by_one = torch.cat([F.linear(x[:, i : i + 1], lin.weight, lin.bias) for i in range(m)], dim=1)
            if m <= 4:  # plain decoding's row, and verification's: one-row calls
                assert torch.equal(lin(x), one_by_one), m
            else:  # a longer forward (a prefill): the batched call, as without set_rowwise
                assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias)) and not torch.equal(lin(x), one_by_one)
        linears.set_rowwise(lin, None)
        x = torch.randn(1, 3, 64, generator=g)
        assert "forward" not in lin.__dict__ and torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_set_kernel_runs_verification_sized_forwards_in_the_kernel_and_prefills_in_a_gemm(kernel, monkeypatch):
    lin = torch.nn.Linear(64, 48).bfloat16()
    w, b = lin.weight, lin.bias
    monkeypatch.setattr(F, "linear", _marked(lambda x: 1.0 if x.dtype == torch.bfloat16 else 2.0))  # torch, and its dtype
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for fp32_prefill in (False, True):
            linears.set_kernel(lin, 4, fp32_prefill)
            for m in (1, 4):
                x = torch.randn(1, m, 64, generator=g).bfloat16()
                assert torch.equal(lin(x), gemv.linear(x, w, b)), m
            x = torch.randn(1, 5, 64, generator=g).bfloat16()
            want = F.linear(x.float(), w.float(), b.float()).bfloat16() if fp32_prefill else F.linear(x, w, b)
            assert torch.equal(lin(x), want), fp32_prefill
        linears.set_kernel(lin, None)
        assert "forward" not in lin.__dict__


def test_the_prefill_gemm_is_fp32_only_where_torch_emulates_bf16(monkeypatch):
    import eaglenest.utils

    monkeypatch.delenv("EAGLENEST_BF16_PREFILL", raising=False)
    monkeypatch.setattr(eaglenest.utils, "cpu_has_fast_bf16", lambda: True)
    assert linears.prefill_gemm() == (False, "torch's bf16 GEMM (this CPU has bf16 matrix instructions)")
    monkeypatch.setattr(eaglenest.utils, "cpu_has_fast_bf16", lambda: False)
    fp32, why = linears.prefill_gemm()
    assert fp32 and "fp32 GEMM" in why
    monkeypatch.setenv("EAGLENEST_BF16_PREFILL", "1")  # the other arm of bench/eval_prefill.py
    assert linears.prefill_gemm() == (False, "torch's bf16 GEMM (EAGLENEST_BF16_PREFILL=1)")


def test_prepare_puts_the_linears_on_the_kernel_and_verification_is_exact(kernel, tiny_llama_dir):
    """verification.prepare (--linears auto): every bf16 Linear of the target runs 1..k-row forwards in
    the kernel; the per-shape and end-to-end probes (which call the installed forwards) find
    verification bit-identical; speculative greedy == plain greedy; long prefills keep torch's bf16 GEMM
    where the CPU has bf16 matrix instructions and run in an fp32 GEMM where it has not."""
    m = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    v = verification.prepare(m, rows=4)
    assert v["linears"]["kernel"] == "eaglenest-gemv" and v["linears"]["max_rows"] == 4
    lin = [x for x in m.modules() if isinstance(x, torch.nn.Linear)]
    assert v["linears"]["modules"] == len(lin) and all(x.__dict__["forward"].func is linears._linear_by_kernel for x in lin)
    assert not any(any(p["differing"].values()) for p in v["probe_result"]["linears"])
    assert v["exact"] is True and "gemv kernel" in verification.summary(v)
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
    v = verification.prepare(m, rows=4)
    down = m.model.layers[0].mlp.down_proj
    x5 = torch.randn(1, 5, down.in_features).bfloat16()
    assert torch.equal(down(x5), F.linear(x5, down.weight)) and "EAGLENEST_BF16_PREFILL" in v["linears"]["prefill"]
    assert v["exact"] is True


def test_auto_leaves_large_verifications_to_torch_and_kernel_forces_it(kernel, tiny_llama_dir):
    """Above auto_max_rows() verified rows (large trees) `auto` keeps torch's GEMM, saying why;
    `--linears kernel` installs the kernel for them anyway, and verification is still exact."""
    many = linears.auto_max_rows() + 4
    m = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    v = linears.install_gemv(m, many, "auto")
    assert v["kernel"] == "torch" and f"verification of {many} rows" in v["why"]
    assert not any("forward" in x.__dict__ for x in m.modules())
    v = verification.prepare(m, rows=many, topk=4, linears="kernel")
    assert v["linears"]["kernel"] == "eaglenest-gemv" and v["linears"]["max_rows"] == many
    assert v["exact"] is True, v["probe_result"]["end_to_end"]


def test_linears_torch_keeps_f_linear_and_kernel_is_refused_where_it_cannot_build(tiny_llama_dir, tmp_path, monkeypatch):
    m = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    assert linears.install_gemv(m, 4, "torch") == {"kernel": "torch", "why": "--linears torch"}
    assert not any("forward" in x.__dict__ for x in m.modules())
    with pytest.raises(EaglenestError, match="--linears must be one of"):
        linears.install_gemv(m, 4, "fast")
    # the default compiler cannot build it: 'kernel' is refused, 'auto' says why it fell back
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(_script(tmp_path / "bin" / "cc", "echo 'cc: broken' >&2; exit 1").parent))
    gemv.load.cache_clear()
    try:
        if gemv_cpu():  # a CPU the kernel targets
            with pytest.raises(EaglenestError, match="could not build"):
                linears.install_gemv(m, 4, "kernel")
            v = linears.install_gemv(m, 4, "auto")
            assert v["kernel"] == "torch" and "could not build" in v["why"] and "cc: broken" in v["why"]
            # a $CC that cannot build it is an error either way: it was asked for
            monkeypatch.setenv("CC", "/bin/false")
            gemv.load.cache_clear()
            with pytest.raises(EaglenestError, match=r"\$CC='/bin/false'"):
                linears.install_gemv(m, 4, "auto")
        else:
            with pytest.raises(EaglenestError, match="neither AVX512-BF16 nor AVX2"):
                linears.install_gemv(m, 4, "kernel")
        assert not any("forward" in x.__dict__ for x in m.modules())
    finally:
        gemv.load.cache_clear()
