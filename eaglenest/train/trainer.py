"""The EAGLE-3 training loop, top to bottom: setup -> (resume) -> steps -> eval -> checkpoints.

One optimizer step = `grad_accum` micro-batches (global, across ranks).  Each micro-batch's loss
is normalized by the *global* token count of its step, and gradients are summed across ranks
with one all-reduce, so N processes compute the same update as one process with the same global
batch.  Run state (model, optimizer, scheduler, RNG, step) is checkpointed by rank 0; the data
position is the step number (see data.py), so a resumed run replays exactly the same batches.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eaglenest import EaglenestError
from eaglenest.draft.model import DraftConfig, Eagle3Draft
from eaglenest.draft.vocab import build_vocab, draft_ids_to_target
from eaglenest.features import FeatureStore
from eaglenest.train.data import Schedule, collate, split
from eaglenest.train.ttt import Teacher, denominators, ttt_forward
from eaglenest.utils import append_jsonl_durable, atomic_write_bytes, atomic_write_json, progress, read_json, release_free_heap


@dataclass
class TrainConfig:
    model: str
    features: str
    out: str
    ttt_steps: int = 7
    draft_vocab: int = 32000
    epochs: float = 1.0
    max_steps: int | None = None
    lr: float = 1e-4
    warmup_steps: int = 0  # 0: 3% of the run
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_tokens: int = 4096
    grad_accum: int = 1
    max_len: int = 2048
    eval_fraction: float = 0.02
    eval_every: int = 0  # 0: ~10 times per run
    eval_max_batches: int = 8
    save_every: int = 0  # 0: only at the end
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    init_head: str = "target"  # target: lm_head rows + final norm copied from the target; random
    freeze_head: bool = False  # keep lm_head at its (target) init: ~1.7x faster steps on CPU
    fc_init: str = "scaled"  # scaled: fc columns divided by the aux features' RMS (see _init_fc); random
    resume: bool = False
    log_every: int = 1
    attn_impl: str = "auto"  # auto: flex on CUDA, eager on CPU; or eager | chunked | flex (same function)
    recompute: str = "auto"  # activation checkpointing per TTT step: auto (CUDA, when the activations would not fit) | none | layer
    logits_chunk: int = 0  # rows of draft logits alive at once (0: 1024 on CPU, 4096 on CUDA)
    draft_shape: dict = field(default_factory=dict)  # draft layer overrides (draft/shape.py FLAGS): heads, kv heads, head_dim, MLP
    extra: dict = field(default_factory=dict)


TRIM_EVERY = 20  # CPU steps between heap trims: ~2 % of the step time, RSS stays ~1/3 (train_cpu_memory.json)
ARGMAX_CACHE_TOKENS = 1 << 28  # 1 GiB of int32: beyond that, later epochs recompute the target's argmax


def _dist(device: str = "auto"):
    """(dist module or None, rank, world size, whether we initialized the process group).
    Under torchrun (WORLD_SIZE > 1): NCCL when the run uses CUDA, gloo otherwise (CPU runs)."""
    import torch.distributed as dist

    owns = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        on_cuda = torch.cuda.is_available() and device in ("auto", "cuda") or device.startswith("cuda:")
        dist.init_process_group("nccl" if on_cuda else "gloo")
        owns = True
    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(), dist.get_world_size(), owns
    return None, 0, 1, owns


def estimate_activation_bytes(cfg: DraftConfig, tokens: int, ttt: int) -> int:
    """Autograd-saved bytes of `tokens` tokens over `ttt` steps WITHOUT recompute, bf16 autocast:
    ~47 H + 8 I bytes per token per step (measured with `bench/train_step.py --saved-bytes`;
    307 KB at the Llama-3.1-8B shape, i.e. 2.1 MB per token over 7 steps; see bench/NOTES.md)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return int(tokens * ttt * (47 * H + 8 * I))


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    prog = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))


def vocab_counts(store: FeatureStore, vocab_size: int) -> torch.Tensor:
    """Token frequencies under the loss mask, from the store itself (exactly the training data)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in range(len(store)):
        e = store.entries[i]
        h = store._open(e["shard"])
        ids = h.get_tensor(f"{e['key']}.input_ids").long()
        m = h.get_tensor(f"{e['key']}.loss_mask").bool()
        counts += torch.bincount(ids[m], minlength=vocab_size)[:vocab_size]
    return counts


class Trainer:
    def __init__(self, cfg: TrainConfig):
        from eaglenest.draft.shape import describe, draft_shape
        from eaglenest.models.target import eos_token_ids, load_config, resolve_model_path, target_facts, target_fingerprint
        from eaglenest.models.weights import target_head
        from eaglenest.utils import resolve_device

        self.cfg = cfg
        self.dist, self.rank, self.world, self._owns_pg = _dist(cfg.device)
        self.out = Path(cfg.out)
        self.device = resolve_device(cfg.device)
        if self.device == "cuda" and self.world > 1:
            self.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(self.device)
        self.autocast = self.device.startswith("cuda") if cfg.dtype == "auto" else cfg.dtype == "bf16"
        self.device_type = "cuda" if self.device.startswith("cuda") else "cpu"

        self.store = FeatureStore(cfg.features)
        meta = self.store.meta
        tcfg = load_config(cfg.model)
        if meta.target_fingerprint != target_fingerprint(cfg.model) or meta.hidden_size != tcfg.hidden_size:
            raise EaglenestError(
                f"feature store {cfg.features} was captured from {meta.target} (hidden {meta.hidden_size}, "
                f"{meta.num_layers} layers), not from {cfg.model} (hidden {tcfg.hidden_size}, {tcfg.num_hidden_layers} layers)"
            )
        if len(self.store) == 0:
            raise EaglenestError(f"feature store {cfg.features} holds no samples")
        head = target_head(cfg.model)

        # draft vocabulary (rank 0 decides; others read it back for identical mapping)
        self.out.mkdir(parents=True, exist_ok=True)
        vocab_path = self.out / "vocab.safetensors"
        if cfg.resume and vocab_path.exists():
            from safetensors.torch import load_file

            v = load_file(str(vocab_path))
            d2t, t2d = v["d2t"], v["t2d"]
        else:
            self.counts = vocab_counts(self.store, tcfg.vocab_size)
            d2t, t2d = build_vocab(self.counts, cfg.draft_vocab, always=eos_token_ids(resolve_model_path(cfg.model)))
        rows = draft_ids_to_target(d2t)

        dcfg = DraftConfig.from_target(tcfg, d2t.numel(), meta.layer_ids, shape=cfg.draft_shape)
        if self.rank == 0:
            print(describe(draft_shape(target_facts(tcfg), cfg.draft_shape), target_facts(tcfg)), file=sys.stderr)
        torch.manual_seed(cfg.seed)
        self.model = Eagle3Draft(dcfg, embed_weight=head["embed"].float())
        self._init_weights(head, rows, cfg.init_head)
        self._init_fc(cfg.fc_init)
        if cfg.freeze_head:
            if cfg.init_head != "target":
                raise EaglenestError("--freeze-head needs --init-head target (a frozen random head learns nothing)")
            self.model.lm_head.weight.requires_grad_(False)
        self.model.set_vocab(d2t, t2d)
        self.model.to(self.device)
        teacher_dtype = torch.bfloat16 if self.autocast else torch.float32
        self.teacher = Teacher(
            norm_weight=head["norm"].float() if meta.final_norm == "pre" else None,
            norm_eps=head["norm_eps"],
            logit_softcap=head["logit_softcap"],
            lm_head=head["lm_head"].to(teacher_dtype),  # bf16 on CUDA: no resident fp32 copy (2 GB at 8B)
            draft_rows=rows,
            t2d=t2d,
            matmul_dtype=teacher_dtype,
        ).to(self.device)
        from eaglenest.draft.model import ATTN_IMPLS, default_attn_impl

        self.attn_impl = default_attn_impl(self.device) if cfg.attn_impl == "auto" else cfg.attn_impl
        if self.attn_impl not in ATTN_IMPLS:
            raise EaglenestError(f"--attn-impl must be auto or one of {', '.join(ATTN_IMPLS)} (got {cfg.attn_impl})")
        if cfg.recompute not in ("auto", "none", "layer"):
            raise EaglenestError(f"--recompute must be auto, none or layer (got {cfg.recompute})")

        train_idx, self.eval_idx = split(self.store, cfg.eval_fraction)
        self.schedule = Schedule(self.store.lengths(), train_idx, cfg.batch_tokens, cfg.grad_accum, cfg.seed, cfg.max_len)
        self.eval_batches = Schedule(self.store.lengths(), self.eval_idx, cfg.batch_tokens, 1, 0, cfg.max_len).batches[: cfg.eval_max_batches] if self.eval_idx else []
        spe = self.schedule.steps_per_epoch
        self.total_steps = cfg.max_steps or max(1, int(round(cfg.epochs * spe)))
        self.warmup = cfg.warmup_steps or max(1, int(0.03 * self.total_steps))
        self.eval_every = cfg.eval_every or max(1, self.total_steps // 10)
        self.params = trainable = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.ndim >= 2]
        no_decay = [p for p in trainable if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_lambda(s, self.warmup, self.total_steps, cfg.min_lr_ratio)
        )
        self.step = 0
        # micro-batch -> the target's argmax per position (host RAM, int32), reused by later epochs;
        # only when a run sees its data more than once, and at most ARGMAX_CACHE_TOKENS tokens
        self._argmax: dict[tuple, torch.Tensor] = {}
        self._argmax_room = ARGMAX_CACHE_TOKENS if self.total_steps > spe else 0
        self.n_train_tokens = sum(self.store.lengths()[i] for i in train_idx)
        if self.rank == 0 and not cfg.resume:
            from safetensors.torch import save_file

            save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(vocab_path))
        if cfg.resume:
            self._load_latest()
        if self.rank == 0:
            atomic_write_json(
                self.out / "config.json",
                {
                    "train": asdict(cfg),
                    "draft": dcfg.to_dict(),
                    "store": meta.to_dict(),
                    "target": str(cfg.model),
                    "n_train_samples": len(train_idx),
                    "n_eval_samples": len(self.eval_idx),
                    "n_train_tokens": self.n_train_tokens,
                    "total_steps": self.total_steps,
                    "steps_per_epoch": spe,
                    "world_size": self.world,
                    "draft_vocab_coverage": self._coverage(t2d),
                },
            )

    # --- setup helpers ---------------------------------------------------------------------
    def _init_weights(self, head, rows, how: str) -> None:
        m = self.model
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                torch.nn.init.normal_(mod.weight, std=0.02)
        if how == "target":
            # start the output space where the target's is: its lm_head rows and final norm
            with torch.no_grad():
                m.lm_head.weight.copy_(head["lm_head"].float()[rows])
                m.norm.weight.copy_(head["norm"].float())
        elif how != "random":
            raise EaglenestError(f"--init-head must be target or random (got {how})")

    @torch.no_grad()
    def _init_fc(self, how: str, n_samples: int = 32) -> None:
        """Targets have massive activations (SmolLM2: a few dims of layer 15/27 reach 10^2-10^4), so
        a plain N(0, 0.02) fc lets those dims dominate the draft's residual stream and its output,
        and hundreds of steps go into unlearning them.  Dividing each input column by its RMS over
        a few samples is the same architecture with whitened inputs (a pure re-parametrization of
        the initial point); the first token (attention sink) is left out of the statistics."""
        if how == "random":
            return
        if how not in ("scaled", "high"):
            raise EaglenestError(f"--fc-init must be scaled, high or random (got {how})")
        acc, n = None, 0
        for i in range(min(n_samples, len(self.store))):
            a = self.store[i]["aux_hidden_states"][1:].float()
            acc = a.pow(2).sum(0) if acc is None else acc + a.pow(2).sum(0)
            n += a.shape[0]
        if not n:
            return
        rms = (acc / n).sqrt().clamp_min(1e-3)
        fc = self.model.fc.weight
        fc.copy_(torch.randn_like(fc) * (1.0 / fc.shape[1]) ** 0.5 / rms.to(fc))
        if how == "high":  # start from the high aux layer itself: the draft's output begins as a logit lens
            H = fc.shape[0]
            fc[:, 2 * H : 3 * H] += torch.eye(H, dtype=fc.dtype, device=fc.device)

    def _coverage(self, t2d) -> float | None:
        c = getattr(self, "counts", None)
        if c is None or c.sum() == 0:
            return None
        return float(c[t2d].sum() / c.sum())

    # --- checkpoints -----------------------------------------------------------------------
    def _ckpt_dir(self, step: int) -> Path:
        return self.out / "checkpoints" / f"step-{step:08d}"

    def save(self) -> Path | None:
        if self.rank != 0:
            return None
        from safetensors.torch import save_file

        d = self._ckpt_dir(self.step)
        tmp = d.with_name(d.name + ".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.model.exported_state_dict().items()}, str(tmp / "model.safetensors"))
        import io

        buf = io.BytesIO()
        torch.save(
            {
                "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "python_rng": list(random.getstate()[1]),
            },
            buf,
        )
        atomic_write_bytes(tmp / "state.pt", buf.getvalue())
        atomic_write_json(tmp / "trainer_state.json", {"step": self.step, "total_steps": self.total_steps})
        if d.exists():
            import shutil

            shutil.rmtree(d)
        os.replace(tmp, d)
        atomic_write_json(self.out / "checkpoints" / "latest.json", {"step": self.step, "dir": d.name})
        return d

    def _load_latest(self) -> None:
        from safetensors.torch import load_file

        latest = self.out / "checkpoints" / "latest.json"
        if not latest.exists():
            return  # nothing to resume: start fresh
        d = self.out / "checkpoints" / read_json(latest)["dir"]
        sd = load_file(str(d / "model.safetensors"))
        self.model.load_state_dict(sd, strict=False)
        st = torch.load(d / "state.pt", weights_only=True)
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        torch.set_rng_state(st["torch_rng"])
        random.setstate((3, tuple(st["python_rng"]), None))
        self.step = read_json(d / "trainer_state.json")["step"]
        if self.rank == 0:
            print(f"resumed from {d} at step {self.step}", file=sys.stderr)

    # --- one micro-batch -------------------------------------------------------------------
    def _forward(self, idx: list[int], denom: torch.Tensor):
        b = collate(self.store, idx, self.cfg.max_len)
        dev = self.device
        # micro-batches keep their samples every epoch: the target's argmax is computed once per batch
        key = tuple(idx)
        known = self._argmax.get(key)
        tprobs, targ = self.teacher.targets(b.last.to(dev).reshape(-1, b.last.shape[-1]), argmax=None if known is None else known.long())
        if known is None and targ.numel() <= self._argmax_room:
            self._argmax[key] = targ.to("cpu", torch.int32)
            self._argmax_room -= targ.numel()
        B, T = b.input_ids.shape
        cuda = self.device_type == "cuda"
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.autocast):
            loss, stats = ttt_forward(
                self.model,
                b.input_ids.to(dev),
                b.aux.to(dev).to(torch.bfloat16 if self.autocast else torch.float32),
                tprobs.view(B, T, -1),
                targ.view(B, T),
                b.loss_mask.to(dev),
                self.cfg.ttt_steps,
                denom.to(dev),
                chunk=self.cfg.logits_chunk or (4096 if cuda else 1024),
                checkpoint_logits=cuda,  # GPU memory is the limit; CPU RAM is not
                attn_impl=self.attn_impl,
                recompute=self._recompute(B * T),
            )
        return loss, stats, b.n_tokens

    def _recompute(self, tokens: int) -> bool:
        if self.cfg.recompute != "auto":
            return self.cfg.recompute == "layer"
        if self.device_type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        return estimate_activation_bytes(self.model.cfg, tokens, self.cfg.ttt_steps) > 0.5 * free

    def _denoms(self, batches: list[list[int]]) -> torch.Tensor:
        d = torch.zeros(self.cfg.ttt_steps)
        for idx in batches:
            d += denominators(collate_mask(self.store, idx, self.cfg.max_len), self.cfg.ttt_steps)
        return d

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        if not self.eval_batches:
            return None
        self.model.eval()
        tot = {"loss_sum": 0, "correct": 0, "count": 0, "loss_count": 0}
        per = [dict(tot) for _ in range(self.cfg.ttt_steps)]
        for idx in self.eval_batches:
            denom = self._denoms([idx])
            _, stats, _ = self._forward(idx, denom)
            for j in range(self.cfg.ttt_steps):
                for k in per[j]:
                    per[j][k] += stats[k][j]
        self.model.train()
        return summarize(per)

    # --- the loop --------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg
        self.model.train()
        log_path = self.out / "metrics.jsonl"
        if self.rank == 0 and not cfg.resume and log_path.exists():
            log_path.unlink()
        if self.rank == 0 and cfg.resume:
            _truncate_log(log_path, self.step)
        bar = progress(total=self.total_steps, initial=self.step, desc="train", unit="step") if self.rank == 0 else None
        t_start, tok_seen = time.time(), 0
        last_eval = None
        while self.step < self.total_steps:
            epoch, batches = self.schedule.step_batches(self.step)
            loss_val, n_tok, agg, gnorm = self.optimizer_step(batches)
            self.step += 1
            tok_seen += n_tok
            if self.rank == 0:
                rec = {"step": self.step, "epoch": epoch, "lr": self.sched.get_last_lr()[0], "loss": loss_val, "grad_norm": gnorm, "tokens": n_tok}
                rec.update(prefix_keys(summarize([{k: agg[k][j] for k in agg} for j in range(cfg.ttt_steps)]), "train_"))
                rec["tokens_per_s"] = tok_seen / max(1e-9, time.time() - t_start)
                if self.step % self.eval_every == 0 or self.step == self.total_steps:
                    last_eval = self.evaluate()
                    if last_eval:
                        rec.update(prefix_keys(last_eval, "eval_"))
                append_jsonl_durable(log_path, [rec])
                _tensorboard(self.out, rec)
                bar.update(1)
                bar.set_postfix(loss=f"{loss_val:.3f}", acc0=f"{rec['train_acc'][0]:.2f}", tok_s=f"{rec['tokens_per_s']:.0f}")
            if self.device_type == "cpu" and self.step % TRIM_EVERY == 0:
                release_free_heap()
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < self.total_steps:
                self.save()
        if bar:
            bar.close()
        final = self.save()
        if self.rank == 0:
            from eaglenest.train.plots import plot_run

            plot_run(self.out)
            atomic_write_json(self.out / "final.json", {"step": self.step, "checkpoint": str(final), "eval": last_eval})
        if self.world > 1:
            self.dist.barrier()  # every rank returns once rank 0's final checkpoint is complete
            if self._owns_pg:
                self.dist.destroy_process_group()
        return {"step": self.step, "eval": last_eval, "checkpoint": final}

    def optimizer_step(self, batches: list[list[int]]) -> tuple[float, int, dict, float]:
        """One optimizer step over the micro-batches `batches` (this rank's share of them):
        (loss, tokens, per-TTT-step stat sums, gradient norm before clipping)."""
        cfg, params = self.cfg, self.params
        denom = self._denoms(batches)
        mine = [b for k, b in enumerate(batches) if k % self.world == self.rank]
        self.opt.zero_grad(set_to_none=True)
        agg = {"loss_sum": [0.0] * cfg.ttt_steps, "correct": [0.0] * cfg.ttt_steps, "count": [0.0] * cfg.ttt_steps, "loss_count": [0.0] * cfg.ttt_steps}
        n_tok, loss_val = 0, 0.0
        for idx in mine:
            loss, stats, nt = self._forward(idx, denom)
            loss.backward()
            loss_val += float(loss.detach())
            n_tok += nt
            for k in agg:
                agg[k] = [a + s for a, s in zip(agg[k], stats[k])]
        if self.world > 1:
            loss_val, n_tok, agg = self._allreduce(params, loss_val, n_tok, agg)
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        self.opt.step()
        self.sched.step()
        return loss_val, n_tok, agg, gnorm

    def _allreduce(self, params, loss_val, n_tok, agg):
        dist = self.dist
        # losses are globally normalized: the SUM is the full-batch gradient.  In place, one
        # collective per parameter (the draft has ~13), all in flight at once: no flat copy.
        works = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            works.append(dist.all_reduce(p.grad, async_op=True))
        for w in works:
            w.wait()
        keys = list(agg)
        stats = torch.tensor([loss_val, float(n_tok)] + [x for k in keys for x in agg[k]], dtype=torch.float64)
        dist.all_reduce(stats)
        s = stats.tolist()
        T = self.cfg.ttt_steps
        agg = {k: s[2 + i * T : 2 + (i + 1) * T] for i, k in enumerate(keys)}
        return s[0], int(s[1]), agg


def collate_mask(store: FeatureStore, idx: list[int], max_len: int) -> torch.Tensor:
    """Only the loss masks of a micro-batch (cheap: no hidden states read)."""
    masks = []
    for i in idx:
        e = store.entries[i]
        masks.append(store._open(e["shard"]).get_tensor(f"{e['key']}.loss_mask")[:max_len].long())
    T = max(m.numel() for m in masks)
    out = torch.zeros(len(masks), T, dtype=torch.long)
    for b, m in enumerate(masks):
        out[b, : m.numel()] = m
    return out


def summarize(per: list[dict]) -> dict:
    """Per-TTT-position loss/accuracy and the acceptance length they imply for chain drafting."""
    loss = [p["loss_sum"] / max(1.0, p["loss_count"]) for p in per]
    acc = [p["correct"] / max(1.0, p["count"]) for p in per]
    tau, run = 1.0, 1.0
    taus = []
    for a in acc:  # tau(k) = 1 + sum_i prod_{j<=i} acc_j  (step accuracies as conditional acceptances)
        run *= a
        tau += run
        taus.append(tau)
    return {"loss": loss, "acc": acc, "expected_tau": taus}


def prefix_keys(d: dict, p: str) -> dict:
    return {p + k: v for k, v in d.items()}


def _truncate_log(path: Path, step: int) -> None:
    """On resume, drop log lines past the checkpoint (they will be recomputed identically)."""
    if not path.exists():
        return
    from eaglenest.utils import read_jsonl_tolerant

    rows = read_jsonl_tolerant(path)  # a kill mid-append leaves a torn last line
    keep = [r for r in rows if r["step"] <= step]
    atomic_write_bytes(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep).encode())


_TB = {}


def _tensorboard(out: Path, rec: dict) -> None:
    """Mirror scalars to tensorboard when it is installed (optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:
        return
    w = _TB.get(out) or _TB.setdefault(out, SummaryWriter(str(out / "tb")))
    for k, v in rec.items():
        if isinstance(v, (int, float)):
            w.add_scalar(k, v, rec["step"])
        elif isinstance(v, list):
            for j, x in enumerate(v):
                w.add_scalar(f"{k}/{j}", x, rec["step"])
