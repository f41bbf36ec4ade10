"""What exact verification costs on this CPU: speculative decoding with and without row-wise linears.

    python bench/verification_cpu.py --draft DEMO_OUT/draft [--limit 12] [--max-new-tokens 96] [--threads 1]

One SmolLM2 (bf16) target, one draft, MT-bench first turns, 3 steps, topk 1, greedy.  On the same
model object, prompt by prompt in rotating order (so load changes hit every setting alike):

  probe        what `eaglenest eval` does on a CPU: row-wise attention + the Linear shapes the
               set-up probe found batch-dependent here run row by row (evaluate/verification.py)
  attention    row-wise attention only, every Linear batched (the exact path before the probe)
  all_linears  row-wise attention + every Linear row by row (the probe's fallback)
  model        the model's own attention (SDPA) and batched linears (`--attention model`)
  pad          an alternative, not in the product: row-wise attention, and the probe's shapes
               always computed as 4-row calls (1..3 rows zero-padded), so plain decoding and
               verification share the 4-row kernel instead of verification using the 1-row one
  plain        plain decoding (the reference for greedy equality and for the speedup)

Also timed, paired in the same loop: one 4-row verification forward per setting and one
one-token decode step.  Result: bench/results/verification_cpu.json (the machine was shared
with other jobs: the load average is recorded before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SETTINGS = ("probe", "attention", "all_linears", "model", "pad")
ROWS = 4  # 3 steps, topk 1


def _padded(module, x):
    """The `pad` setting's Linear: calls of 1..ROWS rows as one ROWS-row call."""
    import torch
    import torch.nn.functional as F

    rows = x.numel() // x.shape[-1]
    if rows > ROWS:
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    flat = torch.cat([flat, flat.new_zeros(ROWS - rows, flat.shape[-1])])
    return F.linear(flat[None], module.weight, module.bias)[0, :rows].reshape(*x.shape[:-1], -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="an exported draft for SmolLM2 (e.g. a demo's DIR/draft)")
    ap.add_argument("--limit", type=int, default=12, help="MT-bench first turns")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the demo's eval workers use 1 each)")
    ap.add_argument("--forward-reps", type=int, default=60, help="paired repetitions of the single-forward timing")
    a = ap.parse_args()

    import functools

    import torch

    from common import rotations, write_result
    from eaglenest.evaluate.mtbench import load_bench
    from eaglenest.evaluate.rowwise.attention import NAME
    from eaglenest.evaluate.rowwise.linears import set_rowwise
    from eaglenest.evaluate.run import chat_prompt_ids, load_draft_for_target
    from eaglenest.evaluate.specdec import PlainDecoder, SpecDecoder, _new_cache
    from eaglenest.evaluate.verification import linear_groups, prepare
    from eaglenest.models.target import eos_token_ids, load_target, load_tokenizer, resolve_model_path

    torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    tok = load_tokenizer("smollm2")
    target = load_target("smollm2", "bf16", "cpu")
    verification = prepare(target, rows=ROWS, topk=1, attention="rowwise")
    modules = dict(target.named_modules())
    groups = linear_groups(target)
    flagged = {tuple(r["shape"]) for r in verification["rowwise"]["linears"]}

    def use(setting: str) -> None:
        target.set_attn_implementation("sdpa" if setting == "model" else NAME)
        for (shape, *_), names in groups.items():
            on = setting == "all_linears" or (setting == "probe" and shape in flagged)
            for n in names:
                set_rowwise(modules[n], ROWS if on else None)
                if setting == "pad" and shape in flagged:
                    modules[n].forward = functools.partial(_padded, modules[n])

    draft = load_draft_for_target(a.draft, target, "cpu", torch.bfloat16)
    eos = set(eos_token_ids(resolve_model_path("smollm2"), tok))
    spec = SpecDecoder(target, draft, eos, steps=3, topk=1)
    plain = PlainDecoder(target, eos)
    _, prompts = load_bench("mtbench")
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": p.turns[0]}]) for p in prompts[: a.limit]]

    # warm-up of every setting (first calls pay one-time kernel set-up)
    for s in SETTINGS:
        use(s)
        spec.generate(prompts[0][:32], 8)
    use("probe")
    plain.generate(prompts[0][:32], 8)

    # decoding, prompt by prompt, settings in rotating order
    runs = {s: {"tokens": 0, "wall_s": 0.0, "verify_steps": 0, "verified_tokens": 0, "same_as_plain": 0} for s in SETTINGS}
    runs["plain"] = {"tokens": 0, "wall_s": 0.0}
    runs["pad_plain"] = {"tokens": 0, "wall_s": 0.0}  # plain decoding with the pad setting's kernel
    for i, (ids, order) in enumerate(zip(prompts, rotations([*SETTINGS, "plain"], len(prompts)))):
        outs = {}
        for s in order:
            use("probe" if s == "plain" else s)  # plain decoding is one row per forward: untouched by the setting
            r = (plain if s == "plain" else spec).generate(ids, a.max_new_tokens)
            if s == "pad":  # its own reference: plain decoding with the padded kernel
                b = plain.generate(ids, a.max_new_tokens)
                outs["pad_plain"] = b.output_ids
                runs["pad_plain"]["tokens"] += len(b.output_ids)
                runs["pad_plain"]["wall_s"] += b.wall_s
            runs[s]["tokens"] += len(r.output_ids)
            runs[s]["wall_s"] += r.wall_s
            if s != "plain":
                runs[s]["verify_steps"] += r.verify_steps
                runs[s]["verified_tokens"] += r.verified_tokens
            outs[s] = r.output_ids
        for s in SETTINGS:
            runs[s]["same_as_plain"] += outs[s] == outs["pad_plain" if s == "pad" else "plain"]
        print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{s} {r['tokens'] / r['wall_s']:.1f}" for s, r in runs.items())
              + " tok/s so far", flush=True)
    for r in runs.values():
        r["tokens_per_s"] = round(r["tokens"] / r["wall_s"], 2)
        r["wall_s"] = round(r["wall_s"], 2)
    for s in SETTINGS:
        r = runs[s]
        r["tau"] = round(r["verified_tokens"] / r["verify_steps"], 4)
        r["speedup_vs_plain"] = round(r["tokens_per_s"] / runs["plain"]["tokens_per_s"], 3)
        r["vs_probe"] = round(r["tokens_per_s"] / runs["probe"]["tokens_per_s"], 3)

    # one forward, paired: a 4-row verification per setting and a one-token decode step
    ctx = prompts[0]
    times: dict[str, list[float]] = {s: [] for s in (*SETTINGS, "decode_1_row", "pad_decode_1_row")}
    with torch.inference_mode():
        for _ in range(a.forward_reps):
            for s in times:
                use({"decode_1_row": "probe", "pad_decode_1_row": "pad"}.get(s, s))
                cache = _new_cache(target)
                target(input_ids=torch.tensor([ctx[:-1]]), past_key_values=cache, use_cache=True)
                x = torch.tensor([ctx[-1:] + ([] if s.endswith("decode_1_row") else [100, 200, 300])])
                t = time.perf_counter()
                target(input_ids=x, past_key_values=cache, use_cache=True)
                times[s].append(time.perf_counter() - t)
    forward_ms = {s: round(statistics.median(v) * 1000, 2) for s, v in times.items()}
    print("median forward ms:", forward_ms)

    result = {
        "kind": "verification_cpu", "target": "smollm2 (bf16)", "draft": a.draft, "bench": "mtbench first turns",
        "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "steps": 3, "topk": 1, "temperature": 0.0,
        "texts_compared": len(prompts),  # per setting: its output vs plain decoding's, prompt by prompt (same_as_plain)
        "threads": a.threads, "settings": SETTINGS_DOC,
        "decoding": runs,
        "forward_ms_median": {"context_tokens": len(ctx) - 1, "reps": a.forward_reps, **forward_ms},
        "probe_cost_s": verification["probe_result"]["seconds"],
        "verification": verification,
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "note": "machine shared with other jobs (load average above); settings interleaved prompt by prompt, "
                "so the ratios are the result, not the absolute speeds",
    }
    write_result("verification_cpu", result)
    return 0


SETTINGS_DOC = {
    "probe": "row-wise attention + the Linear shapes the probe found batch-dependent, row by row (eval's CPU default)",
    "attention": "row-wise attention, all Linears batched (the previous exact path)",
    "all_linears": "row-wise attention + every Linear row by row (the probe's fallback)",
    "model": "SDPA + batched Linears (--attention model; exactness not promised)",
    "pad": "experiment, not in the product: row-wise attention + the probe's shapes as 4-row calls in decoding and "
           "verification alike (same_as_plain compares with plain decoding under the same padding)",
    "plain": "plain decoding",
    "pad_plain": "plain decoding with the pad setting's kernel",
}


if __name__ == "__main__":
    sys.exit(main())
