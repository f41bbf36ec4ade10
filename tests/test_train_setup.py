"""The trainer's set-up pieces on their own (eaglenest/train/{setup,loader,checkpoint,distributed,
metrics}.py): a synthetic feature store and a tiny draft, no target model."""

import json
import math
import threading

import pytest
import torch

from eaglenest import EaglenestError
from eaglenest.draft.model import Eagle3Config
from eaglenest.draft.vocab import build_vocab, draft_ids_to_target
from eaglenest.features import FeatureStore, FeatureWriter, StoreMeta
from eaglenest.train.checkpoint import Checkpointer, check_resume
from eaglenest.train.data import Schedule, collate
from eaglenest.train.distributed import Distributed, collective_device
from eaglenest.train.loader import Prefetcher, StoreSource
from eaglenest.train.metrics import MetricsLog
from eaglenest.train.setup import build_draft, build_optimizer, build_scheduler, fc_input_rms, store_fingerprint, vocab_counts
from eaglenest.train.ttt import denominators

pytestmark = pytest.mark.usefixtures("one_torch_thread")
H, V = 16, 300


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic_store")
    meta = StoreMeta(target="toy", target_fingerprint="f", hidden_size=H, num_layers=6, layer_ids=[1, 2, 3], final_norm="post",
                     dtype="fp32", engine="test")
    w = FeatureWriter(root, meta)
    g = torch.Generator().manual_seed(0)
    for shard in range(4):
        batch = []
        for k in range(5):
            T = int(torch.randint(5, 40, (1,), generator=g))
            batch.append((f"s{shard}-{k}", {"input_ids": torch.randint(0, V, (T,), generator=g), "loss_mask": (torch.rand(T, generator=g) > 0.3).long(),
                                            "aux_hidden_states": torch.randn(T, 3 * H, generator=g) * torch.linspace(0.1, 50, 3 * H),
                                            "last_hidden_state": torch.randn(T, H, generator=g)}))
        w.write_batch(batch)
    return FeatureStore(root)


def dcfg(Vd=50):
    return Eagle3Config(hidden_size=H, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=V,
                       draft_vocab_size=Vd, target_hidden_size=H, aux_layer_ids=[1, 2, 3], target_num_layers=6)


def head():
    g = torch.Generator().manual_seed(1)
    return {"embed": torch.randn(V, H, generator=g), "lm_head": torch.randn(V, H, generator=g), "norm": torch.rand(H, generator=g) + 0.5}


def test_public_store_reads_and_vocab_counts(store):
    ids, m = store.input_ids(3), store.loss_mask(3)
    full = store[3]
    assert torch.equal(ids.long(), full["input_ids"]) and torch.equal(m.long(), full["loss_mask"])
    counts = vocab_counts(store, V)
    ref = torch.zeros(V, dtype=torch.int64)
    for i in range(len(store)):
        x = store[i]
        ref += torch.bincount(x["input_ids"][x["loss_mask"].bool()], minlength=V)
    assert torch.equal(counts, ref) and counts.sum() > 0


def test_build_draft_is_a_pure_function_of_its_inputs(store):
    d2t, t2d = build_vocab(vocab_counts(store, V), 50)
    rows, hd = draft_ids_to_target(d2t), head()
    rms = fc_input_rms(store)
    kw = dict(seed=3, init_head="target", fc_init="scaled", fc_rms=rms, freeze_head=True)
    a, b = build_draft(dcfg(), hd, rows, d2t, t2d, **kw), build_draft(dcfg(), hd, rows, d2t, t2d, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(a.lm_head.weight, hd["lm_head"][rows]) and not a.lm_head.weight.requires_grad  # target rows, frozen
    assert torch.equal(a.norm.weight, hd["norm"])
    # scaled fc: each input column is whitened by its RMS, so fc(aux) has no dominating input dims
    col = a.fc.weight.pow(2).mean(0).sqrt() * rms  # an input column's typical contribution
    assert rms.max() / rms.min() > 100 and col.max() / col.min() < 5
    c = build_draft(dcfg(), hd, rows, d2t, t2d, **{**kw, "seed": 4})
    assert not torch.equal(c.fc.weight, a.fc.weight)


def test_optimizer_decays_matrices_only_and_schedule_warms_up_then_decays():
    d = build_draft(dcfg(), head(), torch.arange(50), torch.zeros(50, dtype=torch.long), torch.ones(V, dtype=torch.bool),
                    seed=0, init_head="random", fc_init="random", fc_rms=None, freeze_head=False)
    params = list(d.parameters())
    opt = build_optimizer(params, 1e-3, 0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(p.ndim >= 2 for p in opt.param_groups[0]["params"]) and all(p.ndim < 2 for p in opt.param_groups[1]["params"])
    sched = build_scheduler(opt, warmup=4, total=20, min_ratio=0.1)
    lrs = []
    for _ in range(20):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3]) and lrs[4] == pytest.approx(1e-3)
    assert all(x >= y for x, y in zip(lrs[4:], lrs[5:])) 
    assert lrs[-1] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16))))  # cosine to 10 %


def test_draft_vocab_fills_with_never_seen_non_special_tokens(tiny_llama_dir):
    """SmolLM2's tokenizer: ids 0-16 are special.  Data with 3 distinct tokens and a vocabulary of 8:
    the 3, the stop ids (2 = <|im_end|>, 0 = <|endoftext|>), then never-seen tokens from 17 up."""
    from eaglenest.models.target import eos_token_ids
    from eaglenest.train.setup import draft_vocab

    counts = torch.zeros(49152, dtype=torch.int64)
    counts[[500, 900, 16]] = torch.tensor([5, 3, 1])  # a special token the data does hold keeps its place
    d2t, _ = draft_vocab(counts, 8, tiny_llama_dir)
    stops = sorted(eos_token_ids(tiny_llama_dir))
    assert stops and all(s < 17 for s in stops)
    got = draft_ids_to_target(d2t).tolist()
    assert got == sorted([16, 500, 900, *stops, *range(17, 17 + 8 - 3 - len(stops))]), got


def test_warmup_steps_default_has_a_floor():
    from eaglenest.train.setup import warmup_steps

    # 3 % of the run, at least 8 steps, at most a quarter of the run; an explicit value is kept
    assert [warmup_steps(0, t) for t in (1, 4, 20, 60, 160, 630, 2000)] == [1, 1, 5, 8, 8, 18, 60]
    assert warmup_steps(3, 2000) == 3


class _Prompts:
    """A store-like object (input_ids / loss_mask per sample) over token lists."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def input_ids(self, i):
        return torch.tensor(self.samples[i][0])

    def loss_mask(self, i):
        return torch.tensor(self.samples[i][1])


def test_split_goes_by_normalized_prompt(tiny_llama_dir):
    """Samples whose prompts differ only in case and spacing (and in their answers) land on one side;
    the held-out share is about the fraction of distinct prompts."""
    from transformers import AutoTokenizer

    from eaglenest.train.data import held_out_mask, split

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    samples, group = [], []
    for q in range(120):
        for variant, answer in ((f"Question number {q}: what is it?", "Fine."), (f"question  NUMBER {q}:\twhat is it? ", "Other.")):
            p, a = tok(variant)["input_ids"], tok(answer)["input_ids"]
            samples.append((p + a, [0] * len(p) + [1] * len(a)))
            group.append(q)
    store = _Prompts(samples)
    held = held_out_mask(store, 0.25, tok)
    assert all(held[2 * q] == held[2 * q + 1] for q in range(120))  # duplicates never straddle the split
    assert 12 <= int(held.sum()) // 2 <= 48  # 25 % of 120 prompts = 30, sd 4.7
    train, out = split(store, 0.25, tok)
    assert sorted(train + out) == list(range(240)) and set(out) == set(held.nonzero().flatten().tolist())
    assert not held_out_mask(store, 0.0, tok).any()
    # the token ids alone (no tokenizer) tell the variants apart: the normalization is what joins them
    raw = held_out_mask(store, 0.5, None)
    assert any(raw[2 * q] != raw[2 * q + 1] for q in range(120))


def test_store_source_splits_each_step_over_ranks(store):
    sched = Schedule(store.lengths(), list(range(len(store))), 64, 4, 0, 32)
    one = StoreSource(store, sched, 3, 32)
    ranks = [StoreSource(store, sched, 3, 32, rank=r, world=2) for r in (0, 1)]
    for step in range(sched.steps_per_epoch + 1):
        full = one.load(step)
        parts = [s.load(step) for s in ranks]
        assert [k for p in parts for k in p.keys] == full.keys[0::2] + full.keys[1::2]
        assert torch.equal(parts[0].denom + parts[1].denom, full.denom)  # the trainer sums them over ranks
        ref = sum(denominators(collate(store, list(k), 32).loss_mask, 3) for k in full.keys)
        assert torch.equal(full.denom, ref)
        assert full.n_tokens == sum(p.n_tokens for p in parts)


def test_prefetcher_hands_out_steps_in_order_and_stays_bounded():
    loaded, lock = [], threading.Lock()

    class Source:
        def load(self, step):
            with lock:
                loaded.append(step)
            return step

    with Prefetcher(Source(), depth=2, threads=2, end=6) as p:
        assert [p.get(s) for s in range(3)] == [0, 1, 2]
        assert max(loaded) <= 4  # never more than `depth` steps ahead of the last one asked for
        assert p.get(5) == 5  # a jump (resume) skips what will not be asked for
    assert sorted(set(loaded)) == sorted(loaded) and max(loaded) == 5
    assert Prefetcher(Source(), depth=0).get(7) == 7  # depth 0: read in the caller


def test_checkpointer_round_trip_refusal_and_strictness(tmp_path):
    d = build_draft(dcfg(), head(), torch.arange(50), torch.zeros(50, dtype=torch.long), torch.ones(V, dtype=torch.bool),
                    seed=0, init_head="random", fc_init="random", fc_rms=None, freeze_head=False)
    opt = build_optimizer(list(d.parameters()), 1e-3, 0.0)
    sched = build_scheduler(opt, 1, 10, 0.1)
    d(torch.randint(0, V, (1, 5)), torch.randn(1, 5, 3 * H)).sum().backward()
    opt.step()
    sched.step()
    ck = Checkpointer(tmp_path / "run")
    ck.prepare(resume=False, overwrite=False)  # empty: fine
    ck.save(7, 10, d, opt, sched)
    with pytest.raises(EaglenestError, match="holds checkpoints up to step-00000007"):
        ck.prepare(resume=False, overwrite=False)
    e = build_draft(dcfg(), head(), torch.arange(50), torch.zeros(50, dtype=torch.long), torch.ones(V, dtype=torch.bool),
                    seed=1, init_head="random", fc_init="random", fc_rms=None, freeze_head=False)
    opt2 = build_optimizer(list(e.parameters()), 1e-3, 0.0)
    sched2 = build_scheduler(opt2, 1, 10, 0.1)
    assert ck.load(e, opt2, sched2) == 7
    assert all(torch.equal(x, y) for x, y in zip(d.state_dict().values(), e.state_dict().values()))
    assert sched2.last_epoch == 1 and opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    small = build_draft(dcfg(Vd=40), head(), torch.arange(40), torch.zeros(40, dtype=torch.long), torch.ones(V, dtype=torch.bool),
                        seed=1, init_head="random", fc_init="random", fc_rms=None, freeze_head=False)
    with pytest.raises(EaglenestError, match="does not match the draft"):  # same keys, other shapes
        ck.load(small, opt2, sched2)
    ck.prepare(resume=False, overwrite=True)
    assert not ck.holds_checkpoints() and ck.latest() is None


def test_check_resume_names_every_differing_field(tmp_path):
    saved = {"train": {"seed": 0, "batch_tokens": 256}, "draft": {"hidden_size": 16}, "store_fingerprint": "a"}
    check_resume(saved, json.loads(json.dumps(saved)), tmp_path)
    now = {"train": {"seed": 1, "batch_tokens": 256}, "draft": {"hidden_size": 32}, "store_fingerprint": "b", "new": 1}
    with pytest.raises(EaglenestError) as e:
        check_resume(saved, now, tmp_path)
    assert "draft.hidden_size: run 16, now 32; store_fingerprint: run 'a', now 'b'; train.seed: run 0, now 1" in str(e.value)


def test_store_fingerprint_follows_the_samples(store, tmp_path):
    import shutil

    fp = store_fingerprint(store)
    assert fp == store_fingerprint(FeatureStore(store.root))
    other = tmp_path / "copy"
    shutil.copytree(store.root, other)
    assert store_fingerprint(FeatureStore(other)) == fp  # where the store lives does not matter
    st = json.loads((other / "store.json").read_text())
    (other / "store.json").write_text(json.dumps({**st, "engine": "vllm", "compute_dtype": "bf16"}))
    assert store_fingerprint(FeatureStore(other)) == fp  # nor who computed the states, in which dtype (not the order)
    s2 = FeatureStore(other)
    s2.drop({s2.ids()[-1]})
    assert store_fingerprint(FeatureStore(other)) != fp


def test_metrics_log_resume_truncation(tmp_path):
    log = MetricsLog(tmp_path)
    log.start(0)
    for s in range(1, 6):
        log.log({"step": s, "loss": 1.0 / s})
    log.start(3)  # resumed at the step-3 checkpoint: lines 4 and 5 will be recomputed
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    log.start(0)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_single_process_and_the_device_rule():
    d = Distributed("cpu")
    assert (d.rank, d.world, d.dist) == (0, 1, None)
    t = torch.ones(3)
    d.all_reduce_sum_([t])
    assert torch.equal(d.sum(t), t) and torch.equal(d.broadcast_(t), t)
    assert collective_device("gloo") == torch.device("cpu")
    if torch.cuda.is_available():
        assert collective_device("nccl") == torch.device("cuda", torch.cuda.current_device())
