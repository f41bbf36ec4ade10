"""Exact verification: the policy that makes a k-token verification forward's rows bit-identical to
plain decoding -- what is probed, what is installed where the probe finds a difference, and the
report's `verification` block.  The forwards it installs are in rowwise/ (attention, linears, MoE
blocks); the gemv kernel is native/gemv.py.

Why: greedy speculative decoding is only *provably* equal to plain greedy decoding if the target
gives a token the same logits whether it is fed alone (plain decoding, one row per forward) or as
row i of a verification forward (num_draft_tokens rows).  Floating-point kernels do not promise
that: their blocking, and so the summation order, may depend on how many rows are computed
together.  What was seen (torch 2.13, SmolLM2 shapes; diagnostic runs whose result files were
retired, so no figure of them is quoted here):

  * SDPA over several query rows is not row-invariant on any CPU we have seen (near-ties flip the
    argmax);
  * bf16 `F.linear` on Intel Xeons with AMX: row-invariant for the row counts probed; on an AMD EPYC
    with AVX512-BF16 and no AMX the down_proj shape (K = 1536) is not: a 4-row call differs from four
    1-row calls in a few outputs, enough for speculative output to part from plain greedy output;
  * fp32 `F.linear` on that AMD CPU: no shape is row-invariant.

So the property is probed at run time, on this machine, with this thread count, and the
verification forward is made exact where it is not:

  0. linears ("kernel", where the CPU has AVX512-BF16 or AVX2 + FMA and a C compiler exists): every
     bf16 Linear runs forwards of 1..k rows in eaglenest's own matrix-vector kernel, row-invariant
     by construction and faster than torch's bf16 F.linear for these row counts
     (git show afe579c:bench/results/eval_gemv_cpu.json); the probes below then check it like any kernel.  Longer
     forwards (prompt prefills, shared by both decoders) stay in a GEMM (rowwise/linears.py
     `prefill_gemm`);
  1. attention ("rowwise"): each query row of a verification forward is its own single-query
     SDPA call over exactly the keys it may see -- the call plain decoding makes for that token;
     mixture-of-experts blocks likewise run each row alone: they group a forward's tokens per
     expert, so batched rows are never computed as a lone token is;
  2. per Linear weight shape, the model's own weights are fed random rows, batched (k rows: a
     verification forward always has exactly num_draft_tokens rows) against one row at a time; a
     shape that differs runs row by row (each row an M=1 call, what plain decoding does) in
     forwards of 2..k rows only (verification, and prefills of prompts that short, which both
     decoders share); the batched kernel stays where it is exact;
  3. end to end: a real k-row verification forward (chain, and a tree when topk > 1) against
     one-token forwards over the same KV cache: logits, every layer's hidden state (the aux
     states are among them) and the new KV entries must be bit-identical.  If not, every
     Linear goes row-wise and it is probed again; a verification that still fails is reported
     as not exact (`exact: false`), never claimed.

A probe can show that kernels differ, never prove they do not: the per-shape probe compares
2**18 outputs per (shape, k) (fewer for shapes narrower than 1,024 outputs: at most 256 calls),
so a kernel differing in 1 of 7,000 outputs passes it with probability ~e^-37; the end-to-end
probe then checks the whole forward.  Everything decided is in the report's `verification` block.

On CUDA the default is the model's own attention (`--attention auto`): row-wise verification is
a CPU exactness device that would slow GPU verification and skew the measured speedup there; the
end-to-end probe still runs and the report says whether verification was exact.
"""

from __future__ import annotations

import time

import torch

from eaglenest.evaluate.rowwise.attention import install_rowwise_attention
from eaglenest.evaluate.rowwise.linears import install_gemv, set_rowwise
from eaglenest.evaluate.rowwise.moe import moe_blocks, set_block_rowwise

PROBE_OUTPUTS = 1 << 18  # outputs compared per (Linear shape, row count) ...
PROBE_TRIALS = 256  # ... in at most this many batched calls (narrow shapes: per-call overhead)
ATTENTION_CHOICES = ("auto", "rowwise", "model")


def resolve_attention(choice: str, device: str) -> str:
    """`--attention auto` -> 'rowwise' on a CPU (exact verification), 'model' elsewhere."""
    if choice not in ATTENTION_CHOICES:
        from eaglenest import EaglenestError

        raise EaglenestError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)} (got {choice!r})")
    if choice != "auto":
        return choice
    return "rowwise" if str(device).split(":")[0] == "cpu" else "model"


# ----------------------------------------------------------------------------------------------
# the per-shape probe


def linear_groups(model) -> dict[tuple, list[str]]:
    """Linear modules grouped by what selects the kernel: (weight shape, dtype, device, bias)."""
    groups: dict[tuple, list[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            w = m.weight
            groups.setdefault((tuple(w.shape), str(w.dtype), str(w.device), m.bias is not None), []).append(name)
    return groups


@torch.inference_mode()
def probe_linear(module: torch.nn.Linear, rows: list[int], seed: int = 0) -> dict[int, tuple[int, int]]:
    """{M: (differing outputs, outputs compared)} for each M in `rows`: M-row calls vs M one-row
    calls of the module as installed (F.linear, or the gemv kernel), on its own weights with random
    inputs shaped like a batch-1 forward's [1, M, K]."""
    w = module.weight
    n_out, k = w.shape
    g = torch.Generator().manual_seed(seed)
    res = {}
    for m in rows:
        trials = min(PROBE_TRIALS, -(-PROBE_OUTPUTS // (m * n_out)))
        x = torch.randn(trials, 1, m, k, generator=g).to(device=w.device, dtype=w.dtype)
        diff = 0
        for t in range(trials):
            batched = module(x[t])
            single = torch.cat([module(x[t, :, i : i + 1]) for i in range(m)], dim=1)
            diff += int((batched != single).sum())
        res[m] = (diff, trials * m * n_out)
    return res


# ----------------------------------------------------------------------------------------------
# the end-to-end probe


def _random_tree(n: int, topk: int) -> tuple[list[int], list[int]]:
    """(parents, depths) of n nodes: each of the first nodes gets topk children, breadth first."""
    parents, depths = [], []
    for i in range(n):
        p = -1 if i < topk else (i - topk) // topk
        parents.append(p)
        depths.append(1 if p < 0 else depths[p] + 1)
    return parents, depths


@torch.inference_mode()
def probe_end_to_end(model, rows: int, topk: int = 1, trials: int = 2, prompt_len: int = 24, seed: int = 0) -> dict:
    """A real `rows`-token verification forward vs one-token forwards over the same KV cache.

    Shapes: a chain (what topk 1 verifies) and, for topk > 1, a tree with the 4-D ancestor mask
    and tree positions the decoder builds.  Compared bit for bit per row: logits, the hidden
    state entering every layer and the final one, and the row's new K/V entries in every layer."""
    from eaglenest.evaluate.specdec import _new_cache, tree_verify_inputs

    dev = next(model.parameters()).device
    V = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    shapes = [("chain", list(range(-1, rows - 2)), list(range(1, rows)))]
    if topk > 1:
        shapes.append(("tree", *_random_tree(rows - 1, topk)))
    worst, first_bad, compared = 0.0, None, 0
    for trial in range(trials):
        prompt = torch.randint(0, V, (prompt_len,), generator=g).tolist()
        for kind, parents, depths in shapes:
            ids = [prompt[-1]] + torch.randint(0, V, (rows - 1,), generator=g).tolist()
            ctx = prompt[:-1]
            Lt = len(ctx)
            cv = _new_cache(model)
            model(input_ids=torch.tensor([ctx], device=dev), past_key_values=cv, use_cache=True)
            pos, mask = (None, None) if kind == "chain" else tree_verify_inputs(Lt, parents, depths, dev)
            out = model(input_ids=torch.tensor([ids], device=dev), position_ids=pos, attention_mask=mask,
                        past_key_values=cv, use_cache=True, output_hidden_states=True)
            # the reference: plain decoding of each row's path (root, its ancestors, itself)
            cr = _new_cache(model)
            model(input_ids=torch.tensor([ctx], device=dev), past_key_values=cr, use_cache=True)
            fed: list[int] = []  # verify-input rows currently in the reference cache, in order
            for r in range(rows):
                path = [r]  # row r > 0 is node r-1; its parent's row is parents[r-1] + 1 (the root is row 0)
                while path[-1] > 0:
                    path.append(parents[path[-1] - 1] + 1)
                path.reverse()  # [0, ..., r]
                keep = 0
                while keep < len(fed) and keep < len(path) - 1 and fed[keep] == path[keep]:
                    keep += 1
                if len(fed) > keep:
                    cr.crop(keep - len(fed))
                    fed = fed[:keep]
                for node in path[keep:]:
                    x = torch.tensor([[ids[node]]], device=dev)
                    p = torch.tensor([[Lt + len(fed)]], device=dev)
                    ref = model(input_ids=x, position_ids=p, past_key_values=cr, use_cache=True, output_hidden_states=True)
                    fed.append(node)
                pairs = [("logits", out.logits[0, r], ref.logits[0, -1])]
                pairs += [(f"hidden_states[{j}]", hv[0, r], hr[0, -1]) for j, (hv, hr) in enumerate(zip(out.hidden_states, ref.hidden_states))]
                for j, (lv, lr) in enumerate(zip(cv.layers, cr.layers)):
                    pairs += [(f"keys of layer {j}", lv.keys[..., Lt + r, :], lr.keys[..., -1, :]),
                              (f"values of layer {j}", lv.values[..., Lt + r, :], lr.values[..., -1, :])]
                for what, a_, b_ in pairs:
                    compared += 1
                    if not torch.equal(a_, b_):
                        if what == "logits":
                            worst = max(worst, float((a_.float() - b_.float()).abs().max()))
                        if first_bad is None:
                            first_bad = f"{kind} verification, trial {trial}, row {r}: {what} differ"
    return {"exact": first_bad is None, "shapes": [s[0] for s in shapes], "rows": rows, "trials": trials,
            "tensors_compared": compared, "first_difference": first_bad, "max_abs_logit_difference": worst}


# ----------------------------------------------------------------------------------------------
# the set-up the evaluator runs


def prepare(model, *, rows: int | list[int], topk: int = 1, attention: str = "rowwise", linears: str = "auto") -> dict:
    """Make `model`'s verification forwards of `rows` tokens (num_draft_tokens; a list when one
    model serves several) exact where this machine allows, and say what was done and measured:
    the report's `verification` block (see the module docstring).
    attention: 'rowwise' (the exact path) or 'model' (the model's own attention, only probed);
    linears: 'auto' / 'kernel' / 'torch' (install_gemv; the kernel only with row-wise attention)."""
    t0 = time.perf_counter()
    sizes = sorted({int(r) for r in ([rows] if isinstance(rows, int) else rows) if int(r) > 1})
    most = max(sizes, default=1)
    dtype = next(model.parameters()).dtype
    rowwise: dict = {"attention": None, "linears": [], "all_linears": False, "moe_blocks": None}
    probe: dict = {"threads": torch.get_num_threads(), "rows_probed": sizes, "linears": None}
    groups = linear_groups(model)
    modules = dict(model.named_modules())
    kernel = install_gemv(model, most, linears if attention == "rowwise" and sizes else "torch")

    def end_to_end() -> dict:
        runs = [probe_end_to_end(model, k, topk) for k in sizes]
        bad = next((r for r in runs if not r["exact"]), None)
        return {"exact": bad is None, "shapes": runs[0]["shapes"] if runs else [], "rows": sizes,
                "tensors_compared": sum(r["tensors_compared"] for r in runs),
                "first_difference": bad and bad["first_difference"],
                "max_abs_logit_difference": max((r["max_abs_logit_difference"] for r in runs), default=0.0)}

    if attention == "rowwise" and sizes:
        install_rowwise_attention(model, most)
        rowwise["attention"] = ("every query row of a verification forward is one single-query SDPA call over the keys "
                                "it may see (multi-row SDPA is not row-invariant)")
        if blocks := moe_blocks(model):
            for m in blocks.values():
                set_block_rowwise(m, most)
            rowwise["moe_blocks"] = {"modules": len(blocks), "example": next(iter(blocks)),
                                     "why": "a mixture-of-experts block computes its experts on the tokens routed to them "
                                            "together, so a verified token's arithmetic depends on the others: each token "
                                            "runs the block alone, as in plain decoding"}
        probe["linears"] = []
        for (shape, dt, _dev, bias), names in groups.items():
            res = probe_linear(modules[names[0]], sizes)
            differing = {str(m): d for m, (d, _) in res.items()}
            probe["linears"].append({"shape": list(shape), "dtype": dt.replace("torch.", ""), "bias": bias, "modules": len(names),
                                     "probed_on": names[0], "outputs_compared": {str(m): n for m, (_, n) in res.items()},
                                     "differing": differing})
            if any(differing.values()):
                for n in names:
                    set_rowwise(modules[n], most)
                worst = max(res, key=lambda m: res[m][0] / res[m][1])
                rowwise["linears"].append({
                    "shape": list(shape), "modules": len(names), "example": names[0],
                    "why": f"probe: a {worst}-row call differs from {worst} one-row calls in {res[worst][0]:,} of "
                           f"{res[worst][1]:,} outputs"})
    stages = [{"linears_rowwise": ["x".join(map(str, r["shape"])) for r in rowwise["linears"]], **end_to_end()}]
    if not stages[-1]["exact"] and attention == "rowwise" and sizes:
        # something the per-shape probe did not catch: fall back to every Linear row by row
        for names in groups.values():
            for n in names:
                set_rowwise(modules[n], most)
        rowwise["all_linears"] = True
        if kernel["kernel"] != "torch":
            kernel = {"kernel": "torch", "why": "dropped: verification differed with it; every Linear runs row by row"}
        stages.append({"linears_rowwise": "all", **end_to_end()})
    probe["end_to_end"] = stages
    probe["seconds"] = round(time.perf_counter() - t0, 2)
    return {"dtype": str(dtype).replace("torch.", ""), "attention": attention, "exact": bool(stages[-1]["exact"]),
            "linears": kernel, "rowwise": rowwise, "probe_result": probe}


def summary(v: dict | None) -> str:
    """One line for the report tables."""
    if not v:
        return "-"
    rw = v.get("rowwise") or {}
    parts = []
    if rw.get("attention"):
        parts.append("attention row-wise")
    if rw.get("moe_blocks"):
        parts.append(f"MoE blocks token by token ({rw['moe_blocks']['modules']})")
    if rw.get("all_linears"):
        parts.append("all linears row-wise")
    elif rw.get("linears"):
        parts.append("row-wise " + ", ".join(f"{'x'.join(map(str, r['shape']))} ({r['modules']})" for r in rw["linears"]))
    if (v.get("linears") or {}).get("kernel") == "eaglenest-gemv":
        parts.insert(0, "linears in the gemv kernel")
    head = "exact (probed)" if v.get("exact") else "NOT exact (probe differs)"
    return f"{head}, {v.get('dtype')}" + (f"; {'; '.join(parts)}" if parts else "; model attention")
