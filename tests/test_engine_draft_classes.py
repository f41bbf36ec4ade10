"""The engines' OWN draft classes, built on the CPU in their own environments, loading our exports.

SGLang 0.5.23 cannot run EAGLE-3 on its CPU path, but its draft classes can be built there:
`llama_eagle3.LlamaForCausalLMEagle3` (EAGLE 3.1 flags) and `kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM`
(MLA), resolved from our config's `architectures` through SGLang's registry.  Every parameter is
filled with NaN, our model.safetensors goes through the class's `load_weights`, and every
parameter must then hold exactly the tensor (or the fusion of tensors) of our file that the
class means -- none left at its init (the target's embed_tokens aside, which both engines share at
serving time).  vLLM 0.32's classes (`llama_eagle3`, `deepseek_eagle3`) the same way, and then
their forward on fixed inputs (attention kernel replaced by a plain causal softmax over the
module's own q/k/v): the fused aux states, the post-norm hidden for the logits and the state fed
to the next draft step must equal ours -- so a draft trained with `norm_output` is served with
post-norm feedback; a draft whose config says otherwise is caught (the control case below), and
check-draft refuses it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.export.format import save_draft
from test_draft_kinds import KINDS, YARN, tiny

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "engine_draft_load.py"


def run_engine(py: Path, engine: str, out: Path, jobs: list[tuple[Path, Path | None]], timeout: int = 900) -> list[tuple[dict, dict]]:
    args = [str(a) for d, t in jobs for a in ((d, t) if t is not None else (d,))]
    r = subprocess.run([str(py), str(SCRIPT), engine, str(REPO), str(out), *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return [(json.loads((out / f"{i}.json").read_text()), load_file(str(out / f"{i}.safetensors"))) for i in range(len(jobs))]


def expected_params(ours: dict[str, torch.Tensor], engine: str, attention: str) -> dict[str, torch.Tensor]:
    """What each of the engine's parameters must hold, from our tensors, as its loader maps them."""
    f = {k: v.float() for k, v in ours.items() if k not in ("d2t", "t2d")}
    a = "midlayer.self_attn."
    out = {}
    layer = "model.midlayer." if (engine == "sglang" and attention == "mla") else "model.layers.0."
    for k, v in f.items():
        if k.startswith("midlayer."):
            out[layer + k.removeprefix("midlayer.")] = v
        elif k.startswith("lm_head."):
            out[k] = v
        else:
            out["model." + k] = v
    pre = layer + "self_attn."
    if attention == "gqa":
        out[pre + "qkv_proj.weight"] = torch.cat([f[a + "q_proj.weight"], f[a + "k_proj.weight"], f[a + "v_proj.weight"]])
        for p in "qkv":
            del out[pre + f"{p}_proj.weight"]
    else:
        fused = "fused_qkv_a_proj_with_mqa.weight" if engine == "sglang" else "fused_qkv_a_proj.weight"
        out[pre + fused] = torch.cat([f[a + "q_a_proj.weight"], f[a + "kv_a_proj_with_mqa.weight"]])
        del out[pre + "q_a_proj.weight"], out[pre + "kv_a_proj_with_mqa.weight"]
    mlp = layer + "mlp."
    out[mlp + "gate_up_proj.weight"] = torch.cat([f["midlayer.mlp.gate_proj.weight"], f["midlayer.mlp.up_proj.weight"]])
    del out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"]
    return out


def assert_every_parameter_loaded(got: dict, ours: dict, engine: str, attention: str) -> None:
    want = expected_params(ours, engine, attention)
    params = {k: v for k, v in got.items() if not k.startswith(("post_load.", "out.")) and k != "hot_token_id"}
    unloaded = sorted(k for k, v in params.items() if torch.isnan(v).any())
    assert unloaded == ["model.embed_tokens.weight"], f"{engine}: left at init: {unloaded}"  # shared from the target when served
    assert set(params) - {"model.embed_tokens.weight", "draft_id_to_target_id"} == set(want), (
        sorted(set(params) ^ set(want)))
    for k, v in want.items():
        assert torch.equal(params[k], v), f"{engine}: {k} is not our tensor"
    d2t = ours["d2t"]
    if engine == "vllm":
        assert torch.equal(got["draft_id_to_target_id"].long(), d2t)
    else:
        assert torch.equal(got["hot_token_id"].long(), d2t + torch.arange(d2t.numel()))


def _export(d, out: Path) -> Path:
    save_draft(d.float(), out)
    return out


@pytest.mark.sglang
def test_sglang_builds_its_own_draft_classes_and_loads_every_weight(tmp_path):
    from sglang_live import sglang_python

    py = sglang_python()
    if py is None:
        pytest.skip("SGLang environment missing (.venv-sglang): run `bash scripts/setup_sglang.sh` (make test does)")
    # a draft vocabulary of 128 rows: the engines pad their lm_head to a multiple of 64, rows never read
    drafts = {"gqa": tiny(KINDS["eagle31"], Vd=128), "mla": tiny({**KINDS["mla"], "fc_norm": True, "norm_output": True}, Vd=128, rope=YARN)}
    dirs = {k: _export(d, tmp_path / k) for k, d in drafts.items()}
    (tmp_path / "out").mkdir()
    res = run_engine(py, "sglang", tmp_path / "out", [(dirs["gqa"], None), (dirs["mla"], None)])
    for (info, got), (kind, d) in zip(res, drafts.items()):
        assert info["class"] == {"gqa": "sglang.srt.models.llama_eagle3.LlamaForCausalLMEagle3",
                                 "mla": "sglang.srt.models.kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM"}[kind]
        assert info["norm_output"] is True and info["fc_norm"] is True  # read from our config.json
        assert_every_parameter_loaded(got, load_file(str(dirs[kind] / "model.safetensors")), "sglang", kind)
        if kind == "mla":  # post_load_weights split our kv_b_proj per head into its nope (k) and v parts
            c = d.cfg
            kvb = got["model.midlayer.self_attn.kv_b_proj.weight"].view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            assert torch.equal(got["post_load.w_kc"], kvb[:, : c.qk_nope_head_dim])
            assert torch.equal(got["post_load.w_vc"], kvb[:, c.qk_nope_head_dim :].transpose(1, 2))


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_draft_modules_compute_and_feed_back_what_we_trained(tmp_path, smollm2):
    """vLLM's Eagle3LlamaForCausalLM (EAGLE 3.1 draft on SmolLM2) and Eagle3DeepseekV2ForCausalLM
    (MLA + EAGLE 3.1 on the tiny DeepSeek-V3) with our weights: the same fused input, post-norm
    hidden and fed-back state as our draft on the same inputs; with norm_output flipped in the
    exported config (the field mismatch of one trainer), vLLM's fed-back state is no longer ours."""
    from family_helpers import tiny_deepseek
    from vllm_helpers import vllm_python

    from eaglenest.capture.layers import default_layer_ids
    from eaglenest.draft.model import Eagle3Config, Eagle3Draft
    from eaglenest.draft.vocab import build_vocab
    from eaglenest.export.check import judge_draft
    from eaglenest.models.target import load_config
    from eaglenest.models.weights import target_head

    py = vllm_python()
    if py is None:
        pytest.skip("vLLM environment missing (.venv-vllm): run `bash scripts/setup_vllm.sh` (CI does)")
    dsv3 = tiny_deepseek(tmp_path / "dsv3", smollm2)
    out = tmp_path / "out"
    out.mkdir()
    jobs, ours = [], []
    for i, (target, kind) in enumerate([(smollm2, {"fc_norm": True, "norm_output": True}), (smollm2, {"fc_norm": True, "norm_output": True}),
                                        (dsv3, {"attention": "mla", "fc_norm": True, "norm_output": True})]):
        tc = load_config(target)
        cfg = Eagle3Config.from_target(tc, 2048, default_layer_ids(tc.num_hidden_layers), **kind)
        emb = target_head(target)["embed"].float()
        torch.manual_seed(i)
        d = Eagle3Draft(cfg, embed_weight=emb)
        with torch.no_grad():
            for p in d.parameters():
                p.copy_(torch.randn_like(p) * (0.2 if p.ndim == 1 else 0.05) + (1.0 if p.ndim == 1 else 0.0))
        d.set_vocab(*build_vocab(torch.randint(0, 100, (cfg.vocab_size,)), 2048))
        dd = _export(d, tmp_path / f"draft{i}")
        if i == 1:  # the control: the config says pre-norm feedback, the weights were trained post-norm
            c = json.loads((dd / "config.json").read_text())
            c["norm_output"] = False
            (dd / "config.json").write_text(json.dumps(c))
            assert any("norm_output" in e for e in judge_draft(dd).errors()), "check-draft must refuse the mismatch"
        d = d.float()
        d.load_state_dict({k: v.float() for k, v in load_file(str(dd / "model.safetensors")).items()}, strict=False)  # bf16 weights
        T = 11
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
        aux = torch.randn(T, 3 * cfg.target_hidden_size, generator=g) * torch.tensor([1.0, 4.0, 20.0]).repeat_interleave(cfg.target_hidden_size)
        save_file({"input_ids": ids, "positions": torch.arange(T), "aux": aux, "embeds": emb[ids].contiguous()}, str(out / f"{i}.inputs.safetensors"))
        jobs.append((dd, target))
        ours.append((d, ids, aux))
    res = run_engine(py, "vllm", out, jobs)
    for i, ((info, got), (d, ids, aux)) in enumerate(zip(res, ours)):
        mla = d.cfg.attention == "mla"
        assert info["class"].endswith("deepseek_eagle3.Eagle3DeepseekV2ForCausalLM" if mla else "llama_eagle3.Eagle3LlamaForCausalLM")
        assert info["fc_norm"] is True and info["norm_output"] is (i != 1)
        assert_every_parameter_loaded(got, load_file(str(jobs[i][0] / "model.safetensors")), "vllm", d.cfg.attention)
        with torch.no_grad():
            fused = d.fuse(aux[None])
            T = ids.numel()
            h2, _ = d.step(ids[None], fused, torch.arange(T)[None], mask=torch.ones(T, T, dtype=torch.bool).tril()[None])
            post, fed = d.norm(h2)[0], d.feedback(h2)[0]
        tol = dict(atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(got["out.fused"], fused[0], **tol)
        torch.testing.assert_close(got["out.hidden"], post, **tol)  # what vLLM's lm_head reads
        if i == 1:  # served pre-norm, trained post-norm: a different next-step input by far
            assert (got["out.aux"] - fed).abs().max() > 100 * tol["atol"] * fed.abs().max()
            torch.testing.assert_close(got["out.aux"], h2[0], **tol)
        else:
            torch.testing.assert_close(got["out.aux"], fed, **tol)  # the state vLLM feeds to the next draft step
