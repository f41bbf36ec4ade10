"""The exact-verification policy (evaluate/verification.py): the --attention choice, the per-shape and
end-to-end probes, what `prepare` installs where they find a difference, and the report line.

The probes are checked on kernels whose row dependence is known: stub modules (every output differs,
or none does, on any CPU) and F.linear made batch-dependent in-process.  That the remedy restores
bit-identity is asserted on every CPU: row-wise Linears are M=1 calls, the calls plain decoding makes."""

from __future__ import annotations

import pytest
import torch
from helpers_eval import batch_dependent_linear, chunk_and_one_by_one, load_tiny, spec_equals_plain

from eaglenest import EaglenestError
from eaglenest.evaluate import verification
from eaglenest.evaluate.rowwise.attention import install_rowwise_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 500, 600, 700, 800], [1, 9690, 198, 2683, 359, 253], [1, 42], list(range(1, 40, 3))]


def test_attention_auto_is_rowwise_on_a_cpu_and_the_models_own_elsewhere():
    r = verification.resolve_attention
    assert r("auto", "cpu") == "rowwise"
    assert r("auto", "cuda") == r("auto", "cuda:1") == "model"
    assert r("rowwise", "cuda:0") == "rowwise" and r("model", "cpu") == "model"
    with pytest.raises(EaglenestError, match="--attention"):
        r("fast", "cpu")


class _StubLinear(torch.nn.Module):
    """A 'Linear' of weight shape (N, K) whose outputs are copies of the first input feature, plus
    shift(rows of the call): row-invariant exactly when shift is constant, on any CPU (no arithmetic
    but that one addition)."""

    def __init__(self, n: int, k: int, shift):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n, k), requires_grad=False)
        self.shift = shift

    def forward(self, x):
        return x[..., :1].expand(*x.shape[:-1], self.weight.shape[0]) + self.shift(x.shape[-2])


@pytest.mark.parametrize("n", [48, 4096])  # narrow: PROBE_TRIALS calls; wide: PROBE_OUTPUTS outputs
def test_the_shape_probe_counts_differing_outputs(n):
    rows = [2, 4]
    invariant = verification.probe_linear(_StubLinear(n, 8, lambda m: 0.0), rows)
    dependent = verification.probe_linear(_StubLinear(n, 8, lambda m: float(m - 1)), rows)
    for m in rows:
        trials = min(verification.PROBE_TRIALS, -(-verification.PROBE_OUTPUTS // (m * n)))
        assert invariant[m] == (0, trials * m * n)
        assert dependent[m] == (trials * m * n, trials * m * n)  # a batched call: every output shifted
    assert invariant[4][1] == (verification.PROBE_OUTPUTS if n == 4096 else verification.PROBE_TRIALS * 4 * n)


def test_linear_groups_are_keyed_by_what_selects_the_kernel():
    m = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 8), "b": torch.nn.Linear(4, 8), "c": torch.nn.Linear(4, 8, bias=False),
                             "d": torch.nn.Linear(4, 8).bfloat16(), "e": torch.nn.Linear(8, 4)})
    assert verification.linear_groups(m) == {
        ((8, 4), "torch.float32", "cpu", True): ["a", "b"], ((8, 4), "torch.float32", "cpu", False): ["c"],
        ((8, 4), "torch.bfloat16", "cpu", True): ["d"], ((4, 8), "torch.float32", "cpu", True): ["e"]}


def test_probe_finds_a_batch_dependent_linear_and_rowwise_restores_identity(tiny_llama_dir, monkeypatch):
    """With down_proj's batched kernel made M-dependent in-process: the end-to-end probe sees a
    verification forward differ from plain decoding, the per-shape probe names that shape, only
    the shapes it found batch-dependent run row by row, and verification is bit-identical again."""
    ref_model = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    down = tuple(ref_model.model.layers[0].mlp.down_proj.weight.shape)
    monkeypatch.setattr(torch.nn.functional, "linear", batch_dependent_linear(down))

    install_rowwise_attention(ref_model, 4)  # the previous exact path: attention only
    before = verification.probe_end_to_end(ref_model, 4)
    assert not before["exact"] and "differ" in before["first_difference"]
    one, chunk = chunk_and_one_by_one(ref_model, PROMPTS[3], [700, 800, 900, 1000])
    assert not torch.equal(one, chunk)

    m = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    v = verification.prepare(m, rows=4, linears="torch")  # the probe of torch's kernels (the gemv kernel would bypass the patch)
    probed = {tuple(x["shape"]): x for x in v["probe_result"]["linears"]}
    flagged = {tuple(x["shape"]) for x in v["rowwise"]["linears"]}
    assert down in flagged and sum(probed[down]["differing"].values()) > 1000, probed[down]
    assert flagged == {s for s, x in probed.items() if any(x["differing"].values())}
    for (shape, *_), names in verification.linear_groups(m).items():  # batched where the probe found it exact
        for n in names:
            assert ("forward" in m.get_submodule(n).__dict__) == (shape in flagged or v["rowwise"]["all_linears"]), n
    assert v["exact"] is True, v["probe_result"]["end_to_end"]
    one, chunk = chunk_and_one_by_one(m, PROMPTS[3], [700, 800, 900, 1000])
    assert torch.equal(one, chunk)
    spec_equals_plain(m, PROMPTS, 24, chain_only=True)


def test_a_difference_the_shape_probe_misses_sends_every_linear_row_wise(tiny_llama_dir, monkeypatch):
    """The end-to-end probe is the backstop: where the per-shape probe passes a batch-dependent shape,
    verification is found not exact, every Linear goes row by row, and the second probe finds it exact."""
    m = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    down = tuple(m.model.layers[0].mlp.down_proj.weight.shape)
    monkeypatch.setattr(torch.nn.functional, "linear", batch_dependent_linear(down))
    monkeypatch.setattr(verification, "probe_linear", lambda module, rows: {r: (0, 1) for r in rows})  # sees nothing
    v = verification.prepare(m, rows=4, linears="torch")
    first, second = v["probe_result"]["end_to_end"]
    assert first["linears_rowwise"] == [] and not first["exact"] and "differ" in first["first_difference"]
    assert second["linears_rowwise"] == "all" and second["exact"] is True, second
    assert v["rowwise"]["all_linears"] and v["exact"] is True
    assert all("forward" in x.__dict__ for x in m.modules() if isinstance(x, torch.nn.Linear))
    assert "all linears row-wise" in verification.summary(v)


def test_the_report_line_says_what_was_made_exact():
    s = verification.summary
    assert s(None) == "-"
    rowwise = {"attention": "every query row ...", "linears": [{"shape": [576, 1536], "modules": 30}], "all_linears": False,
               "moe_blocks": {"modules": 3}}
    v = {"exact": True, "dtype": "bfloat16", "linears": {"kernel": "eaglenest-gemv"}, "rowwise": rowwise}
    assert s(v) == ("exact (probed), bfloat16; linears in the gemv kernel; attention row-wise; "
                    "MoE blocks token by token (3); row-wise 576x1536 (30)")
    v = {"exact": True, "dtype": "float32", "linears": {"kernel": "torch"}, "rowwise": {**rowwise, "all_linears": True}}
    assert s(v) == "exact (probed), float32; attention row-wise; MoE blocks token by token (3); all linears row-wise"
    v = {"exact": False, "dtype": "float32", "linears": {"kernel": "torch"},
         "rowwise": {"attention": None, "linears": [], "all_linears": False, "moe_blocks": None}}
    assert s(v) == "NOT exact (probe differs), float32; model attention"
