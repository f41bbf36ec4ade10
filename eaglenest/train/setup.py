"""The pieces a training run is built from, each usable (and tested) on its own:
the draft vocabulary, the draft model and its initialization, the teacher head, the optimizer and
its schedule, and the fingerprints that say which data and model a run belongs to."""

from __future__ import annotations

import math

import torch

from eaglenest import EaglenestError
from eaglenest.draft import draft_model
from eaglenest.draft.config import DraftConfig
from eaglenest.draft.model import Eagle3Draft
from eaglenest.draft.vocab import build_vocab
from eaglenest.kinds.registry import get as get_kind
from eaglenest.features import FeatureStore
from eaglenest.train.config import WARMUP_MIN, WARMUP_SHARE
from eaglenest.train.ttt import Teacher
from eaglenest.utils import sha256_text


# --- vocabulary ---------------------------------------------------------------------------------
def vocab_counts(store: FeatureStore, vocab_size: int) -> torch.Tensor:
    """Token frequencies under the loss mask, from the store itself (exactly the training data)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in range(len(store)):
        ids, m = store.input_ids(i).long(), store.loss_mask(i).bool()
        counts += torch.bincount(ids[m], minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocab(counts: torch.Tensor, k: int, model) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's draft vocabulary (every kind): the `k` most frequent tokens of `counts`, the stop ids
    always (eos_token_ids).  When the data holds fewer than k distinct tokens, the filler slots take
    never-seen tokens lowest id first (a BPE vocabulary lists its merges in the order learned, most
    frequent first) but no special token and no id past the tokenizer's last (rows no text
    produces): their target-initialized rows start with the largest logits (SmolLM2's specials
    ~171 where the median token has 38), and a draft that has to unlearn them first learns late."""
    from transformers import AutoTokenizer

    from eaglenest.models.target import eos_token_ids, resolve_model_path, special_token_ids

    path = resolve_model_path(model)
    if not (path / "tokenizer_config.json").exists():  # a target without a tokenizer: no special token to know
        return build_vocab(counts, k, always=eos_token_ids(path))
    tok = AutoTokenizer.from_pretrained(path)
    excluded = sorted(special_token_ids(tok) | set(range(len(tok), counts.numel())))
    return build_vocab(counts, k, always=eos_token_ids(path, tok), filler_excluded=excluded)


# --- model --------------------------------------------------------------------------------------
FC_RMS_SAMPLES = 32  # the first samples (in store order) the fc init statistics come from


def fc_input_rms(store: FeatureStore, n_samples: int = FC_RMS_SAMPLES, normed: bool = False) -> torch.Tensor | None:
    """RMS of each fc input feature over the first samples, the first token (attention sink) left out."""
    return aux_rms((store[i]["aux_hidden_states"] for i in range(min(n_samples, len(store)))), normed)


def aux_rms(auxes, normed: bool = False) -> torch.Tensor | None:
    """RMS of each aux feature over these samples' aux states ([T, 3H] each), first tokens left out.
    `normed`: of what fc reads behind EAGLE 3.1's fc_norm at its init (each H-wide aux state of a
    token divided by its own RMS), so the scaled fc init whitens the inputs it will really get."""
    acc, n = None, 0
    for aux in auxes:
        a = aux[1:].float()
        if normed:
            a = torch.cat([c * c.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt() for c in a.chunk(3, dim=-1)], dim=-1)
        acc = a.pow(2).sum(0) if acc is None else acc + a.pow(2).sum(0)
        n += a.shape[0]
    return (acc / n).sqrt().clamp_min(1e-3) if n else None


def build_draft(dcfg: DraftConfig, head: dict, rows: torch.Tensor, d2t, t2d, *, seed: int, init_head: str, fc_init: str,
                fc_rms: torch.Tensor | None, freeze_head: bool, qk_gain: float = 1.0) -> Eagle3Draft:
    """The draft (of `dcfg.kind`) with the run's initialization (a pure function of its arguments)."""
    torch.manual_seed(seed)
    model = draft_model(dcfg, embed_weight=head["embed"].float())
    init_weights(model, head, rows, init_head, qk_gain)
    init_fc(model, fc_init, fc_rms)
    if freeze_head:
        model.lm_head.weight.requires_grad_(False)
    model.set_vocab(d2t, t2d)
    return model


def init_weights(model: Eagle3Draft, head: dict, rows: torch.Tensor, how: str, qk_gain: float = 1.0) -> None:
    """Linear layers N(0, 0.02); the head per `how` (TrainConfig.head_init):
      * target: the target's lm_head rows and final norm (the EAGLE-3 head starts in the target's
        output space: its fused input is the target's own states);
      * zero: lm_head 0 (the norm a fresh one): every draft-vocabulary logit 0, so the first loss is
        exactly ln(draft vocabulary).  DFlash's default: its mask slots start as the mask token's
        embedding, which the target's norm and head read as a special token (SmolLM2: 104-128 nats
        at the first step where uniform costs 7.6; the first full-rate steps went into undoing it);
      * random: lm_head N(0, 0.02), norm 1.
    A DFlash draft's q/k norms start at `qk_gain` (--dflash-qk-gain; draft/dflash.py sharpen_attention)."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            torch.nn.init.normal_(mod.weight, std=0.02)
    get_kind(model.cfg.kind).init_model(model, qk_gain)  # e.g. DFlash's q/k gains
    with torch.no_grad():
        if how == "target":
            model.lm_head.weight.copy_(head["lm_head"].float()[rows])
            model.norm.weight.copy_(head["norm"].float())
        elif how == "zero":
            model.lm_head.weight.zero_()
        elif how != "random":
            raise EaglenestError(f"--init-head must be target, zero or random (got {how})")


@torch.no_grad()
def init_fc(model: Eagle3Draft, how: str, rms: torch.Tensor | None) -> None:
    """Targets have massive activations (SmolLM2: a few dims of layer 15/27 reach 10^2-10^4), so
    a plain N(0, 0.02) fc lets those dims dominate the draft's residual stream and its output,
    and hundreds of steps go into unlearning them.  Dividing each input column by its RMS
    (`fc_input_rms`) is the same architecture with whitened inputs (a pure re-parametrization
    of the initial point)."""
    if how == "random" or rms is None:
        return
    if how not in ("scaled", "high"):
        raise EaglenestError(f"--fc-init must be scaled, high or random (got {how})")
    fc = model.fc.weight
    fc.copy_(torch.randn_like(fc) * (1.0 / fc.shape[1]) ** 0.5 / rms.to(fc))
    if how == "high":  # start from the high aux layer itself: the draft's output begins as a logit lens
        H = fc.shape[0]
        fc[:, -H:] += torch.eye(H, dtype=fc.dtype, device=fc.device)


def build_teacher(head: dict, rows, t2d, *, pre_norm: bool, norm_eps: float, bf16: bool, logit_softcap: float | None = None) -> Teacher:
    dtype = torch.bfloat16 if bf16 else torch.float32
    return Teacher(
        norm_weight=head["norm"].float() if pre_norm else None,
        norm_eps=norm_eps,
        logit_softcap=logit_softcap,
        lm_head=head["lm_head"].to(dtype),  # bf16 on CUDA: no resident fp32 copy (2 GB at 8B)
        draft_rows=rows,
        t2d=t2d,
        matmul_dtype=dtype,
    )


# --- optimizer and schedule ---------------------------------------------------------------------
def build_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, beta2 0.95; weight decay on matrices only; torch's fused kernel where it has one (CPU and
    CUDA fp32 parameters: ~5x faster than the per-tensor loop on a 2-core CPU)."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in params)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=fused or None)


def warmup_steps(requested: int, total: int) -> int:
    """--warmup-steps, or (0) the default.  A floor, because the share of a short run is one or two
    steps, and the first full-rate steps of a fresh draft go into undoing its start."""
    if requested:
        return int(requested)
    return max(1, min(max(WARMUP_MIN, int(WARMUP_SHARE * total)), total // 4))


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to `min_ratio` of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    prog = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))


def build_scheduler(opt, warmup: int, total: int, min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup, total, min_ratio))


# --- identity -----------------------------------------------------------------------------------
def store_fingerprint(store) -> str:
    """The store's setup (target, layers, dtype, ...) and its samples in order: what the data
    order of a run is a function of.  An online run's data (train/online.py) has the same three
    facts, so it gets the fingerprint of the store a complete capture of its DATA would write.  Which
    engine, and in which compute dtype, computed the states does not change the order (and runs from
    before store.json recorded the compute dtype keep their fingerprints)."""
    m = store.meta.to_dict()
    parts = [repr(sorted((k, repr(v)) for k, v in m.items() if k not in ("target", "engine", "compute_dtype")))]
    parts += [f"{i}:{n}" for i, n in zip(store.ids(), store.lengths())]
    return sha256_text("\n".join(parts))[:16]
