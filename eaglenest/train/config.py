"""`TrainConfig`: every option of `eaglenest train`, declared once (the CLI is generated from it,
see eaglenest/config.py), and the rule of which options a `--resume` may not change."""

from __future__ import annotations

from dataclasses import dataclass

from eaglenest import EaglenestError
from eaglenest.config import option
from eaglenest.kinds.registry import get as get_kind
from eaglenest.kinds.registry import names as _draft_kinds
from eaglenest.train.losses import KINDS, LossSpec, normalize_loss

ATTN_CHOICES = ["auto", "eager", "chunked", "flex", "sdpa"]
WARMUP_SHARE, WARMUP_MIN = 0.03, 8  # the default warm-up (setup.warmup_steps): this share of the run, at least this many steps


@dataclass
class TrainConfig:
    model: str = option(help="target checkpoint directory or known name (smollm2)", metavar="TARGET")
    out: str = option(help="run directory", metavar="RUN_DIR")
    features: str | None = option(None, "feature store written by `eaglenest capture` (or --online --data DATA_DIR)",
                                  metavar="FEAT_DIR")
    # online training (train/online.py): the engine captures each step's micro-batches, no feature store
    online: bool = option(False, "capture each step's micro-batches with --engine while training, from --data, instead of "
                          "reading --features: no feature store is written. Epochs > 1 re-capture (no feature cache: "
                          "memory stays at the prefetch queue's, printed at start)")
    data: str | None = option(None, "with --online: DATA_DIR written by `eaglenest prepare`", metavar="DATA_DIR")
    engine: str = option("hf", "with --online: the engine that runs the target (hf: in this process, on --device; vllm, "
                         "sglang: servers, their flags below)", metavar="ENGINE")
    layers: str = option("auto", "with --online: aux layer ids, capture-before convention: auto (EAGLE-3's three; with "
                         "--draft-kind dflash: dflash = five spread over the depth), dflash, or i,j,k,...")
    capture_dtype: str = option("bf16", "with --online: the target's dtype in the engine (= the features' dtype)",
                                choices=["bf16", "fp32"])
    max_failures: int | None = option(None, "with --online: stop (checkpoint saved) once more training samples than this "
                                      "have failed (skipped samples: RUN_DIR/failures.jsonl)")
    online_timeout: float = option(600.0, "with --online: seconds the loop waits for a step's micro-batches before it "
                                   "stops (checkpoint saved) saying the engine is not answering (with --prefetch >= 1; "
                                   "set-up and evaluation captures are bounded by the engine's own timeouts); under "
                                   "torchrun every rank stops together: --dist-timeout is set above it")
    draft_kind: str = option("eagle3", "the draft to train: eagle3 (one layer, chain/tree drafting step by step, training-time "
                             "test) or dflash (a block drafter, arXiv 2602.06036: --draft-layers layers over the target states of "
                             "the store's layers, one forward per block of --block-size tokens)", choices=_draft_kinds)
    ttt_steps: int = option(7, "eagle3: unrolled draft steps (k) of training-time test")
    loss: str = option("ce", f"training loss: one of {', '.join(KINDS)} or a weighted mix 'ce:0.1,tv:0.9' (YAML: the same "
                       "string). ce = soft cross-entropy against the target renormalized over the draft vocabulary; tv = "
                       "1 - alpha, nla = -log alpha, lk_hybrid = lam*KL + (1-lam)*TV with lam = exp(-eta*alpha) (LK losses), "
                       "alpha = the acceptance probability at temperature 1 against the target's full-vocabulary "
                       "distribution (train/losses.py)", type=normalize_loss)
    lk_eta: float = option(3.0, "eta of lk_hybrid's lambda = exp(-eta * alpha)")
    step_decay: float = option(0.8, "weight of TTT step j's loss is step_decay^j")
    serve_steps: int = option(3, "draft steps the draft will be served with: the training log's predicted tau "
                              "(1 + sum_k prod_{j<=k} accept_j) is for this many (at most --ttt-steps; fewer TTT steps cap it)")
    block_size: int = option(16, "dflash: tokens per drafted block (the anchor + block_size - 1 drafted tokens; vLLM serves it "
                             "with num_speculative_tokens = block_size - 1)")
    draft_layers: int = option(1, "decoder layers of the draft (dflash: any number; eagle3: one, see draft/shape.py)")
    dflash_anchors: int = option(64, "dflash: anchor positions drawn per sample and step (each trains one block)")
    dflash_loss: str = option("ce", "dflash: ce = hard-label cross-entropy on the block's tokens, weighted by --dflash-decay; "
                              "dpace = D-PACE position weights (arXiv 2605.18810: the gradient of the expected accepted length)",
                              choices=["ce", "dpace"])
    dflash_decay: float | None = option(None, "dflash ce: block slot k weighs exp(-(k-1)/gamma); default the paper's gamma for the "
                                        "block size (7 for 16, 5 for 10, 4 for 8); 0 = no decay")
    dpace_alpha: float = option(0.5, "dflash dpace: smoothing of the draft's probabilities in the weights, in [0, 1]")
    dflash_qk_gain: float = option(2.0, "dflash: the q/k RMSNorm gains at the start (1 = a fresh norm): sharper initial "
                                   "attention, which the mask slots learn to aim sooner (draft/dflash.py sharpen_attention)")
    mask_token_id: int | None = option(None, "dflash: the target token whose embedding marks a masked slot (default: the "
                                       "tokenizer's mask token, else its last special token that is not a chat-template, bos, eos "
                                       "or pad token)")
    draft_vocab: int = option(32000, "draft vocabulary size (capped at the target's)")
    epochs: float = option(1.0, "passes over the training split")
    max_steps: int | None = option(None, "optimizer steps (overrides --epochs)")
    lr: float = option(1e-4, "peak learning rate (AdamW, beta2 0.95)")
    warmup_steps: int = option(0, f"linear warm-up steps (0: {WARMUP_SHARE:.0%} of the run, at least {WARMUP_MIN} "
                              "steps and at most a quarter of it)")
    min_lr_ratio: float = option(0.1, "cosine decay floor as a fraction of --lr")
    weight_decay: float = option(0.0, "AdamW weight decay of matrices")
    grad_clip: float = option(0.5, "gradient norm clip")
    batch_tokens: int = option(4096, "padded tokens per micro-batch")
    grad_accum: int = option(1, "micro-batches per optimizer step (global, over all ranks)")
    max_len: int = option(2048, "truncate samples to this many tokens")
    eval_fraction: float = option(0.02, "held-out share of samples (by id hash)")
    eval_every: int = option(0, "steps between held-out evals (0: ~10 per run)")
    eval_max_batches: int = option(8, "held-out micro-batches per eval")
    save_every: int = option(0, "checkpoint every N steps (0: by --save-every-min and at the end)")
    save_every_min: float = option(30.0, "checkpoint at least every this many minutes of training, so a crash loses at "
                                   "most that much (0: by --save-every and at the end only)")
    keep_checkpoints: int = option(3, "keep the newest N checkpoints, remove older ones (0: keep all)")
    dist_timeout: float = option(0.0, "under torchrun: seconds a rank waits in a collective before torch kills the job "
                                 "(0: auto = --online-timeout of online runs + 30 min for rank 0's evaluation and "
                                 "checkpoint); raise it when those take longer")
    seed: int = option(0, "seed of the initialization and of the data order")
    device: str = option("auto", "cpu, cuda, cuda:N or auto")
    dtype: str = option("auto", "auto: bf16 autocast on CUDA, fp32 on CPU; bf16 also pays on CPUs with AVX512-BF16/AMX",
                        choices=["auto", "bf16", "fp32"])
    init_head: str = option("auto", "lm_head/norm at the start: the target's rows and final norm, zero (every logit 0: the "
                            "first loss is ln(draft vocabulary)), or random; auto = target for eagle3, zero for dflash (train/setup.py "
                            "init_weights)", choices=["auto", "target", "zero", "random"])
    freeze_head: bool = option(False, "keep lm_head at the target's rows (faster; EAGLE-1 style)")
    fc_init: str = option("scaled", "fc init: scaled = whitened by the aux features' RMS; high = scaled + identity on the "
                          "high aux layer; random", choices=["scaled", "high", "random"])
    resume: bool = option(False, "continue from RUN_DIR's latest checkpoint (refused if the data order or the model would change)")
    overwrite: bool = option(False, "start over in a RUN_DIR that holds checkpoints (deletes them and metrics.jsonl)")
    log_every: int = option(1, "steps per metrics line")
    attn_impl: str = option("auto", "TTT attention: auto = flex on CUDA; on a CPU sdpa (torch's fused flash kernel) under bf16 "
                            "autocast, else eager (the materializing reference); chunked = flash-style in plain torch (all "
                            "compute the same function)", choices=ATTN_CHOICES)
    recompute: str = option("auto", "activation checkpointing of each TTT step (auto: on CUDA when activations would not fit)",
                            choices=["auto", "none", "layer"])
    logits_chunk: int = option(0, "rows of draft logits alive at once in the fused head + loss (0: 1024 on CPU, 4096 on "
                               "CUDA; fewer for a large draft vocabulary); no logits are kept for backward")
    prefetch: int = option(2, "optimizer steps of micro-batches read ahead of the loop (0: read in the loop)")
    loader_threads: int = option(1, "threads reading and collating prefetched micro-batches")
    report_to: str = option("jsonl", "metrics sink: jsonl (RUN_DIR/metrics.jsonl, always written) or tensorboard "
                            "(also RUN_DIR/tb; needs `pip install 'eaglenest[tensorboard]'`)", choices=["jsonl", "tensorboard"])
    fc_norm: bool = option(False, "EAGLE 3.1: an RMSNorm on each aux state before fc (exported as fc_norm: true, weights "
                           "fc_norm.{0,1,2}.weight; both engines serve it)")
    norm_output: bool = option(False, "EAGLE 3.1: the next draft step reads the post-norm state norm(h) instead of h, in training "
                               "and decoding (exported as norm_output: true; both engines serve it)")
    draft_attention: str = option("gqa", "the draft layer's attention: gqa = Llama attention (LlamaForCausalLMEagle3), mla = "
                                  "DeepSeek-V2 latent attention with a small latent KV cache (Eagle3DeepseekV2ForCausalLM; sizes "
                                  "from an MLA target's config, --draft-*-rank/-dim to change), auto = the target family's kind",
                                  choices=["gqa", "mla", "auto"])
    dry_run: bool = option(False, "print the draft's shape, parameter count and decoding-cache bytes per token for each "
                           "attention kind (gqa, mla; EAGLE 3.1 flags as given) from the target's config.json alone (no "
                           "weights, no features; built on the meta device), then stop")
    draft_shape: dict = option(default_factory=dict, help="draft layer overrides by field (num_attention_heads, num_key_value_heads, "
                               "head_dim, intermediate_size, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
                               "v_head_dim); the --draft-* flags set them", cli=False)
    extra: dict = option(default_factory=dict, help="free-form notes kept in RUN_DIR/config.json", cli=False)

    def validate(self) -> None:
        for name in ("ttt_steps", "draft_vocab", "batch_tokens", "grad_accum", "max_len", "draft_layers", "dflash_anchors"):
            if getattr(self, name) <= 0:
                raise EaglenestError(f"--{name.replace('_', '-')} must be positive (got {getattr(self, name)})")
        if not self.step_decay > 0:
            raise EaglenestError(f"--step-decay must be positive (got {self.step_decay})")
        if self.serve_steps <= 0:
            raise EaglenestError(f"--serve-steps must be positive (got {self.serve_steps})")
        self.loss_spec()  # a bad --loss / --lk-eta is refused before any work
        if not self.dflash_qk_gain > 0:
            raise EaglenestError(f"--dflash-qk-gain must be positive (got {self.dflash_qk_gain})")
        if not 0 <= self.eval_fraction < 1:
            raise EaglenestError(f"--eval-fraction must be in [0, 1) (got {self.eval_fraction})")
        if self.prefetch < 0 or self.loader_threads < 1:
            raise EaglenestError(f"--prefetch must be >= 0 and --loader-threads >= 1 (got {self.prefetch}, {self.loader_threads})")
        if self.online and (not self.data or self.features):
            raise EaglenestError("--online trains from --data DATA_DIR (prepared ids) through --engine; it takes no --features")
        if not self.online and (not self.features or self.data) and not self.dry_run:
            raise EaglenestError("--features FEAT_DIR is required (or --online --data DATA_DIR to capture while training)")
        if self.online_timeout <= 0 or (self.max_failures is not None and self.max_failures < 0):
            raise EaglenestError(f"--online-timeout must be positive and --max-failures >= 0 (got {self.online_timeout}, {self.max_failures})")
        if self.save_every < 0 or self.save_every_min < 0 or self.keep_checkpoints < 0 or self.dist_timeout < 0:
            raise EaglenestError(f"--save-every, --save-every-min, --keep-checkpoints and --dist-timeout must be >= 0 "
                                 f"(got {self.save_every}, {self.save_every_min}, {self.keep_checkpoints}, {self.dist_timeout})")
        if self.online and self.dist_timeout and self.dist_timeout <= self.online_timeout:
            raise EaglenestError(f"--dist-timeout {self.dist_timeout:g} must exceed --online-timeout {self.online_timeout:g}: "
                                 "a rank waits that long for a slow one before every rank stops with a checkpoint")
        if self.draft_kind not in _draft_kinds():
            raise EaglenestError(f"--draft-kind must be {' or '.join(_draft_kinds())} (got {self.draft_kind})")
        get_kind(self.draft_kind).check_train_options(self)  # what this kind cannot train
        if self.resume and self.overwrite:
            raise EaglenestError("--resume and --overwrite exclude each other")
        if self.freeze_head and self.head_init() != "target":
            raise EaglenestError("--freeze-head needs --init-head target (a frozen random or zero head learns nothing; "
                                 "--init-head auto is zero for dflash)")
        for name, allowed in (("attn_impl", ATTN_CHOICES), ("recompute", ["auto", "none", "layer"]),
                              ("init_head", ["auto", "target", "zero", "random"]),
                              ("fc_init", ["scaled", "high", "random"]), ("dtype", ["auto", "bf16", "fp32"]),
                              ("report_to", ["jsonl", "tensorboard"]), ("capture_dtype", ["bf16", "fp32"]),
                              ("draft_attention", ["gqa", "mla", "auto"])):
            if getattr(self, name) not in allowed:
                raise EaglenestError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)} (got {getattr(self, name)})")


    def head_init(self) -> str:
        """--init-head with auto resolved: the draft kind's (EAGLE-3: target, DFlash: zero; setup.init_weights)."""
        if self.init_head != "auto":
            return self.init_head
        return get_kind(self.draft_kind).default_init_head

    def loss_spec(self) -> LossSpec:
        return LossSpec.parse(self.loss, self.lk_eta)

    def predicted_steps(self) -> int:
        """The serve steps the training log predicts tau for: positions past --ttt-steps were never trained."""
        return min(self.serve_steps, self.ttt_steps)


# A resumed run replays the data order and continues the model and optimizer of its checkpoint:
# these options decide them, so `--resume` with a different value is refused (the model's shape
# is checked through the draft config, the target and the store through their fingerprints).
# The objective (--loss, --lk-eta, --step-decay) is NOT fixed: fine-tuning a ce-trained checkpoint
# with an LK loss (pure TV from scratch trains poorly, LK paper) is a plausible recipe; a resume
# that changes it says so (train/trainer.py) and config.json records the new one.
RESUME_FIXED = ("ttt_steps", "draft_vocab", "batch_tokens", "grad_accum", "max_len", "seed", "eval_fraction", "freeze_head",
                "fc_norm", "norm_output", "draft_attention", "draft_kind", "dflash_anchors")
