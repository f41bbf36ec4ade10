"""Run in an engine's own environment (.venv-sglang or .venv-vllm), not eaglenest's:

    PY tests/engine_draft_load.py sglang REPO OUT DRAFT_DIR [DRAFT_DIR ...]
    PY tests/engine_draft_load.py vllm REPO OUT DRAFT_DIR TARGET_DIR [DRAFT_DIR TARGET_DIR ...]

Builds the engine's OWN draft class for each exported draft on the CPU (SGLang 0.5.23:
`llama_eagle3.LlamaForCausalLMEagle3` / `kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM`, resolved
through SGLang's model registry from the config's `architectures`; vLLM 0.32: the class its
registry resolves for the speculative config `{"method": "eagle3", "model": DRAFT}` on TARGET),
fills every parameter with NaN, loads the draft's model.safetensors through the class's own
`load_weights`, and writes OUT/<i>.safetensors (every parameter as loaded) + OUT/<i>.json (class
name, the flags the module read from the config).

vLLM only: it also runs the module's forward on fixed inputs (OUT/<i>.inputs.safetensors, written
by the test) with the attention kernel replaced by a plain causal softmax over the same q/k/v the
module computes (vLLM's attention needs its engine's forward context): the projections, norms,
rope, fc_norm, MLP, final norm and the fed-back state (`aux`) are vLLM's own code.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def load_through_the_class(m, draft: str) -> dict:
    """NaN in every parameter, then the class's own load_weights on our file: what stays NaN was not loaded."""
    import torch
    from safetensors.torch import load_file

    with torch.no_grad():
        for p in m.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))
    m.load_weights(iter(load_file(os.path.join(draft, "model.safetensors")).items()))
    return {n: p.detach().float().contiguous() for n, p in m.named_parameters()}


def sglang(repo: str, out: str, jobs: list[tuple[str, str | None]]) -> None:
    sys.path[:0] = [repo, os.path.join(repo, "eaglenest", "engines", "sglang", "compat")]  # an importable sgl_kernel
    from eaglenest.engines.sglang.launcher import prepare_process

    prepare_process()  # what every SGLang process of eaglenest does before `import sglang`
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import get_context, get_parallel

    get_context().override_server_args(model_path=jobs[0][0], device="cpu").install()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                                 backend="gloo")
    initialize_model_parallel(backend="gloo")
    for k in ("tp_rank", "pp_rank", "attn_tp_rank", "attn_dp_rank", "attn_cp_rank", "moe_ep_rank", "moe_tp_rank", "moe_dp_rank"):
        try:
            get_parallel().override_permanently(**{k: 0})
        except Exception:  # a name this version does not have: nothing reads it
            pass
    for i, (draft, _) in enumerate(jobs):
        cfg = AutoConfig.from_pretrained(draft)
        cls, arch = ModelRegistry.resolve_model_cls(cfg.architectures)
        m = cls(cfg)
        state = load_through_the_class(m, draft)
        attn = getattr(getattr(m.model, "midlayer", None), "self_attn", None)
        if attn is not None and hasattr(attn, "w_kc"):  # MLA: kv_b_proj split for the absorbed attention
            state["post_load.w_kc"] = attn.w_kc.detach().float().contiguous()
            state["post_load.w_vc"] = attn.w_vc.detach().float().contiguous()
        if m.hot_token_id is not None:
            state["hot_token_id"] = m.hot_token_id.contiguous()
        save_file(state, os.path.join(out, f"{i}.safetensors"))
        json.dump({"class": f"{cls.__module__}.{cls.__name__}", "arch": arch, "norm_output": bool(m.model.norm_output),
                   "fc_norm": m.model.fc_norm is not None}, open(os.path.join(out, f"{i}.json"), "w"))


def vllm(repo: str, out: str, jobs: list[tuple[str, str | None]]) -> None:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file

    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry

    torch.manual_seed(0)
    started = False
    for i, (draft, target) in enumerate(jobs):
        vc = EngineArgs(model=target, speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 3},
                        dtype="float32", enforce_eager=True, max_model_len=512, seed=0).create_engine_config()
        dmc = vc.speculative_config.draft_model_config
        with set_current_vllm_config(vc):
            if not started:
                init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                                             local_rank=0, backend="gloo")
                initialize_model_parallel(1, 1)
                started = True
            cls, arch = ModelRegistry.resolve_model_cls(dmc.hf_config.architectures, dmc)
            m = cls(vllm_config=vc).float()
            state = load_through_the_class(m, draft)
            info = {"class": f"{cls.__module__}.{cls.__name__}", "arch": arch, "norm_output": bool(m.model.norm_output),
                    "fc_norm": m.model.fc_norm is not None, "draft_hf_config": type(dmc.hf_config).__name__}
            inp = os.path.join(out, f"{i}.inputs.safetensors")
            if os.path.exists(inp):
                x = load_file(inp)
                stub_attention(m.model.layers[0].self_attn, F)
                # what vLLM's loader does next (the CPU linears get their gemm here)
                from vllm.model_executor.model_loader.utils import process_weights_after_loading

                process_weights_after_loading(m, dmc, torch.device("cpu"))
                with torch.no_grad():
                    h = m.combine_hidden_states(x["aux"])
                    hidden, aux = m.model(x["input_ids"], x["positions"], h, x["embeds"])
                state.update({"out.fused": h.clone(), "out.hidden": hidden.clone(), "out.aux": aux.clone()})  # aux may be hidden itself
        save_file(state, os.path.join(out, f"{i}.safetensors"))
        json.dump(info, open(os.path.join(out, f"{i}.json"), "w"))


def stub_attention(self_attn, F) -> None:
    """Replace the kernel call (not the module's own q/k/v computation) by a causal softmax."""
    import torch

    if hasattr(self_attn, "mla_attn"):  # DeepseekV2MLAAttention -> MultiHeadLatentAttentionWrapper -> MLAAttention
        w, scale = self_attn.mla_attn, self_attn.scaling  # the scale the module hands its kernel (YaRN mscale included)

        def mla(q, kv_c_normed, k_pe, output_shape=None, **_):
            T = q.shape[0]
            kv = w.kv_b_proj(kv_c_normed)[0].view(T, w.num_heads, w.qk_nope_head_dim + w.v_head_dim)
            k_nope, v = kv.split([w.qk_nope_head_dim, w.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(T, w.num_heads, w.qk_rope_head_dim)], dim=-1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale)
            return o.transpose(0, 1).reshape(T, w.num_heads * w.v_head_dim)

        w._modules.pop("mla_attn")  # a plain function in place of the registered kernel module
        w.mla_attn = mla
        return
    nh, nkv, hd, scale = self_attn.num_heads, self_attn.num_kv_heads, self_attn.head_dim, self_attn.scaling

    def gqa(q, k, v, *args, **kw):
        T = q.shape[0]
        o = F.scaled_dot_product_attention(q.view(T, nh, hd).transpose(0, 1), k.view(T, nkv, hd).transpose(0, 1),
                                           v.view(T, nkv, hd).transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True)
        return o.transpose(0, 1).reshape(T, nh * hd)

    self_attn._modules.pop("attn")
    self_attn.attn = gqa


if __name__ == "__main__":
    engine, repo, out, *rest = sys.argv[1:]
    if engine == "sglang":
        sglang(repo, out, [(d, None) for d in rest])
    else:
        vllm(repo, out, [(rest[i], rest[i + 1]) for i in range(0, len(rest), 2)])
