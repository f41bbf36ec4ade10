"""vLLM vs in-process acceptance for one draft: the same MT-bench prompts, 3 steps, greedy, in fp32
(wiring: identical text, so acceptance must match prompt by prompt) and bf16 (what users run).
With --temperature > 0 both sample (different random streams: tau agrees in expectation only), the
draft's tokens drawn as --draft-sampling says (sample: vLLM draft_sample_method=probabilistic).

    .venv/bin/python bench/vllm_agreement.py --draft DEMO/draft --limit 10 --max-new-tokens 64 --name quick
    .venv/bin/python bench/vllm_agreement.py --draft DRAFT --temperature 1 --dtypes bf16 --limit 20 --max-new-tokens 128 --name t1

Writes bench/results/vllm_agreement_<name>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def compare(rv: dict, rh: dict) -> dict:
    pairs = list(zip(rv["per_prompt"], rh["per_prompt"]))
    same = [(v, h) for v, h in pairs if v["output_ids"] == h["output_ids"]]
    return {
        "tau_vllm": rv["tau"],
        "tau_ours": rh["tau"],
        "relative_gap": abs(rv["tau"] - rh["tau"]) / rh["tau"],
        "accept_per_position_vllm": rv["accept_per_position"],
        "accept_per_position_ours": rh["accept_per_position"],
        "identical_outputs": len(same),
        "prompts": len(pairs),
        "identical_outputs_same_acceptance": sum(v["accepted_per_position"] == h["accepted_per_position"]
                                                 and v["verify_steps"] == h["verify_steps"] for v, h in same),
        "per_prompt": [{"id": v["id"], "same_output": v["output_ids"] == h["output_ids"],
                        "vllm": [v["verify_steps"], v["accepted_per_position"]],
                        "ours": [h["verify_steps"], h["accepted_per_position"]]} for v, h in pairs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--draft", required=True)
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--name", default="draft")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--draft-sampling", default="sample", choices=["sample", "argmax"])
    args = p.parse_args()
    import tempfile

    from eaglenest.evaluate.run import evaluate

    tmp = Path(tempfile.mkdtemp(prefix="vllm-agreement-"))

    result = {"kind": "vllm_agreement", "draft": args.draft, "bench": "mtbench", "limit": args.limit,
              "max_new_tokens": args.max_new_tokens, "steps": 3, "topk": 1, "temperature": args.temperature,
              "draft_sampling": args.draft_sampling if args.temperature > 0 else None}
    for dtype in args.dtypes.split(","):
        reports = {}
        for eng in ("vllm", "hf"):
            a = argparse.Namespace(model=args.model, draft=args.draft, out=str(tmp / f"{eng}-{dtype}.json"), bench="mtbench", limit=args.limit, turns=1,
                                   steps=3, topk=1, num_draft_tokens=None, temperature=args.temperature,
                                   draft_sampling=args.draft_sampling, max_new_tokens=args.max_new_tokens,
                                   engine=eng, device="cpu", dtype=dtype, seed=0, no_baseline=True, trust_remote_code=False,
                                   engine_args={}, baseline_limit=None)
            reports[eng] = evaluate(a)
            if eng == "vllm":
                result["vllm_version"] = reports[eng].get("vllm_version")
                result["vllm_speculative_config"] = reports[eng].get("vllm_speculative_config")
                result["vllm_fixes"] = reports[eng].get("vllm_fixes")
        result[dtype] = compare(reports["vllm"], reports["hf"])
        r = result[dtype]
        print(f"{dtype}: vLLM tau {r['tau_vllm']:.3f}, ours {r['tau_ours']:.3f} ({100 * r['relative_gap']:.1f} %); "
              f"identical outputs {r['identical_outputs']}/{r['prompts']}, of which same acceptance "
              f"{r['identical_outputs_same_acceptance']}", flush=True)
    print(common.write_result(f"vllm_agreement_{args.name}", result))


if __name__ == "__main__":
    main()
