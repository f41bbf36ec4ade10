"""Helpers for the live SGLang tests: the skip reason, servers started the way `--sglang-serve`
starts them (eaglenest.engines.sglang.server.start_server), HF greedy references, a tiny DeepSeek-V3."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def sglang_python() -> Path | None:
    p = Path(os.environ.get("EAGLENEST_SGLANG_PYTHON") or REPO / ".venv-sglang" / "bin" / "python")
    return p if p.exists() else None


requires_sglang = pytest.mark.skipif(
    sglang_python() is None,
    reason="SGLang environment missing (.venv-sglang): run `bash scripts/setup_sglang.sh` (make test does)",
)


@contextlib.contextmanager
def served(model, workdir: Path, *, mode: str = "generate", dtype: str = "fp32", capture_dir: Path | None = None,
           layer_ids: list[int] | None = None, extra: list[str] | None = None):
    """A CPU SGLang server for the duration of the block (its log stays in `workdir`)."""
    from eaglenest.engines.sglang.server import find_sglang_python, server_command, start_server

    py = find_sglang_python()
    srv = start_server(lambda port: server_command(py, model, port=port, dtype=dtype, mode=mode, extra=extra),
                       workdir=workdir, startup_timeout=900, capture_dir=capture_dir, layer_ids=layer_ids)
    try:
        yield srv
    finally:
        srv.stop()


def chat_ids(model_dir, questions: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    from eaglenest.evaluate.run import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [chat_prompt_ids(tok, [{"role": "user", "content": q}]) for q in questions]


def hf_greedy(model_dir, prompts: list[list[int]], n: int, dtype: str = "fp32") -> list[list[int]]:
    """HF greedy continuations of each prompt, one at a time: at most n tokens, ending with the
    model's end-of-sequence token when it comes first (as SGLang's do)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            g = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
            out.append(g[0, len(ids):].tolist())
    return out


def hf_hidden_states(model_dir, ids: list[int]):
    """HF output_hidden_states (fp32) of one prompt: [N+1] tensors [T, H]; the last is post-norm."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        o = m(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in o.hidden_states]


def make_tiny_deepseek_v3(out: Path, tokenizer_dir: Path, layers: int = 8) -> Path:
    """A random DeepseekV3ForCausalLM (MLA: q/kv LoRA ranks, rope 16 + nope 32, v 32, YaRN; MoE: 8
    routed experts top-2 + 1 shared, dense first layer) with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=49152, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0, kv_lora_rank=32, q_lora_rank=64,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=8192,
        # YaRN as in DeepSeek-V3 / Kimi-K2 (SGLang's CPU MLA path supports only this rope: "Only
        # deepseek_yarn is supported for CPU for now", rotary_embedding/factory.py get_rope_cpu)
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        # fields DeepSeek-V3's own config.json carries and SGLang reads (transformers' class has no defaults for them)
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")
    DeepseekV3ForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out
