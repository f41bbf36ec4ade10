"""The draft kinds as one model: EAGLE 3.1's `fc_norm` / `norm_output` and the MLA attention.

* The TTT loss and gradients of every kind equal a slow reference written out by hand (the aux
  norms, MLA's latent attention per head with its interleaved rope, the fed-back state norm(h)).
* The training kernels take values narrower than queries/keys (MLA): chunked, sdpa and flex == eager.
* MLA's decoding path over its latent cache equals its training path.
* The export writes exactly what each engine's loader reads (names, shapes, config keys) and
  check-draft refuses flags and weights that disagree, or a served flag that is not the trained one.
* Old run configs and exports (no kind fields) still load as EAGLE-3 GQA drafts.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from eaglenest import EaglenestError
from eaglenest.draft import kernels
from eaglenest.draft.config import DraftConfig
from eaglenest.draft.model import Eagle3Config, Eagle3Draft
from eaglenest.draft.vocab import build_vocab
from eaglenest.train.ttt import TeacherRows, denominators, ttt_forward

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KINDS = {
    "eagle31": dict(fc_norm=True, norm_output=True),
    "mla": dict(attention="mla", q_lora_rank=12, kv_lora_rank=20, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10),
    "mla-noq-31": dict(attention="mla", q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=4,
                       fc_norm=True, norm_output=True),
}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def tiny(kind: dict, seed=0, V=300, Vd=120, H=32, rope=None, dtype=torch.float64) -> Eagle3Draft:
    cfg = Eagle3Config(hidden_size=H, intermediate_size=2 * H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=V, draft_vocab_size=Vd, target_hidden_size=H, aux_layer_ids=[2, 4, 5], target_num_layers=8,
                      max_position_embeddings=64, rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
                      target_architecture="LlamaForCausalLM", **kind)
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg, embed_weight=torch.randn(V, H))
    for p in d.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.2)  # norms near 1, but not 1
    d.set_vocab(*build_vocab(torch.randint(0, 50, (V,)), Vd))
    return d.to(dtype)


def make_batch(d, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    c = d.cfg
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, L in enumerate(lengths):
        ids[b, :L] = torch.randint(0, c.vocab_size, (L,), generator=g)
        mask[b, L // 3 : L] = 1
    aux = torch.randn(B, T, 3 * c.target_hidden_size, generator=g, dtype=torch.float64) * torch.tensor([1.0, 5.0, 30.0]).repeat_interleave(c.target_hidden_size)
    tlogp = torch.log_softmax(torch.randn(B, T, c.draft_vocab_size, generator=g, dtype=torch.float64) * 2, -1)
    targ = torch.randint(0, c.vocab_size, (B, T), generator=g)
    return ids, mask, aux, tlogp, targ


# --- the slow reference -------------------------------------------------------------------------
def rms(x, w, eps):
    return w * x / x.pow(2).mean(-1, keepdim=True).add(eps).sqrt()


def rope_pairs(x, pos, inv_freq, interleaved):
    """x [T, d] rotated at positions pos: pairs (2i, 2i+1) (interleaved) or (i, i + d/2)."""
    ang = pos[:, None].double() * inv_freq[None].double()  # [T, d/2]
    c, s = ang.cos(), ang.sin()
    if interleaved:
        a, b = x[:, 0::2], x[:, 1::2]
        return torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)
    a, b = x[:, : x.shape[1] // 2], x[:, x.shape[1] // 2 :]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def reference_loss(d: Eagle3Draft, ids, aux, tlogp, targ, mask, ttt, denom):
    """One sample; every norm, head, key and fed-back state written out by hand."""
    c = d.cfg
    T, Ht = ids.shape[0], c.target_hidden_size
    mid, at = d.midlayer, d.midlayer.self_attn
    if c.fc_norm:  # EAGLE 3.1: each aux state normed by its own RMSNorm before fc
        aux = torch.cat([rms(aux[:, i * Ht : (i + 1) * Ht], d.fc_norm[i].weight, c.rms_norm_eps) for i in range(3)], -1)
    hidden = aux @ d.fc.weight.T
    inv = d.rotary.inv_freq
    steps = []  # per step: (K [heads, T, dk], V [heads, T, dv]) per query head
    total = 0.0
    for j in range(ttt):
        tok = torch.tensor([ids[t + 1 + j] if t + 1 + j < T else 0 for t in range(T)])
        pos = torch.tensor([t + j for t in range(T)])
        x = torch.cat([rms(d.embed_tokens[tok].double(), mid.input_layernorm.weight, c.rms_norm_eps),
                       rms(hidden, mid.hidden_norm.weight, c.rms_norm_eps)], -1)
        n = c.num_attention_heads
        if c.attention == "mla":
            nope, rp, vd = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
            q = (rms(x @ at.q_a_proj.weight.T, at.q_a_layernorm.weight, c.rms_norm_eps) @ at.q_b_proj.weight.T
                 if c.q_lora_rank else x @ at.q_proj.weight.T).view(T, n, nope + rp)
            ckv = x @ at.kv_a_proj_with_mqa.weight.T
            lat, kr = rms(ckv[:, : c.kv_lora_rank], at.kv_a_layernorm.weight, c.rms_norm_eps), rope_pairs(ckv[:, c.kv_lora_rank :], pos, inv, True)
            kv = (lat @ at.kv_b_proj.weight.T).view(T, n, nope + vd)
            Q = [torch.cat([q[:, h, :nope], rope_pairs(q[:, h, nope:], pos, inv, True)], -1) for h in range(n)]
            K = [torch.cat([kv[:, h, :nope], kr], -1) for h in range(n)]
            Vv = [kv[:, h, nope:] for h in range(n)]
            scale = 1 / math.sqrt(nope + rp)
            if c.rope_parameters.get("rope_type") == "yarn":
                scale *= (0.1 * c.rope_parameters["mscale_all_dim"] * math.log(c.rope_parameters["factor"]) + 1) ** 2
        else:
            hd, g = c.head_dim, n // c.num_key_value_heads
            q, k, v = (x @ at.q_proj.weight.T).view(T, n, hd), (x @ at.k_proj.weight.T).view(T, -1, hd), (x @ at.v_proj.weight.T).view(T, -1, hd)
            Q = [rope_pairs(q[:, h], pos, inv, False) for h in range(n)]
            K = [rope_pairs(k[:, h // g], pos, inv, False) for h in range(n)]
            Vv = [v[:, h // g] for h in range(n)]
            scale = 1 / math.sqrt(hd)
        steps.append((K, Vv))
        outs = []
        for t in range(T):
            heads = []
            for h in range(n):
                keys = [steps[0][0][h][s] for s in range(t + 1)] + [steps[i][0][h][t] for i in range(1, j + 1)]
                vals = [steps[0][1][h][s] for s in range(t + 1)] + [steps[i][1][h][t] for i in range(1, j + 1)]
                p = torch.softmax(torch.stack([Q[h][t] @ kk for kk in keys]) * scale, 0)
                heads.append(sum(pi * vi for pi, vi in zip(p, vals)))
            outs.append(torch.cat(heads))
        h1 = hidden + torch.stack(outs) @ at.o_proj.weight.T
        m = mid.mlp
        z = rms(h1, mid.post_attention_layernorm.weight, c.rms_norm_eps)
        h2 = h1 + (torch.nn.functional.silu(z @ m.gate_proj.weight.T) * (z @ m.up_proj.weight.T)) @ m.down_proj.weight.T
        post = rms(h2, d.norm.weight, c.rms_norm_eps)
        logp = torch.log_softmax(post @ d.lm_head.weight.T, -1)
        lsum = 0.0
        for t in range(T):
            if t + 2 + j >= T:
                continue
            w = float(mask[t + 2 + j]) * float(d.t2d[targ[t + 1 + j]])
            lsum = lsum + w * -(tlogp[t + 1 + j].exp() * logp[t]).sum()
        total = total + 0.8**j * lsum / max(float(denom[j]), 1.0)
        hidden = post if c.norm_output else h2  # what the next step reads
    return total


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rope", [None, YARN])
def test_ttt_equals_the_slow_reference_for_each_kind(kind, rope):
    d = tiny(KINDS[kind], rope=rope)
    lengths, ttt = [9, 6], 3
    ids, mask, aux, tlogp, targ = make_batch(d, lengths)
    denom = denominators(mask, ttt)
    fast, _ = ttt_forward(d, ids, aux, TeacherRows.from_probs(tlogp.exp(), targ), mask, ttt, denom, chunk=4)
    params = list(d.parameters())
    g_fast = torch.autograd.grad(fast, params)
    ref = sum(reference_loss(d, ids[b, :L], aux[b, :L], tlogp[b, :L], targ[b, :L], mask[b, :L], ttt, denom) for b, L in enumerate(lengths))
    g_ref = torch.autograd.grad(ref, params)
    assert torch.allclose(fast, ref, rtol=1e-9, atol=1e-10), (fast, ref)
    for (name, _), a, b in zip(d.named_parameters(), g_fast, g_ref):
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-10), name
    assert all(g.abs().sum() > 0 for g in g_fast), "every parameter (fc_norm, MLA's) takes part"


def test_norm_output_changes_what_the_next_step_reads():
    """The same weights with and without norm_output: step 0 is identical, later steps are not
    (the fed-back state is the only difference), and feedback() is norm(h) exactly."""
    a, b = tiny(KINDS["eagle31"]), tiny({"fc_norm": True})
    ids, mask, aux, tlogp, targ = make_batch(a, [12])
    _, sa = ttt_forward(a, ids, aux, TeacherRows.from_probs(tlogp.exp(), targ), mask, 3, denominators(mask, 3))
    _, sb = ttt_forward(b, ids, aux, TeacherRows.from_probs(tlogp.exp(), targ), mask, 3, denominators(mask, 3))
    assert sa["loss_sum"][0] == pytest.approx(sb["loss_sum"][0], rel=1e-12)
    assert sa["loss_sum"][1] != pytest.approx(sb["loss_sum"][1], rel=1e-6)
    h = torch.randn(2, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(a.feedback(h), a.norm(h))
    assert b.feedback(h) is h


@pytest.mark.parametrize("kind", ["mla", "mla-noq-31"])
def test_kernels_take_values_of_another_width(kind):
    """MLA's values (v_head_dim) are not its keys' width (nope + rope): the chunked and sdpa kernels'
    loss and gradients and flex's forward equal the eager reference."""
    d = tiny(KINDS[kind], rope=YARN)
    b = make_batch(d, [21, 13])
    ids, mask, aux, tlogp, targ = b

    def run(impl):
        loss, _ = ttt_forward(d, ids, aux, TeacherRows.from_probs(tlogp.exp(), targ), mask, 3, denominators(mask, 3), attn_impl=impl)
        return loss, torch.autograd.grad(loss, list(d.parameters()))

    le, ge = run("eager")
    for kern in (kernels.ChunkedCausal(chunk_elems=64), kernels.SdpaCausal()):
        lc, gc = run(kern)
        assert torch.allclose(le, lc, rtol=1e-10), kern.name
        for x, y in zip(ge, gc):
            assert torch.allclose(x, y, rtol=1e-7, atol=1e-11), kern.name
    with torch.no_grad():  # flex has no CPU backward; its forward runs eager here
        lf, _ = ttt_forward(d, ids, aux, TeacherRows.from_probs(tlogp.exp(), targ), mask, 3, denominators(mask, 3), attn_impl=kernels.FlexCausal(compile=False))
    assert torch.allclose(le.detach(), lf, rtol=1e-10)


def test_mla_decoding_over_its_latent_cache_equals_training():
    d = tiny(KINDS["mla"], rope=YARN)
    c = d.cfg
    ids, _, aux, _, _ = make_batch(d, [14, 14])
    h, pos = d.fuse(aux), torch.arange(14).expand(2, 14)
    ref, _ = d.ttt_step(ids, h, pos)
    causal = torch.ones(14, 14, dtype=torch.bool).tril()[None]
    full, cache = d.step(ids, h, pos, mask=causal)
    assert [tuple(t.shape) for t in cache] == [(2, 1, 14, c.kv_lora_rank + c.qk_rope_head_dim)]  # one latent per position
    torch.testing.assert_close(full, ref)
    tail, _ = d.step(ids[:, 9:], h[:, 9:], pos[:, 9:], past_kv=(cache[0][:, :, :9],), mask=causal[:, 9:])
    torch.testing.assert_close(tail, ref[:, 9:])
    assert c.kv_bytes_per_token(2) == (20 + 4) * 2
    assert tiny({}).cfg.kv_bytes_per_token(2) == 2 * 2 * 8 * 2  # K and V of 2 KV heads x 8


def test_fc_norm_normalizes_each_aux_state_on_its_own():
    d = tiny(KINDS["eagle31"])
    aux = torch.randn(3, 96, dtype=torch.float64) * torch.tensor([1.0, 100.0, 1e4]).repeat_interleave(32)
    want = torch.cat([rms(aux[:, i * 32 : (i + 1) * 32], d.fc_norm[i].weight, d.cfg.rms_norm_eps) for i in range(3)], -1) @ d.fc.weight.T
    torch.testing.assert_close(d.fuse(aux), want)
    assert {k for k in d.exported_state_dict() if k.startswith("fc_norm")} == {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}


def test_old_configs_without_the_kind_fields_load_as_eagle3():
    d = tiny({}).cfg.to_dict()
    old = {k: v for k, v in d.items() if k not in ("fc_norm", "norm_output", "attention", "q_lora_rank", "kv_lora_rank",
                                                   "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    old.pop("kind")
    c = DraftConfig.from_dict(old)  # the base reads the kind (none: EAGLE-3) and returns its class
    assert type(c) is Eagle3Config and c.kind == "eagle3"
    assert (c.fc_norm, c.norm_output, c.attention, c.kv_lora_rank) == (False, False, "gqa", None)
    assert set(Eagle3Draft(c).state_dict()) == set(Eagle3Draft(DraftConfig.from_dict(d)).state_dict())


def test_each_kind_config_holds_only_its_own_fields_and_reads_back_as_its_class():
    from dataclasses import fields

    from eaglenest.draft.dflash import DFlashConfig

    base = {f.name for f in fields(DraftConfig)}
    eagle3 = {f.name for f in fields(Eagle3Config)} - base
    dflash = {f.name for f in fields(DFlashConfig)} - base
    assert "fc_norm" in eagle3 and "attention" in eagle3 and "block_size" in dflash and not eagle3 & dflash
    e = tiny({}).cfg
    d = DFlashConfig(**{k: getattr(e, k) for k in base if k != "kind"}, block_size=4, mask_token_id=7)
    for c in (e, d):
        assert DraftConfig.from_dict(c.to_dict()) == c and type(DraftConfig.from_dict(c.to_dict())) is type(c)
    # a config written while DraftConfig was the union of the kinds' fields reads back without the other kind's keys
    union = {**e.to_dict(), "block_size": 0, "mask_token_id": None}
    assert DraftConfig.from_dict(union) == e
    assert DraftConfig.from_dict({**d.to_dict(), "fc_norm": False, "attention": "gqa", "q_lora_rank": None}) == d
    with pytest.raises(EaglenestError, match="gqa"):  # DFlash has no MLA option
        DFlashConfig.attention_fields(type("S", (), {"attention": "mla"})())


# --- export and check-draft ---------------------------------------------------------------------
def _export(tmp_path, d, name="draft"):
    from eaglenest.export.format import save_draft

    return save_draft(d.float(), tmp_path / name)


def _tinytarget_cfg(d):
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "intermediate_size": 64,
            "max_position_embeddings": 64, "rope_theta": 10000.0}


def test_mla_export_is_what_both_engines_load(tmp_path):
    """Names and shapes as vLLM 0.32's deepseek_eagle3.py and SGLang 0.5.23's kimi_k25_eagle3.py
    load them (unfused q_a_proj / kv_a_proj_with_mqa, whole kv_b_proj), config keys they read."""
    from safetensors import safe_open

    from eaglenest.export.check import judge_draft
    from eaglenest.export.format import load_draft

    d = tiny({**KINDS["mla"], "fc_norm": True, "norm_output": True}, rope=YARN)
    out = _export(tmp_path, d)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and raw["model_type"] == "deepseek_v2"
    assert {k: raw[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")} == {
        "q_lora_rank": 12, "kv_lora_rank": 20, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 10}
    assert raw["fc_norm"] is True and raw["norm_output"] is True and raw["rope_interleave"] is True and "head_dim" not in raw
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    attn = {k.removeprefix("midlayer.self_attn."): v for k, v in shapes.items() if k.startswith("midlayer.self_attn.")}
    assert attn == {"q_a_proj.weight": (12, 64), "q_a_layernorm.weight": (12,), "q_b_proj.weight": (4 * 10, 12),
                    "kv_a_proj_with_mqa.weight": (24, 64), "kv_a_layernorm.weight": (20,), "kv_b_proj.weight": (4 * 16, 20),
                    "o_proj.weight": (32, 40)}
    assert shapes["fc_norm.0.weight"] == (32,)
    assert judge_draft(out).errors() == []
    # transformers' DeepseekV2Config (what both engines parse it with) reads the MLA sizes back
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(out)
    assert (tc.q_lora_rank, tc.kv_lora_rank, tc.qk_nope_head_dim, tc.qk_rope_head_dim, tc.v_head_dim) == (12, 20, 6, 4, 10)
    assert tc.norm_output is True and tc.fc_norm is True
    # our decoder loads it back to the same function (bf16 weights)
    back = load_draft(out, embed_weight=d.embed_tokens.float())
    x = torch.randn(1, 5, 96)
    torch.testing.assert_close(back.fuse(x), d.float().to(torch.bfloat16).float().fuse(x), atol=1e-5, rtol=1e-5)


def _judge_edited(out, edit_config=None, edit_tensors=None):
    from safetensors.torch import load_file, save_file

    from eaglenest.export.check import judge_draft

    if edit_config:
        c = json.loads((out / "config.json").read_text())
        edit_config(c)
        (out / "config.json").write_text(json.dumps(c))
    if edit_tensors:
        t = load_file(str(out / "model.safetensors"))
        edit_tensors(t)
        save_file(t, str(out / "model.safetensors"))
    return judge_draft(out)


def _strip_record(c):  # a draft from another trainer: no eaglenest block
    del c["eaglenest"]


@pytest.mark.parametrize("case,kind,edit_config,edit_tensors,expect,who", [
    ("fc_norm flag, no weights", "eagle31", _strip_record, lambda t: [t.pop(f"fc_norm.{i}.weight") for i in range(3)],
     "fc_norm is true but model.safetensors has no fc_norm.* weights", {"sglang", "vllm", "hf"}),
    ("fc_norm weights, no flag", "eagle31", lambda c: (_strip_record(c), c.update(fc_norm=False)), None,
     "but the config's fc_norm is false", {"sglang", "vllm", "hf"}),
    ("MLA config, Llama weights", "mla", _strip_record,
     lambda t: [t.pop(k) for k in list(t) if k.startswith("midlayer.self_attn.")] and t.update(
         {f"midlayer.self_attn.{p}_proj.weight": torch.zeros(16, 64, dtype=torch.bfloat16) for p in "qkv"}),
     "describes an MLA draft but model.safetensors holds Llama attention", {"sglang", "vllm", "hf"}),
    ("norm_output only in eagle_config", "eagle31", lambda c: (_strip_record(c), c.update(norm_output=False, eagle_config={"norm_output": True})),
     None, "both engines read only the top-level key", {"sglang", "vllm", "hf"}),
    ("served norm_output != trained", "eagle31", lambda c: c.update(norm_output=False), None,
     "the engines would serve norm_output = False, the draft was trained with norm_output = True", {"sglang", "vllm", "hf"}),
    ("served attention != trained", "mla", lambda c: c.update(architectures=["LlamaForCausalLMEagle3"]), None,
     "the engines would serve attention = 'gqa', the draft was trained with attention = 'mla'", {"sglang", "vllm", "hf"}),
    ("use_aux_norm (SGLang's spelling)", "eagle31", lambda c: (_strip_record(c), c.pop("fc_norm"), c.update(use_aux_norm=True)), None,
     "use_aux_norm is SGLang's spelling of fc_norm: vLLM 0.32 ignores it", {"vllm"}),
    ("MLA as deepseek_v3", "mla", lambda c: c.update(model_type="deepseek_v3"), None,
     "hf_config_override turns into its DeepSeek MTP model", {"vllm"}),
    ("MLA without q_lora_rank", "mla-noq-31", None, None, "SGLang 0.5.23's Eagle3MLADecoderLayer requires one", {"sglang"}),
])
def test_check_draft_refuses_flags_and_weights_that_disagree(tmp_path, case, kind, edit_config, edit_tensors, expect, who):
    out = _export(tmp_path, tiny(KINDS[kind], rope=YARN if "mla" in kind else None))
    r = _judge_edited(out, edit_config, edit_tensors)
    hits = {c for c in ("sglang", "vllm", "hf") if any(expect in e for e in r.errors([c]))}
    assert hits == who, (case, r.errors())
    for c in who:
        assert not r.ok_for(c)


def test_check_draft_accepts_each_kind_as_exported(tmp_path):
    from eaglenest.export.check import judge_draft

    for name, kind in KINDS.items():
        out = _export(tmp_path, tiny(kind, rope=YARN if "mla" in name else None), name)
        r = judge_draft(out)
        ok = {c for c in ("sglang", "vllm", "hf") if r.ok_for(c)}
        assert ok == ({"vllm", "hf"} if name == "mla-noq-31" else {"sglang", "vllm", "hf"}), (name, r.errors())


def test_mla_draft_on_a_target_whose_rope_the_engines_cannot_reproduce_is_refused():
    from eaglenest.draft.shape import draft_shape
    from eaglenest.models.target import target_facts

    llama31 = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 300, "intermediate_size": 128, "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}
    f = target_facts(llama31)
    assert draft_shape(f, None, "gqa").attention == "gqa"
    with pytest.raises(EaglenestError, match="rope_type 'llama3'.*DeepSeek's YaRN"):
        draft_shape(f, None, "mla")
    with pytest.raises(EaglenestError, match="does not apply to a gqa draft"):
        draft_shape(f, {"kv_lora_rank": 64}, "gqa")
    with pytest.raises(EaglenestError, match="does not apply to a mla draft"):
        draft_shape(target_facts({**llama31, "rope_scaling": None}), {"num_key_value_heads": 1}, "mla")
