"""The training loop (EAGLE-3 and DFlash drafts), top to bottom: set-up from its pieces -> (resume) -> steps -> eval
-> checkpoints.

One optimizer step = `grad_accum` micro-batches (global, across ranks).  Each micro-batch's loss
is normalized by the *global* token count of its step, and gradients are summed across ranks
with one all-reduce, so N processes compute the same update as one process with the same global
batch.  Run state (model, optimizer, scheduler, RNG, step) is checkpointed by rank 0; the data
position is the step number (see data.py), so a resumed run replays exactly the same batches.

The pieces, each tested on its own: distributed.py (process group, collectives), setup.py
(vocabulary, model, teacher, optimizer, schedule), data.py + loader.py (order, prefetched
reading), online.py (the same data captured by an engine while training, `--online`),
checkpoint.py (run directory, checkpoints, resume rules), metrics.py (JSONL, TensorBoard),
objective.py (what a step minimizes per draft kind: ttt.py's training-time test for EAGLE-3, the
block objective for DFlash).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from eaglenest import EaglenestError
from eaglenest.capture.layers import require_layer_count
from eaglenest.draft.kernels import ATTN_IMPLS, causal_kernel, default_attn_impl
from eaglenest.draft.config import DraftConfig
from eaglenest.draft.vocab import draft_ids_to_target
from eaglenest.features import FeatureStore
from eaglenest.kinds.registry import get as get_kind
from eaglenest.train.checkpoint import Checkpointer, SavePolicy, check_resume
from eaglenest.train.config import RESUME_FIXED, TrainConfig
from eaglenest.train.data import SPLIT_RULE, Batch, Schedule, held_out_mask, split
from eaglenest.train.distributed import Distributed, collective_timeout
from eaglenest.train.loader import Prefetcher, StepData, StoreSource
from eaglenest.train.online import (
    FailureLog,
    OnlineData,
    OnlineSource,
    OnlineStop,
    describe_failures,
    engine_memory,
    make_engine,
    memory_line,
    queue_bytes,
)
from eaglenest.train.metrics import MetricsLog, describe_eval, prefix_keys, summarize
from eaglenest.train.setup import (
    build_draft,
    build_optimizer,
    build_scheduler,
    build_teacher,
    draft_vocab,
    fc_input_rms,
    lr_lambda,
    store_fingerprint,
    vocab_counts,
    warmup_steps,
)
from eaglenest.train.objective import make_objective
from eaglenest.train.precision import MasterWeights
from eaglenest.train.ttt import ALPHA_KEYS, STAT_KEYS, denominators
from eaglenest.utils import atomic_write_json, progress, read_json, release_free_heap

__all__ = ["ARGMAX_CACHE_TOKENS", "TrainConfig", "Trainer", "estimate_activation_bytes", "lr_lambda", "summarize"]

TRIM_EVERY = 20  # CPU steps between heap trims: ~2 % of the step time, RSS stays ~1/3 (git show 0c8d13e:bench/results/train_cpu_memory.json)
ARGMAX_CACHE_TOKENS = 1 << 28  # tokens: 1 GiB of int32 argmax (+1 GiB of fp32 log-mass for alpha losses): beyond, later epochs recompute


def has_loss_positions(b: Batch) -> bool:
    """Whether a micro-batch has a position whose loss counts (the TTT loss of step 0 predicts
    x_{t+2}: ttt.py).  Without one the loss has no graph; --max-len below the prepared length or
    `prepare --loss-on last` on a long conversation can leave a micro-batch so."""
    return bool(denominators(b.loss_mask, 1)[0] > 0)


def estimate_activation_bytes(cfg: DraftConfig, tokens: int, ttt: int) -> int:
    """Autograd-saved bytes of `tokens` tokens over `ttt` steps WITHOUT recompute, bf16 parameters and
    autocast: 30 H + 8 I + 512 bytes per token per step, a little above what autograd saves
    (the MLP's four bf16 [I] tensors; the rest the layer's hidden-sized ones;
    238 KB at the Llama-3.1-8B shape, 1.7 MB per token over 7 steps).  tests/test_fastpath.py holds
    it between the saved bytes and 1.2x them."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return int(tokens * ttt * (30 * H + 8 * I + 512))


class Trainer:
    def __init__(self, cfg: TrainConfig, engine=None, engine_args=None):
        """`--online` runs take their engine as `engine` (kept open) or create it from the engine
        flags in `engine_args` (an argparse namespace; None: the engine's defaults) and close it."""
        cfg.validate()
        self.cfg = cfg
        self.dist = Distributed(cfg.device, collective_timeout(cfg))
        self.rank, self.world = self.dist.rank, self.dist.world
        self.out = Path(cfg.out)
        self.device = self._device()
        self.autocast = self.device.startswith("cuda") if cfg.dtype == "auto" else cfg.dtype == "bf16"
        self.device_type = "cuda" if self.device.startswith("cuda") else "cpu"
        self.ckpt = Checkpointer(self.out, self.rank, keep=cfg.keep_checkpoints)
        self.saved_step = None  # the step of the checkpoint this process last wrote or loaded
        self.saves = SavePolicy(cfg.save_every, cfg.save_every_min)
        self.step_empty, self._warned_empty = 0, False  # micro-batches without a loss position: this step's (all ranks)
        self.engine, self._own_engine = engine, False
        self.failures = None  # online: RUN_DIR/failures.jsonl
        try:
            self._setup(engine_args)
        except BaseException:
            self.close_engine()
            raise

    def _setup(self, engine_args) -> None:
        from eaglenest.draft.shape import describe, draft_shape
        from eaglenest.models.target import load_config, target_facts, target_fingerprint
        from eaglenest.models.weights import target_head

        cfg = self.cfg
        kind = get_kind(cfg.draft_kind)
        resuming = cfg.resume and self.ckpt.latest() is not None

        # target and data: a feature store, or (online) prepared ids and an engine
        tcfg, tfp = load_config(cfg.model), target_fingerprint(cfg.model)
        if cfg.online:
            from eaglenest.data import PreparedData

            if cfg.layers == "auto":
                cfg.layers = kind.online_layers  # the layers the engine captures (capture/layers.py)

            data = PreparedData(cfg.data)
            self.ckpt.prepare(cfg.resume, cfg.overwrite)  # before an engine starts (a server takes minutes)
            store = self._open_online(data, engine_args)
        else:
            store = FeatureStore(cfg.features)
        self.store, meta = store, store.meta
        if meta.target_fingerprint != tfp or meta.hidden_size != tcfg.hidden_size:
            raise EaglenestError(
                f"feature store {cfg.features} was captured from {meta.target} (hidden {meta.hidden_size}, "
                f"{meta.num_layers} layers), not from {cfg.model} (hidden {tcfg.hidden_size}, {tcfg.num_hidden_layers} layers)"
            )
        if len(store) == 0:
            raise EaglenestError(f"{cfg.data if cfg.online else f'feature store {cfg.features}'} holds no samples")
        # a kind that reads a fixed number of target layers (the EAGLE-3 head's fc: three) refuses a store
        # of another count (a DFlash draft reads any number)
        if kind.aux_count is not None:
            require_layer_count(meta.layer_ids, kind.aux_count, kind.title,
                                "this online run's --layers" if cfg.online else f"feature store {cfg.features}")
        head = target_head(cfg.model)
        if not cfg.online:
            self.ckpt.prepare(cfg.resume, cfg.overwrite)  # after the checks above, before RUN_DIR is touched

        # vocabulary, model, teacher, attention kernel
        self.out.mkdir(parents=True, exist_ok=True)
        d2t, t2d = self._vocab(tcfg, resuming)
        rows = draft_ids_to_target(d2t)
        dcfg = kind.train_config(tcfg, d2t.numel(), meta.layer_ids, cfg)  # the target's shape + the kind's own fields
        if self.rank == 0:
            print(describe(draft_shape(target_facts(tcfg), cfg.draft_shape, cfg.draft_attention), target_facts(tcfg)), file=sys.stderr)
        self.identity = {"train": {k: getattr(cfg, k) for k in RESUME_FIXED}, "draft": dcfg.to_dict(), "split_by": SPLIT_RULE,
                         "target_fingerprint": tfp, "store_fingerprint": store_fingerprint(store)}
        if resuming:
            self._check_resume()
            self._note_objective()
        if cfg.online:
            self.failures = FailureLog(self.out)
            if self.rank == 0:
                self.failures.start(self.ckpt.latest_step() if resuming else 0)
            self.dist.barrier()  # the log is trimmed before any rank appends to it
        fc_rms = None
        if cfg.fc_init != "random" and not resuming:  # a resumed run loads fc from its checkpoint
            fc_rms = self._fc_rms(store) if self.rank == 0 else torch.zeros(len(meta.layer_ids) * meta.hidden_size)
            fc_rms = self.dist.broadcast_(fc_rms)  # only rank 0 reads samples that are not its own
        self.model = build_draft(dcfg, head, rows, d2t, t2d, seed=cfg.seed, init_head=cfg.head_init(), fc_init=cfg.fc_init,
                                 fc_rms=fc_rms, freeze_head=cfg.freeze_head, qk_gain=cfg.dflash_qk_gain).to(self.device)
        self.teacher = None if not kind.needs_teacher else build_teacher(  # DFlash trains on hard labels
            head, rows, t2d, pre_norm=meta.final_norm == "pre", norm_eps=head["norm_eps"], logit_softcap=head["logit_softcap"],
            bf16=self.autocast).to(self.device)
        self.attn_impl = default_attn_impl(self.device, self.autocast) if cfg.attn_impl == "auto" else cfg.attn_impl
        if self.attn_impl not in ATTN_IMPLS:
            raise EaglenestError(f"--attn-impl must be auto or one of {', '.join(ATTN_IMPLS)} (got {cfg.attn_impl})")
        try:
            self.attn = causal_kernel(self.attn_impl, self.device)  # flex keeps its compiled function and masks here
        except ValueError as e:  # a kernel this device cannot run (sdpa off the CPU): refused where kernels are made
            raise EaglenestError(f"--attn-impl {self.attn_impl}: {e}") from None

        # data: order (Schedule) and this rank's reads (StoreSource) or captures (OnlineSource)
        train_idx, self.eval_idx = split(store, cfg.eval_fraction, held=self._held_out(store))
        self.schedule = Schedule(store.lengths(), train_idx, cfg.batch_tokens, cfg.grad_accum, cfg.seed, cfg.max_len)
        self.eval_batches = Schedule(store.lengths(), self.eval_idx, cfg.batch_tokens, 1, 0, cfg.max_len).batches[: cfg.eval_max_batches] if self.eval_idx else []
        pin = self.device_type == "cuda"
        if cfg.online:
            self.source = OnlineSource(store, self.schedule, cfg.ttt_steps, cfg.max_len, self.rank, self.world, pin, self.failures)
        else:
            self.source = StoreSource(store, self.schedule, cfg.ttt_steps, cfg.max_len, self.rank, self.world, pin=pin)
        spe = self.schedule.steps_per_epoch
        self.total_steps = cfg.max_steps or max(1, int(round(cfg.epochs * spe)))
        self.warmup = warmup_steps(cfg.warmup_steps, self.total_steps)
        self.eval_every = cfg.eval_every or max(1, self.total_steps // 10)
        self.n_train_tokens = sum(store.lengths()[i] for i in train_idx)

        # optimizer and schedule
        # bf16 training: bf16 parameters, fp32 masters that the optimizer updates and checkpoints hold (precision.py)
        self.masters = MasterWeights(self.model) if self.autocast else None
        self.weights = self.masters or self.model  # what checkpoints read and write
        self.params = self.masters.params if self.masters else [p for p in self.model.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.params, cfg.lr, cfg.weight_decay)
        self.sched = build_scheduler(self.opt, self.warmup, self.total_steps, cfg.min_lr_ratio)
        self.step = 0
        # online: failed training samples so far (--max-failures counts those of a resumed run's earlier steps too)
        self.n_failed = sum(self.failures.summary(self.ckpt.latest_step()).get("train", {}).values()) if cfg.online and resuming else 0
        # EAGLE-3 caches the target's argmax (and log-mass) per micro-batch (host RAM) for later epochs:
        # only when a run sees its data more than once, and at most ARGMAX_CACHE_TOKENS tokens
        self.objective = make_objective(cfg, dcfg, teacher=self.teacher, device=self.device, autocast=self.autocast,
                                        attn=self.attn, recompute=self._recompute,
                                        argmax_room=ARGMAX_CACHE_TOKENS if self.total_steps > spe else 0)
        kind.bind_objective(self.objective, self.model)
        self.P = self.objective.positions  # per-position statistics (TTT steps or block slots)
        # the serve steps the log predicts tau for (a DFlash block drafts P tokens per round)
        self.serve_steps = kind.serve_steps(self.P, cfg)

        if resuming:
            self.step = self.saved_step = self.ckpt.load(self.weights, self.opt, self.sched)
        elif self.rank == 0:
            from safetensors.torch import save_file

            save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(self.out / "vocab.safetensors"))
        self.online_info = self._online_info() if cfg.online else None
        if self.rank == 0:
            atomic_write_json(self.out / "config.json", {
                "train": asdict(cfg), "draft": dcfg.to_dict(), "store": meta.to_dict(), "target": str(cfg.model),
                "identity": self.identity, "n_train_samples": len(train_idx), "n_eval_samples": len(self.eval_idx),
                "split_by": SPLIT_RULE,
                "n_train_tokens": self.n_train_tokens, "total_steps": self.total_steps, "steps_per_epoch": spe,
                "world_size": self.world, "draft_vocab_coverage": self._coverage(t2d),
                **({"online": self.online_info} if cfg.online else {}),
            })

    # --- online set-up (train/online.py) -----------------------------------------------------
    def _open_online(self, data, engine_args) -> OnlineData:
        if self.engine is None:
            self.engine, self._own_engine = make_engine(self.cfg, engine_args, self.device, self.rank, self.world), True
        return OnlineData(data, self.engine, self.cfg.capture_dtype)

    def _fc_rms(self, store) -> torch.Tensor | None:
        if not self.cfg.online:
            return fc_input_rms(store, normed=self.cfg.fc_norm)
        rms, failed = store.fc_input_rms(self.cfg.batch_tokens, normed=self.cfg.fc_norm)
        self.failures.record(failed, 0, self.rank, "setup")
        if rms is None and failed:  # not a silent random init: the engine is most likely unreachable
            raise EaglenestError(f"the engine delivered none of the first samples for the fc statistics "
                                 f"({failed[0].reason}: {failed[0].message[:300]}); see {self.failures.path}")
        return rms

    def _online_info(self) -> dict:
        """The run's memory, printed at start: the target (in this process for the hf engine), the
        draft with its optimizer state, the feature queue."""
        cfg = self.cfg
        mem = engine_memory(self.engine)
        q = queue_bytes(cfg.prefetch, cfg.grad_accum, self.world, cfg.batch_tokens, self.store.meta.hidden_size, cfg.capture_dtype)
        if self.rank == 0:
            print(memory_line(mem, self.model, q), file=sys.stderr)
        return {"engine": self.engine.name, "data": str(cfg.data), "engine_info": asdict(self.engine.info()),
                "memory": {**mem, "draft_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
                           "queue_bytes_max": q},
                "epochs_over_1": "re-capture (no feature cache)"}

    def close_engine(self) -> None:
        if self._own_engine and self.engine is not None:
            self.engine.close()
        self.engine, self._own_engine = None, False

    # --- set-up helpers --------------------------------------------------------------------
    def _device(self) -> str:
        from eaglenest.utils import resolve_device

        device = resolve_device(self.cfg.device)
        if device == "cuda" and self.world > 1:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
        return device

    def _vocab(self, tcfg, resuming: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's draft vocabulary: a resumed run's own; else from the store's token counts,
        counted by rank 0 (the other ranks read only their own samples) and broadcast."""
        path = self.out / "vocab.safetensors"
        self.counts = None
        if resuming and path.exists():
            from safetensors.torch import load_file

            v = load_file(str(path))
            return v["d2t"], v["t2d"]
        if self.rank != 0:
            counts = torch.zeros(tcfg.vocab_size, dtype=torch.int64)
        else:  # online: DATA's loss-masked token counts, the counts of a complete store
            counts = self.store.token_counts(tcfg.vocab_size) if self.cfg.online else vocab_counts(self.store, tcfg.vocab_size)
        self.counts = self.dist.broadcast_(counts)
        return draft_vocab(self.counts, self.cfg.draft_vocab, self.cfg.model)

    def _held_out(self, store) -> torch.Tensor:
        """The held-out samples (train/data.py held_out_mask: by normalized prompt), found by rank 0 (the
        other ranks read only their own samples) and broadcast."""
        held = torch.zeros(len(store), dtype=torch.int64)
        if self.rank == 0 and self.cfg.eval_fraction > 0:
            from transformers import AutoTokenizer

            from eaglenest.models.target import resolve_model_path

            path = resolve_model_path(self.cfg.model)
            tok = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
            held = held_out_mask(store, self.cfg.eval_fraction, tok).to(torch.int64)
        return self.dist.broadcast_(held).bool()

    def _note_objective(self) -> None:
        """A resume may change the objective (fine-tuning with another loss): said, not refused."""
        p = self.out / "config.json"
        old = read_json(p, "run config").get("train", {}) if p.exists() else {}
        keys = ("loss", "lk_eta", "step_decay")
        was = {k: old.get(k, d) for k, d in zip(keys, ("ce", 3.0, 0.8))}  # runs from before these options: their values
        now = {k: getattr(self.cfg, k) for k in keys}
        if was != now and self.rank == 0:
            print(f"resume: the objective changes from {was} to {now} (continuing the checkpoint's model and optimizer)",
                  file=sys.stderr)

    def _check_resume(self) -> None:
        p = self.out / "config.json"
        if not p.exists():
            return
        saved = read_json(p, "run config")
        ident = saved.get("identity") or {"train": {k: saved.get("train", {}).get(k) for k in RESUME_FIXED}, "draft": saved.get("draft", {})}
        if ident.get("draft"):  # a run from before a draft field existed had its default (e.g. fc_norm false)
            ident = {**ident, "draft": DraftConfig.from_dict(ident["draft"]).to_dict()}
        check_resume(ident, self.identity, self.out)

    def _coverage(self, t2d) -> float | None:
        c = self.counts
        if c is None or c.sum() == 0:
            return None
        return float(c[t2d].sum() / c.sum())

    def save(self) -> Path | None:
        """Rank 0 checkpoints the current step (None on the other ranks); a step already saved
        (a stop right after a periodic save or a resume) is not written again."""
        if self.saved_step == self.step:
            return self.ckpt.latest() if self.rank == 0 else None
        d = self.ckpt.save(self.step, self.total_steps, self.weights, self.opt, self.sched)
        self.saved_step = self.step
        self.saves.reset()
        return d

    # --- one micro-batch -------------------------------------------------------------------
    def _forward(self, b: Batch, key: tuple, denom: torch.Tensor, step: int | None, want_alpha: bool = False):
        """(loss, per-position stats, tokens) of one micro-batch: the draft kind's objective (objective.py);
        `step` seeds what it samples (None: the held-out evaluation's fixed draw)."""
        return self.objective.forward(self.model, b, key, denom, step, want_alpha=want_alpha)

    def _recompute(self, tokens: int) -> bool:
        if self.cfg.recompute != "auto":
            return self.cfg.recompute == "layer"
        if self.device_type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        return estimate_activation_bytes(self.model.cfg, tokens, self.cfg.ttt_steps) > 0.5 * free

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        if not self.eval_batches:
            return None
        self.model.eval()
        per = [dict.fromkeys(STAT_KEYS + (ALPHA_KEYS if self.teacher is not None else ()), 0.0) for _ in range(self.P)]
        for idx in self.eval_batches:
            b = self.source.load_batch(idx, self.step) if self.cfg.online else self.source.load_batch(idx)
            if b is None:  # online: none of its samples arrived (recorded)
                continue
            key = tuple(idx) if b.input_ids.shape[0] == len(idx) else None  # online: not all arrived, no argmax cache
            # held-out: step None = the objective's fixed evaluation draw (the same anchors at every eval)
            _, stats, _ = self._forward(b, key, self.objective.denominators(b, None), None, want_alpha=True)
            for j in range(self.P):
                for k in per[j]:
                    per[j][k] += stats[k][j]
        self.model.train()
        # which samples these statistics (expected_tau too) are measured on: the logs and final.json say it
        return {**summarize(per, self.serve_steps), "split": f"held-out: {len(self.eval_idx)} samples, by {SPLIT_RULE}"}

    # --- the loop --------------------------------------------------------------------------
    def fit(self) -> dict:
        try:
            return self._fit()
        finally:
            self.close_engine()

    def _fit(self) -> dict:
        cfg = self.cfg
        self.model.train()
        log = MetricsLog(self.out, cfg.report_to) if self.rank == 0 else None
        if log:
            log.start(self.step)
        bar = progress(total=self.total_steps, initial=self.step, desc="train", unit="step") if self.rank == 0 else None
        t_start, tok_seen = time.time(), 0
        last_eval, stop, crash = None, None, None
        self.saves.reset()  # --save-every-min counts training time, from here
        try:
            with Prefetcher(self.source, cfg.prefetch, cfg.loader_threads, end=self.total_steps) as loader:
                while self.step < self.total_steps:
                    t_wait = time.perf_counter()
                    data = self._next(loader)
                    t_wait = time.perf_counter() - t_wait
                    loss_val, n_tok, agg, gnorm = self.optimizer_step(data)
                    self.step += 1
                    tok_seen += n_tok
                    if log:
                        rec = {"step": self.step, "epoch": data.epoch, "lr": self.sched.get_last_lr()[0], "loss": loss_val,
                               "grad_norm": gnorm, "tokens": n_tok, "data_wait_s": round(t_wait, 4),
                               "empty_micro_batches": self.step_empty}
                        if n_tok == 0:
                            rec["skipped"] = True  # online: none of the step's samples arrived (failures.jsonl)
                        rec.update(prefix_keys(summarize([{k: agg[k][j] for k in agg} for j in range(self.P)],
                                                         self.serve_steps), "train_"))
                        rec["train_split"] = "train: this step's micro-batches"  # train_expected_tau's data
                        rec["tokens_per_s"] = tok_seen / max(1e-9, time.time() - t_start)
                        if self.step % self.eval_every == 0 or self.step == self.total_steps:
                            last_eval = self.evaluate()
                            if last_eval:
                                rec.update(prefix_keys(last_eval, "eval_"))
                                bar.write(f"step {self.step}: {describe_eval(last_eval)}", file=sys.stderr)
                        log.log(rec)
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss_val:.3f}", acc0=f"{rec['train_acc'][0]:.2f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                    if self.device_type == "cpu" and self.step % TRIM_EVERY == 0:
                        release_free_heap()
                    if self.step < self.total_steps and self.saves.due(self.step):
                        self.save()
        except OnlineStop as e:
            stop = e
        except (Exception, KeyboardInterrupt) as e:  # any error that ends the run: checkpoint the steps done first
            crash = e
        finally:
            if log:
                log.close()
            if bar:
                bar.close()
        if crash is not None:
            self._stop_on_error(crash)
        final = self.save()
        if stop is not None:  # every rank gets here at the same step (_online_check)
            self.dist.barrier()
            self.dist.close()
            raise EaglenestError(f"online training stopped: {stop}. Checkpoint {final or 'saved by rank 0'} holds the "
                                 f"{self.step} steps done: re-run the same command with --resume to continue from there")
        online = self._online_summary() if cfg.online and self.rank == 0 else None
        if self.rank == 0:
            from eaglenest.train.plots import plot_run

            plot_run(self.out)
            atomic_write_json(self.out / "final.json", {"step": self.step, "checkpoint": str(final), "eval": last_eval,
                                                        "empty_micro_batches": self._empty_summary(),
                                                        **({"online": online} if online else {})})
        self.dist.barrier()  # every rank returns once rank 0's final checkpoint is complete
        self.dist.close()
        return {"step": self.step, "eval": last_eval, "checkpoint": final}

    def _stop_on_error(self, e: BaseException) -> None:
        """An error ended the loop after step `self.step`: rank 0 checkpoints that step, every rank
        says where it is and how to continue, and the error goes on (its traceback intact)."""
        try:
            final = self.save()
        except Exception as save_error:
            raise save_error from e
        where = final or f"{self.ckpt.dir / 'latest.json'} (rank 0 writes checkpoints)"
        print(f"training stopped at step {self.step} by {type(e).__name__}: {e}. Checkpoint {where} holds the steps done: "
              "once the cause is fixed, re-run the same command with --resume to continue from there", file=sys.stderr)
        raise e

    def _note_empty(self, n_empty: int) -> None:
        """Micro-batches without a loss position (no assistant token left within --max-len): trained
        on without them, counted per step (metrics.jsonl) and in all (final.json); warned once."""
        self.step_empty = n_empty
        if n_empty and self.rank == 0 and not self._warned_empty:
            self._warned_empty = True
            print(f"warning: step {self.step + 1}: {n_empty} of its micro-batches have no loss position (no assistant token "
                  f"within --max-len {self.cfg.max_len}): they add nothing to the update; counted as empty_micro_batches "
                  "in metrics.jsonl and final.json", file=sys.stderr)

    def _empty_summary(self) -> int:
        """Rank 0: the run's empty micro-batches (its resumed parts too: metrics.jsonl), printed when any."""
        from eaglenest.utils import read_jsonl_tolerant

        n = sum(r.get("empty_micro_batches", 0) for r in read_jsonl_tolerant(self.out / "metrics.jsonl"))
        if n:
            print(f"train: {n} micro-batches had no loss position (no assistant token within --max-len {self.cfg.max_len}) "
                  "and added nothing to their steps (per step: metrics.jsonl empty_micro_batches)", file=sys.stderr)
        return n

    def _next(self, loader) -> StepData:
        """The step's data; online, after the ranks' verdict on it."""
        if not self.cfg.online:
            return loader.get(self.step)
        data, err, exc = None, None, None
        try:
            data = loader.get(self.step, timeout=self.cfg.online_timeout)
        except TimeoutError:
            err = (f"step {self.step + 1}: its micro-batches did not arrive within --online-timeout "
                   f"{self.cfg.online_timeout:.0f} s: the engine is not answering")
        except Exception as e:  # noqa: BLE001 -- the other ranks must hear of it before anyone stops
            err, exc = f"step {self.step + 1}: capture failed: {e}", e
        return self._online_check(data, err, exc)

    def _online_check(self, data: StepData | None, err: str | None, exc: Exception | None) -> StepData:
        """Every rank's facts about this step, summed over ranks, decide for all of them at once (a
        rank that stopped alone would leave the others waiting in the step's all-reduce): stop
        (OnlineStop) when a rank's engine failed or timed out, when the engine delivered none of the
        step's samples for a transient reason (unreachable), or past --max-failures.  A step none of
        whose samples arrived for reasons of their own (e.g. wrong echoes) goes on, empty: no update
        (optimizer_step), the schedule moves on."""
        from collections import Counter

        from eaglenest.engines.http import RETRYABLE

        fails = data.failures if data is not None else []
        v = torch.tensor([data.n_samples if data is not None else 0, len(fails), sum(f["reason"] in RETRYABLE for f in fails),
                          int(err is not None)], dtype=torch.float64)
        n, n_failed, n_transient, n_err = (self.dist.sum(v) if self.world > 1 else v).tolist()
        self.n_failed += int(n_failed)
        step, cfg = self.step + 1, self.cfg
        if exc is not None and not isinstance(exc, EaglenestError):
            raise exc  # a bug, not the engine's weather: its traceback
        if n_err:
            raise OnlineStop(err or f"step {step}: another rank's micro-batches did not arrive (its log says why)")
        reasons = ", ".join(f"{k}: {c}" for k, c in sorted(Counter(f["reason"] for f in fails).items()))
        if n == 0 and n_transient:
            raise OnlineStop(f"step {step}: the engine delivered none of the step's samples ({int(n_failed)} failed; "
                             f"{reasons or 'on another rank'}): is the server up?")
        if cfg.max_failures is not None and self.n_failed > cfg.max_failures:
            raise OnlineStop(f"{self.n_failed} failed samples exceed --max-failures {cfg.max_failures} (this step: {reasons or 'none here'})")
        if n == 0 and self.rank == 0:
            print(f"warning: online step {step}: none of its samples arrived ({reasons}): no update", file=sys.stderr)
        return data

    def _online_summary(self) -> dict:
        from eaglenest.engines.http import describe

        failures = self.failures.summary(self.step)
        requests = self.engine.request_stats()
        print(f"online: {describe_failures(failures)} (RUN_DIR/failures.jsonl)"
              + (f"; engine requests of rank 0: {describe(requests)}" if requests else ""), file=sys.stderr)
        return {"failures": failures, "requests": {k: v for k, v in requests.items() if k != "records"} if requests else None}

    def _step_denominators(self, data: StepData) -> torch.Tensor:
        """This rank's loss normalizers of the step: the loader's TTT ones for EAGLE-3, else the objective's."""
        return get_kind(self.model.cfg.kind).step_denominators(self.objective, data, self.step)

    def optimizer_step(self, data: StepData) -> tuple[float, int, dict, float]:
        """One optimizer step over this rank's micro-batches of a step (`self.source.load(step)`):
        (loss, tokens, per-TTT-step stat sums, gradient norm before clipping), summed over ranks."""
        cfg, params = self.cfg, self.params
        denom = self._step_denominators(data)
        denom = self.dist.sum(denom) if self.world > 1 else denom  # every rank's tokens count
        self.opt.zero_grad(set_to_none=True)
        agg = {k: [0.0] * self.P for k in STAT_KEYS + (ALPHA_KEYS if self.objective.needs_alpha else ())}
        n_tok, loss_val, n_empty = 0, 0.0, 0
        for b, key in zip(data.batches, data.keys):
            n_tok += b.n_tokens
            if not has_loss_positions(b):  # no graph to backward: this rank still joins the step's collectives
                n_empty += 1
                continue
            loss, stats, _ = self._forward(b, key, denom, self.step)
            loss.backward()
            loss_val += float(loss.detach())
            for k in agg:
                agg[k] = [a + s for a, s in zip(agg[k], stats[k])]
        if self.world > 1:
            loss_val, n_tok, agg, n_empty = self._allreduce(params, loss_val, n_tok, agg, n_empty)
        self._note_empty(n_empty)
        if n_tok == 0 or not float(denom.sum()):
            # online: none of the step's samples arrived; or no loss position in any of them: no update on any rank
            # (AdamW's moments untouched, as one process whose gradients are all None)
            self.sched.step()
            return loss_val, n_tok, agg, 0.0
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        self.opt.step()
        if self.masters:
            self.masters.sync()
        self.sched.step()
        return loss_val, n_tok, agg, gnorm

    def _allreduce(self, params, loss_val, n_tok, agg, n_empty=0):
        # losses are globally normalized: the SUM of the ranks' gradients is the full-batch gradient
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.dist.all_reduce_sum_([p.grad for p in params])
        keys = list(agg)
        stats = torch.tensor([loss_val, float(n_tok), float(n_empty)] + [x for k in keys for x in agg[k]], dtype=torch.float64,
                             device=self.dist.device)
        self.dist.all_reduce_sum_([stats])
        s = stats.tolist()
        T = self.P
        return s[0], int(s[1]), {k: s[3 + i * T : 3 + (i + 1) * T] for i, k in enumerate(keys)}, int(s[2])
