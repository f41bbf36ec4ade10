"""DFlash: the block objective against a slow, plainly written reference (loss and gradients, CE
with decay and D-PACE), the anchor sampling rules, the block attention, and decoding's block
forward == training's."""

import math

import pytest
import torch

from eaglenest import EaglenestError
from eaglenest.draft import draft_model
from eaglenest.draft.dflash import DFlashConfig
from eaglenest.draft.model import apply_rope
from eaglenest.draft.vocab import build_vocab
from eaglenest.train.data import Batch
from eaglenest.train.objective import DFlashObjective, dpace_weights, paper_decay, sample_anchors

V, H, NL = 300, 32, 5  # vocabulary, hidden, target layers


def tiny_dflash(seed=0, layers=2, block=4, Vd=120):
    cfg = DFlashConfig(
        hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=V, draft_vocab_size=Vd, target_hidden_size=H, aux_layer_ids=[1, 2, 4, 5, 6], target_num_layers=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_hidden_layers=layers, block_size=block, mask_token_id=7,
    )
    torch.manual_seed(seed)
    d = draft_model(cfg, embed_weight=torch.randn(V, H))
    for p in d.parameters():
        torch.nn.init.normal_(p, mean=0.0, std=0.2)
    for n, p in d.named_parameters():
        if n.endswith("norm.weight"):
            p.data += 1.0
    d.set_vocab(*build_vocab(torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(seed)), Vd))
    return d.double()


def make_batch(lengths, masks, seed=1):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, (L, (s, e)) in enumerate(zip(lengths, masks)):
        ids[b, :L] = torch.randint(0, V, (L,), generator=g)
        mask[b, s:e] = 1
    aux = torch.randn(B, T, NL * H, generator=g, dtype=torch.float64)
    return Batch(ids, mask, aux, torch.zeros(B, T, H, dtype=torch.float64), sum(lengths))


def reference_loss(d, b: Batch, anchors, keep, loss="ce", gamma=0.0, alpha=0.5):
    """Every block, layer, head and key written out by hand; returns (loss, per-slot CE sums)."""
    S, cfg = d.cfg.block_size, d.cfg
    at0 = d.layers[0].self_attn
    g = at0.n_head // at0.n_kv
    total, blocks, wsum = 0.0, 0, 0.0
    ce_sums = [0.0] * (S - 1)
    for i in range(b.input_ids.shape[0]):
        ids, mask, aux = b.input_ids[i], b.loss_mask[i], b.aux[i]
        T = ids.shape[0]
        for n in range(anchors.shape[1]):
            if not keep[i, n]:
                continue
            a = int(anchors[i, n])
            ctx = d.hidden_norm(d.fc(aux[:a]))  # the context strictly before the anchor
            cpos = torch.arange(a)[None]
            bpos = torch.arange(a, a + S)[None]
            h = d.embed(torch.tensor([int(ids[a])] + [cfg.mask_token_id] * (S - 1))).double()
            for layer in d.layers:
                at = layer.self_attn
                x = layer.input_layernorm(h)
                cc, cs = d.rotary(cpos)
                bc, bs = d.rotary(bpos)
                kc = apply_rope(at.k_norm(at.k_proj(ctx).view(1, a, at.n_kv, at.hd)).transpose(1, 2), cc, cs)[0]
                vc = at.v_proj(ctx).view(a, at.n_kv, at.hd).transpose(0, 1)
                kb = apply_rope(at.k_norm(at.k_proj(x).view(1, S, at.n_kv, at.hd)).transpose(1, 2), bc, bs)[0]
                vb = at.v_proj(x).view(S, at.n_kv, at.hd).transpose(0, 1)
                q = apply_rope(at.q_norm(at.q_proj(x).view(1, S, at.n_head, at.hd)).transpose(1, 2), bc, bs)[0]
                outs = []
                for s in range(S):
                    heads = []
                    for hh in range(at.n_head):
                        kv = hh // g
                        K = [kc[kv, t] for t in range(a)] + [kb[kv, u] for u in range(S)]  # every block key: non-causal
                        Vv = [vc[kv, t] for t in range(a)] + [vb[kv, u] for u in range(S)]
                        p = torch.softmax(torch.stack([q[hh, s] @ k for k in K]) / math.sqrt(at.hd), 0)
                        heads.append(sum(pi * vi for pi, vi in zip(p, Vv)))
                    outs.append(torch.cat(heads))
                h = h + at.o_proj(torch.stack(outs))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            logp = torch.log_softmax(d.logits(h), -1)
            ces, valid = [], []
            for k in range(1, S):
                ok = a + k < T and int(mask[a + k]) == 1
                lab = int(ids[a + k]) if a + k < T else 0
                ind = ok and bool(d.t2d[lab])
                valid.append(ok)
                ces.append(-logp[k, int(d.t2d[:lab].sum())] if ind else None)
            blocks += any(valid)
            if loss == "ce":
                for k, c in enumerate(ces, start=1):
                    if c is not None:
                        w = math.exp(-(k - 1) / gamma) if gamma > 0 else 1.0
                        total = total + w * c
                        wsum += w
                        ce_sums[k - 1] += float(c.detach())
            else:
                q = torch.tensor([float((-c.detach()).exp()) if c is not None else 0.0 for c in ces], dtype=torch.float64)[None]
                w = dpace_weights(q, torch.tensor(valid)[None], alpha)[0]
                for k, c in enumerate(ces):
                    if c is not None:
                        total = total + float(w[k]) * c
                        ce_sums[k] += float(c.detach())
    return total / (wsum if loss == "ce" else blocks), ce_sums


@pytest.mark.parametrize("loss,gamma", [("ce", 0.0), ("ce", 2.0), ("dpace", None)])
def test_block_objective_matches_reference(loss, gamma):
    d = tiny_dflash(layers=2, block=4)
    b = make_batch([20, 14, 9], [(5, 20), (3, 6), (0, 9)])
    ob = DFlashObjective(4, 5, seed=3, device="cpu", autocast=False, decay=gamma, loss=loss).bind(d.t2d)
    plan = ob.plan(b, d.t2d, step=11)
    assert plan["keep"].sum() > 5 and (~plan["keep"]).any()  # padded anchor slots are exercised
    denom = ob.denominators(b, 11).double()
    fast, stats, _ = ob.forward(d, b, None, denom, 11)
    gf = torch.autograd.grad(fast, list(d.parameters()))
    ref, ce_sums = reference_loss(d, b, plan["anchors"], plan["keep"], loss, gamma or 0.0)
    gr = torch.autograd.grad(ref, list(d.parameters()))
    assert torch.allclose(fast, ref, rtol=1e-9, atol=1e-10), (float(fast), float(ref))
    for (n, _), x, y in zip(d.named_parameters(), gf, gr):
        assert torch.allclose(x, y, rtol=1e-7, atol=1e-10), n
    assert stats["loss_sum"] == pytest.approx(ce_sums, rel=1e-9)


def test_prefix_statistics_and_dpace_weights():
    d = tiny_dflash(block=5)
    b = make_batch([24], [(2, 24)])
    ob = DFlashObjective(5, 6, seed=0, device="cpu", autocast=False, decay=0.0).bind(d.t2d)
    p = ob.plan(b, d.t2d, 0)
    _, st, _ = ob.forward(d, b, None, ob.denominators(b, 0), 0)
    assert st["count"][0] == float(p["valid"][..., 0].sum())
    assert all(c <= n for c, n in zip(st["correct"], st["count"]))
    assert all(st["count"][k + 1] <= st["correct"][k] for k in range(3))  # slot k+1 is reached only through slot k
    q = torch.tensor([[0.5, 1.0, 0.0, 0.25]])
    w = dpace_weights(q, torch.tensor([[True, True, False, True]]), alpha=0.0)
    # prefixes: 0.5, 0.5, (invalid: no-op, not counted), 0.125 -> suffix sums
    assert torch.allclose(w, torch.tensor([[1.125, 0.625, 0.125, 0.125]]))


def test_anchor_sampling_rules():
    b = make_batch([30, 12], [(4, 30), (6, 11)])
    a1, k1 = sample_anchors(b, 8, seed=5, step=2)
    m = b.loss_mask
    for i in range(2):
        for a in a1[i][k1[i]].tolist():
            assert m[i, a] == 1 and m[i, a + 1] == 1  # an assistant token whose next token is one
    assert int(k1[0].sum()) == 8 and int(k1[1].sum()) == 4  # all 4 valid positions of the short one
    assert (a1[0][k1[0]].diff() > 0).all()
    # the same anchors whatever batch the sample lands in (padding length) and on a re-run; another step moves them
    alone = Batch(b.input_ids[:1, :30], b.loss_mask[:1, :30], b.aux[:1, :30], b.last[:1, :30], 30)
    padded = make_batch([30, 40], [(4, 30), (0, 40)])
    padded.input_ids[0], padded.loss_mask[0] = torch.cat([b.input_ids[0], torch.zeros(10, dtype=torch.long)]), torch.cat([m[0], torch.zeros(10, dtype=torch.long)])
    assert torch.equal(sample_anchors(alone, 8, 5, 2)[0][0], a1[0])
    assert torch.equal(sample_anchors(padded, 8, 5, 2)[0][0][:8], a1[0])
    assert not torch.equal(sample_anchors(alone, 8, 5, 3)[0][0], a1[0])
    assert paper_decay(16) == 7.0 and paper_decay(8) == 4.0


def test_decoding_block_equals_training_block():
    """The decoder's block forward (context K/V cached in pieces, one block) == the training forward's slice."""
    d = tiny_dflash(layers=3, block=4)
    T = 15
    aux = torch.randn(1, T, NL * H, dtype=torch.float64)
    ids = torch.randint(0, V, (1, T))
    a = 11
    full = d(aux, ids[:, [a]], torch.tensor([[a]]))[0, 0]  # [S, Vd]
    # decoding: context K/V of positions 0..a-1 computed in two pieces (prefill, then a round's accepted states)
    pieces = [d.context_kv(d.fuse(aux[:, s:e]), torch.arange(s, e)[None]) for s, e in ((0, 6), (6, a))]
    kv = [(torch.cat([p[i][0] for p in pieces], 2), torch.cat([p[i][1] for p in pieces], 2)) for i in range(3)]
    blk = d.block_input(ids[:, [a]])
    h = d.blocks(blk, (a + torch.arange(4))[None, None], kv, torch.tensor([[a]]))
    assert torch.allclose(d.logits(h)[0, 0], full, atol=1e-12)


def test_refuses_bad_configs():
    with pytest.raises(EaglenestError, match="block-size"):
        tiny_dflash(block=1)
    cfg = tiny_dflash().cfg
    from dataclasses import replace

    with pytest.raises(EaglenestError, match="mask_token_id"):
        draft_model(replace(cfg, mask_token_id=V))


def test_foreign_dflash_draft_without_a_head_is_read_judged_and_loaded(smollm2, tmp_path):
    """A DFlash draft as SpecForge / z-lab write it (no eaglenest block, output-of target_layer_ids,
    no lm_head: the engines use the target's) is read into the same config, judged per engine and
    run on the target's head."""
    import json

    from safetensors.torch import save_file

    from eaglenest.export.check import judge_draft
    from eaglenest.kinds.dflash import expected_tensors
    from eaglenest.export.format import load_draft, read_draft
    from eaglenest.models.target import load_config

    t = load_config(smollm2)
    H, V, hd = t.hidden_size, t.vocab_size, t.head_dim
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": 1, "hidden_size": H,
           "intermediate_size": 256, "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
           "head_dim": hd, "rms_norm_eps": t.rms_norm_eps, "max_position_embeddings": t.max_position_embeddings,
           "rope_theta": t.rope_parameters["rope_theta"], "vocab_size": V, "block_size": 8, "num_target_layers": t.num_hidden_layers,
           "dflash_config": {"mask_token_id": 16, "target_layer_ids": [1, 14, 26]}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = read_draft(tmp_path).cfg
    assert type(cfg).__name__ == "DFlashConfig" and cfg.kind == "dflash" and cfg.aux_layer_ids == [2, 15, 27] and cfg.block_size == 8 and cfg.draft_vocab_size == V
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(shape, generator=g).to(torch.bfloat16) * 0.02
          for k, (shape, _) in expected_tensors(cfg, torch.bfloat16).items() if k != "lm_head.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    r = judge_draft(tmp_path, smollm2)
    assert r.errors(("vllm", "hf")) == [], r.errors(("vllm", "hf"))
    assert any("no lm_head" in n for n in r.notes)
    head = torch.randn(V, H, generator=g)
    d = load_draft(tmp_path, embed_weight=torch.randn(V, H, generator=g), lm_head_weight=head)
    assert torch.equal(d.lm_head.weight, head)
