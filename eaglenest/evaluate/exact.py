"""Exact verification: a k-token verification forward whose rows are bit-identical to plain decoding.

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

  0. linears ("kernel", where the CPU has AVX512-BF16 or AVX2 + FMA and a C compiler exists): every bf16 Linear
     runs forwards of 1..k rows in eaglenest's own matrix-vector kernel (native/gemv.py), row-invariant by
     construction and faster than torch's bf16 F.linear for these row counts
     (bench/results/eval_gemv_cpu.json); the probes below then check it like any kernel.  Longer
     forwards (prompt prefills, shared by both decoders) stay in a GEMM: torch's bf16 one, or where
     the CPU has no bf16 matrix instructions (torch emulates bf16 there) an fp32 GEMM of the same
     bf16 values (`prefill_gemm`);

  1. attention ("rowwise"): each query row of a verification forward is its own single-query
     SDPA call over exactly the keys it may see -- the call plain decoding makes for that token;
     mixture-of-experts blocks (`moe_blocks`) likewise run each row alone: they group a forward's
     tokens per expert, so batched rows are never computed as a lone token is;
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

import functools
import os
import time

import torch
import torch.nn.functional as F

from eaglenest.native import gemv

NAME = "eaglenest_rowwise"  # the attention implementation name registered with transformers
PROBE_OUTPUTS = 1 << 18  # outputs compared per (Linear shape, row count) ...
PROBE_TRIALS = 256  # ... in at most this many batched calls (narrow shapes: per-call overhead)
ATTENTION_CHOICES = ("auto", "rowwise", "model")
LINEAR_CHOICES = ("auto", "kernel", "torch")
# `--linears auto` takes the gemv kernel for verifications of at most this many rows, per build: where
# it stops beating torch's batched kernels (bench/results/gemv_rows_cpu_avx2.json; the avx512-bf16 limit's
# file, gemv_rows_cpu.json, is retired until re-run: bench/report.py RETIRED)
GEMV_AUTO_MAX_ROWS = {"avx512-bf16": 8, "avx2": 64}


def resolve_attention(choice: str, device: str) -> str:
    """`--attention auto` -> 'rowwise' on a CPU (exact verification), 'model' elsewhere."""
    if choice not in ATTENTION_CHOICES:
        from eaglenest import EaglenestError

        raise EaglenestError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)} (got {choice!r})")
    if choice != "auto":
        return choice
    return "rowwise" if str(device).split(":")[0] == "cpu" else "model"


# ----------------------------------------------------------------------------------------------
# row-wise attention


class RowwiseAttention:
    """The attention of one model.  The per-row key selections of a mask are computed once per
    forward (every layer gets the same mask object) and forgotten after it (`forget`)."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self._mask = None
        self._rows: list = []

    def forget(self, *_ignored) -> None:
        self._mask, self._rows = None, []

    def _row_keys(self, mask: torch.Tensor, q_len: int, kv_len: int) -> list:
        """Per query row: a key-prefix length (int) or an index tensor of allowed keys."""
        if self._mask is mask:
            return self._rows
        m = mask[0, 0] if mask.dim() == 4 else mask[0]
        allowed = m if m.dtype == torch.bool else (m == 0)
        allowed = allowed[-q_len:, :kv_len]
        rows = []
        for i in range(q_len):
            idx = allowed[i].nonzero().flatten()
            n = idx.numel()
            rows.append(n if n and int(idx[-1]) == n - 1 else idx)  # a prefix: slice, no copy
        self._mask, self._rows = mask, rows
        return rows

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """query [B, H, q, d], key/value [B, Hkv, L, d] -> ([B, q, H, d], None)."""
        B, _, q_len, _ = query.shape
        kv_len = key.shape[2]
        gqa = query.shape[1] != key.shape[1]
        if q_len == 1 and B == 1 and attention_mask is None:  # plain decoding: one row, every key (hot path)
            out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=gqa)
            return out.transpose(1, 2), None
        if B != 1 or q_len > self.max_rows or kv_len == q_len:  # prefill / batches: ordinary SDPA
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if attention_mask is None:  # causal, aligned to the end
            rows = [kv_len - q_len + i + 1 for i in range(q_len)]
        else:
            rows = self._row_keys(attention_mask, q_len, kv_len)
        outs = []
        for i, sel in enumerate(rows):
            if isinstance(sel, int):
                k, v = key[:, :, :sel], value[:, :, :sel]
            else:
                k, v = key.index_select(2, sel), value.index_select(2, sel)
            outs.append(F.scaled_dot_product_attention(query[:, :, i : i + 1], k, v, scale=scaling, enable_gqa=gqa))
        out = torch.cat(outs, dim=2) if q_len > 1 else outs[0]
        return out.transpose(1, 2).contiguous(), None


def _dispatch(module, *args, **kwargs):
    """The function registered with transformers (its registry is global): the work is done by the
    RowwiseAttention that `install_rowwise_attention` attached to this model's attention modules."""
    return module.eaglenest_rowwise(module, *args, **kwargs)


def _attention_modules(model) -> list:
    """The modules that call transformers' attention interface (LlamaAttention, Qwen2Attention, ...)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "config")]


def install_rowwise_attention(model, max_rows: int) -> RowwiseAttention:
    """Switch `model` to row-wise attention for forwards of up to `max_rows` query rows."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    mods = _attention_modules(model)
    if not mods:
        from eaglenest import EaglenestError

        raise EaglenestError(f"{type(model).__name__}: no attention modules (*Attention) found for row-wise attention")
    AttentionInterface.register(NAME, _dispatch)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the usual causal masks
    att = getattr(mods[0], "eaglenest_rowwise", None)
    if att is None:  # first install on this model
        att = RowwiseAttention(max_rows)
        for m in mods:
            m.eaglenest_rowwise = att
        model.register_forward_hook(att.forget)  # the memo lives for one forward only
    att.max_rows = max_rows
    model.set_attn_implementation(NAME)
    return att


# ----------------------------------------------------------------------------------------------
# row-wise linears


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.numel() else 0


def _each_row(fn, x: torch.Tensor) -> torch.Tensor:
    """fn applied to each row of x alone, shaped as plain decoding feeds it ([1, 1, K]), joined back."""
    rows = _rows(x)
    flat = x.reshape(rows, 1, x.shape[-1])
    out = torch.cat([fn(flat[i : i + 1]) for i in range(rows)])
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _linear_by_rows(module: torch.nn.Linear, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    if not 1 < _rows(x) <= max_rows:  # plain decoding (already one row) and long prefills
        return F.linear(x, module.weight, module.bias)
    return _each_row(lambda r: F.linear(r, module.weight, module.bias), x)


def _linear_by_kernel(module: torch.nn.Linear, max_rows: int, x: torch.Tensor, fp32_prefill: bool = False) -> torch.Tensor:
    if 1 <= _rows(x) <= max_rows and x.dtype == torch.bfloat16:
        return gemv.linear(x, module.weight, module.bias)
    if fp32_prefill and x.dtype == torch.bfloat16:
        # a long prefill where torch emulates bf16 GEMMs (no AMX / AVX512-BF16): the same bf16 values in an
        # fp32 GEMM, rounded back: faster there (the demo's eval: bench/results/eval_prefill_cpu_avx2.json)
        b = None if module.bias is None else module.bias.float()
        return F.linear(x.float(), module.weight.float(), b).to(x.dtype)
    return F.linear(x, module.weight, module.bias)  # long prefills: the GEMM, shared by both decoders


def _set_forward(module: torch.nn.Module, how, max_rows: int | None) -> None:
    if max_rows is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = functools.partial(how, module, max_rows)


def set_rowwise(module: torch.nn.Linear, max_rows: int | None) -> None:
    """Compute `module` one row at a time in forwards of 2..max_rows rows (None: batched again)."""
    _set_forward(module, _linear_by_rows, max_rows)


def set_kernel(module: torch.nn.Linear, max_rows: int | None, fp32_prefill: bool = False) -> None:
    """Compute `module` in the gemv kernel in forwards of 1..max_rows rows (None: F.linear again);
    longer forwards (prefills) in an fp32 GEMM with `fp32_prefill`, else in F.linear."""
    _set_forward(module, functools.partial(_linear_by_kernel, fp32_prefill=fp32_prefill), max_rows)


# ----------------------------------------------------------------------------------------------
# mixture-of-experts blocks row by row


def moe_blocks(model) -> dict[str, torch.nn.Module]:
    """The model's mixture-of-experts blocks (a router `gate` next to its `experts`: DeepSeek-V2/V3,
    Kimi-K2, Qwen2/3-MoE, Mixtral in transformers 5).  A block routes a forward's tokens to experts
    in groups, so a token's expert GEMMs have as many rows as tokens that chose that expert in the
    same forward -- which other tokens are verified with it decides its arithmetic -- and the
    experts are 3-D weights called through F.linear, not Linear modules the row-wise fix reaches."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "experts") and hasattr(m, "gate")}


def _block_by_rows(module: torch.nn.Module, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    forward = type(module).forward.__get__(module)  # the class's own forward, under the one installed here
    if not 1 < _rows(x) <= max_rows:  # plain decoding and long prefills: the block as it is
        return forward(x)

    def one(r: torch.Tensor) -> torch.Tensor:
        out = forward(r)
        if not isinstance(out, torch.Tensor):  # e.g. (states, router logits): not a block this knows how to join
            from eaglenest import EaglenestError

            raise EaglenestError(f"exact verification: the mixture-of-experts block {type(module).__name__} returns "
                                 f"{type(out).__name__}, not a tensor of states, so it cannot be run token by token; "
                                 "--attention model keeps the model's own forward (exactness then only probed)")
        return out

    return _each_row(one, x)


def set_block_rowwise(module: torch.nn.Module, max_rows: int | None) -> None:
    """Run a token-wise block (an MoE block: each token's output depends on that token alone) one
    token at a time in forwards of 2..max_rows rows (None: as it is again)."""
    _set_forward(module, _block_by_rows, max_rows)


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


def install_gemv(model, max_rows: int, linears: str) -> dict:
    """Put the model's bf16 CPU Linears on the row-invariant gemv kernel (native/gemv.py) for forwards of
    1..max_rows rows -- plain decoding and verification then run the same per-row arithmetic --
    where `linears` asks for it ('auto': where it can run, for verifications of at most
    GEMV_AUTO_MAX_ROWS[its build] rows; 'kernel': required; 'torch': never).
    Returns the report's `linears` block."""
    from eaglenest import EaglenestError

    if linears not in LINEAR_CHOICES:
        raise EaglenestError(f"--linears must be one of {', '.join(LINEAR_CHOICES)} (got {linears!r})")
    mods = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
            and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"]
    isa = gemv.isa()
    if linears == "torch":
        why = "--linears torch"
    elif not mods:
        why = "no bf16 CPU Linear layers"
    else:
        why = gemv.load()[1]
        if not why and linears == "auto" and max_rows > (limit := GEMV_AUTO_MAX_ROWS[isa]):
            why = (f"verification of {max_rows} rows: above {limit} the kernel's work grows with the rows and torch's "
                   f"batched kernels are faster here (bench/results/gemv_rows_cpu*.json); --linears kernel forces it")
    if why:
        if linears == "kernel":
            raise EaglenestError(f"--linears kernel: the gemv kernel cannot run here ({why})")
        return {"kernel": "torch", "why": why}
    fp32_prefill, prefill = prefill_gemm()
    for m in mods:
        set_kernel(m, max_rows, fp32_prefill)
    return {"kernel": "eaglenest-gemv", "isa": isa, "modules": len(mods), "max_rows": max_rows,
            "why": f"row-invariant by construction (each output one fixed sequence of {isa} instructions) "
                   "and faster than torch's bf16 matrix-vector products on a CPU",
            "prefill": prefill}


def prefill_gemm() -> tuple[bool, str]:
    """(fp32?, why) for the Linears of forwards longer than a verification (prompt prefills, which
    plain and speculative decoding share, so either choice keeps verification exact): fp32 where
    the CPU has no bf16 matrix instructions, as capture's `--dtype auto` decides (utils.auto_dtype).
    EAGLENEST_BF16_PREFILL=1 keeps torch's bf16 GEMM (the other arm of bench/eval_prefill.py)."""
    from eaglenest.utils import cpu_has_fast_bf16

    if cpu_has_fast_bf16():
        return False, "torch's bf16 GEMM (this CPU has bf16 matrix instructions)"
    if os.environ.get("EAGLENEST_BF16_PREFILL") == "1":
        return False, "torch's bf16 GEMM (EAGLENEST_BF16_PREFILL=1)"
    return True, ("the bf16 values in an fp32 GEMM, rounded to bf16: this CPU has no bf16 matrix instructions, "
                  "where torch emulates bf16 GEMMs several times slower")


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
