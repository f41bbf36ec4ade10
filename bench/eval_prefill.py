"""The demo's eval stage on a CPU without bf16 matrix instructions, its prompt prefills in torch's
bf16 GEMM (emulated there; EAGLENEST_BF16_PREFILL=1) vs an fp32 GEMM of the same bf16 values
(eaglenest's default there: evaluate/exact.prefill_gemm), alternating, on the same draft.

    python bench/eval_prefill.py --draft DEMO_OUT/draft [--limit 16] [--rounds 2]

Each arm is the demo's own `eaglenest eval` command (bench/eval_gemv.py's run_arm: MT-bench first
turns, 3 steps, topk 1, greedy, 128 new tokens, 2 worker processes, plain decoding of every
prompt too), with the linears of decoding and verification in the gemv kernel either way: only
forwards longer than a verification change.  Plain and speculative decoding share the prefill,
so greedy == plain must hold in both arms; the texts of the two arms may differ where the two
GEMMs round a prompt's states differently.  Result: bench/results/eval_prefill_cpu_<isa>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ARMS = {"bf16": {"EAGLENEST_BF16_PREFILL": "1"}, "fp32": {}}


def main() -> int:
    from common import write_result
    from eval_gemv import alternate, parse_args

    from eaglenest.native.gemv import isa
    from eaglenest.utils import cpu_has_fast_bf16

    a = parse_args(__doc__, 16)
    if cpu_has_fast_bf16():
        print("this CPU has bf16 matrix instructions: prefills run torch's bf16 GEMM either way, nothing to compare", file=sys.stderr)
        return 2
    names = list(ARMS)
    rounds, outputs = alternate(a.draft, a.limit, a.rounds, {arm: ("kernel", env) for arm, env in ARMS.items()})
    ok = [r for r in rounds if all("error" not in r[x] for x in names)]
    ratio = lambda k: [round(r["fp32"][k] / r["bf16"][k], 3) for r in ok]  # noqa: E731
    result = {
        "what": "the demo's eval stage (eaglenest.demo.eval_argv, --linears kernel), prompt prefills in torch's bf16 GEMM "
                "(EAGLENEST_BF16_PREFILL=1) vs an fp32 GEMM, alternating",
        "draft": a.draft, "prompts": a.limit, "rounds": rounds, "isa": isa(),
        "prefill": {r: next((x[r]["linears"].get("prefill") for x in ok), None) for r in names},
        # per round, fp32 arm over bf16 arm (< 1 = faster for seconds, > 1 = faster for tokens/s)
        "fp32_over_bf16_eval_s": ratio("eval_elapsed_s"),
        "fp32_over_bf16_spec_tokens_per_s": ratio("spec_tokens_per_s_per_process"),
        "fp32_over_bf16_baseline_tokens_per_s": ratio("baseline_tokens_per_s_per_process"),
        "texts_identical": sum(x == y for x, y in zip(outputs.get("bf16", []), outputs.get("fp32", []))),
        "texts_compared": min((len(o) for o in outputs.values()), default=0),
    }
    write_result(f"eval_prefill_cpu_{result['isa']}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
