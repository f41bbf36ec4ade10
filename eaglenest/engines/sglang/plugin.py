"""eaglenest's capture plugin for SGLang (targets SGLang 0.5.23; see docs/sglang.md).

This file is self-contained (stdlib + torch + safetensors; `sglang` is imported lazily): `eaglenest
sglang-plugin install` copies it into the SGLang environment as the top-level module
`eaglenest_sglang_capture`, with an entry point in SGLang's general-plugin group
`sglang.srt.plugins` (SGLang 0.5.23 `sglang/srt/plugins/__init__.py` `load_plugins()`, called at the
start of every server process, scheduler included).  The plugin is inert unless the server is
started with `EAGLENEST_SGLANG_CAPTURE_DIR` set.

What it does inside the scheduler (TP) process:

  * when `sglang.srt.models.llama` / `sglang.srt.models.deepseek_v2` is imported, the class methods
    `LlamaModel.forward` and `DeepseekV2Model.forward` are wrapped (an AROUND hook; the original is
    kept as `__wrapped__`).  The wrapper returns exactly what the original returns and never touches
    `capture_aux_hidden_states` / `layers_to_capture`, so the server's own EAGLE-3 serving keeps
    working.
  * only for a prefill batch (`forward_batch.forward_mode` EXTEND or MIXED) that holds requests whose
    rid starts with the capture prefix (default `eaglenest-cap-`), it registers, for the duration of
    that one forward, a forward pre-hook on each aux decoder layer that hands the layer SGLang's own
    aux-capture argument -- `capture_output=` (a callback, Llama) or
    `captured_last_layer_outputs=` (a collector, DeepseekV2) -- chained with SGLang's when SGLang
    captures that layer too.  SGLang's layer then gives it the residual stream *entering* the layer
    (`hidden_states + residual`, materialized by `attn_boundary.prepare`), exactly the value
    SGLang's own EAGLE-3 capture stores.  The final (post-norm) state is the first output of the
    model forward.
  * rows are sliced per request (`extend_seq_lens_cpu`, `extend_prefix_lens_cpu`, `rids`), copied to
    the host and written by a background thread as one safetensors file per request and prefill
    chunk, `<rid>.<start:09d>.safetensors` (temp file + rename), with metadata (rid, start, token
    count, layer ids, dtype, SGLang version).  The client matches files to requests by rid, checks
    that the chunks cover the prompt from token 0 (a radix-cache hit shows up as a missing start)
    and that the stored `input_ids` equal what it sent.
  * whatever cannot be observed is reported as `<rid>.error.json` instead of writing partial data:
    an aux layer that runs under two-batch overlap (DeepseekV2 `forward_batch.can_run_tbo`: layers
    from `first_k_dense_replace` on run through `model_forward_stages`, which takes no capture
    argument), a layer that never reported its input, pipeline parallelism, an unexpected row layout.

Only tensor-parallel rank 0 writes.  Prefill CUDA graphs must be off
(`--cuda-graph-backend-prefill disabled`): a replayed graph runs no Python hooks, so nothing would
be written (the client then fails the sample with `staging_missing`).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import logging
import os
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass, field

PLUGIN_VERSION = "1"
TARGET_SGLANG_VERSION = "0.5.23"
MODULE_NAME = "eaglenest_sglang_capture"
DIST_NAME = "eaglenest-sglang-capture"
ENTRY_POINT_GROUP = "sglang.srt.plugins"  # sglang/srt/plugins/__init__.py GENERAL_PLUGINS_GROUP
ENTRY_POINT_NAME = "eaglenest_capture"
ENV_DIR = "EAGLENEST_SGLANG_CAPTURE_DIR"
ENV_LAYERS = "EAGLENEST_SGLANG_LAYERS"  # capture-before ids "a,b,c,..." (any count); default [2, N//2, N-3]
ENV_RID_PREFIX = "EAGLENEST_SGLANG_RID_PREFIX"
ENV_CPU_LAUNCHER = "EAGLENEST_SGLANG_CPU_LAUNCHER"  # probe: prepare the process as eaglenest's CPU launcher does
DEFAULT_DIR = "/dev/shm/eaglenest"
DEFAULT_RID_PREFIX = "eaglenest-cap-"
DUMP_FORMAT = "eaglenest-sglang-capture"
MARKER_FILE = "eaglenest-plugin.json"
_RID_OK = re.compile(r"^[A-Za-z0-9._-]{1,200}$")

log = logging.getLogger("eaglenest_sglang_capture")


# ----------------------------------------------------------------------------- model classes


@dataclass(frozen=True)
class ModelSpec:
    """One SGLang model class the plugin observes (facts from SGLang 0.5.23's source)."""

    name: str
    module: str  # where the class lives
    cls: str  # the model (not ForCausalLM) class whose forward is wrapped
    layer_cls: str  # its decoder layer class
    capture_kwarg: str  # decoder-layer forward argument that carries SGLang's own aux capture
    capture_index: int  # its position if it were passed positionally (then it cannot be injected)
    collector: bool  # True: an object with .capture(value, owned=...); False: a callable


LLAMA = ModelSpec("llama", "sglang.srt.models.llama", "LlamaModel", "LlamaDecoderLayer", "capture_output", 3, False)
QWEN2 = ModelSpec("qwen2", "sglang.srt.models.qwen2", "Qwen2Model", "Qwen2DecoderLayer", "capture_output", 3, False)
# Qwen3Model subclasses Qwen2Model but has its own forward (its layers take post_residual_addition first)
QWEN3 = ModelSpec("qwen3", "sglang.srt.models.qwen3", "Qwen3Model", "Qwen3DecoderLayer", "capture_output", 4, False)
# Qwen3MoeModel inherits Qwen2MoeModel.forward, which hands its layers the collector
# `captured_last_layer_outputs=` (and under two-batch overlap runs every layer in model_forward_stages)
QWEN3_MOE = ModelSpec("qwen3_moe", "sglang.srt.models.qwen3_moe", "Qwen3MoeModel", "Qwen3MoeDecoderLayer",
                      "captured_last_layer_outputs", 3, True)
DEEPSEEK_V2 = ModelSpec("deepseek_v2", "sglang.srt.models.deepseek_v2", "DeepseekV2Model", "DeepseekV2DecoderLayer",
                        "captured_last_layer_outputs", 7, True)

# HF `architectures` SGLang 0.5.23 serves with those model classes (each file's EntryClass; the Llama
# subclasses and MistralForCausalLM build a LlamaModel)
ARCHITECTURES = {
    "LlamaForCausalLM": LLAMA, "MistralForCausalLM": LLAMA, "Phi3ForCausalLM": LLAMA, "InternLM3ForCausalLM": LLAMA,
    "IQuestCoderForCausalLM": LLAMA,
    "Qwen2ForCausalLM": QWEN2, "Qwen3ForCausalLM": QWEN3, "Qwen3MoeForCausalLM": QWEN3_MOE,
    "DeepseekV2ForCausalLM": DEEPSEEK_V2, "DeepseekV3ForCausalLM": DEEPSEEK_V2, "DeepseekV32ForCausalLM": DEEPSEEK_V2,
}


_ACCEPTS: dict = {}


def accepts_kwarg(fn, name: str) -> bool:
    """Whether `fn` takes a keyword argument `name` (injecting an unknown one would break the forward)."""
    import inspect

    key = (getattr(fn, "__func__", fn), name)
    if key not in _ACCEPTS:
        try:
            params = inspect.signature(fn).parameters
            _ACCEPTS[key] = name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):  # no readable signature: treated as not accepting it, which the
            _ACCEPTS[key] = False        # caller reports ("NOT observing ...") instead of patching blind
    return _ACCEPTS[key]
SPECS = (LLAMA, QWEN2, QWEN3, QWEN3_MOE, DEEPSEEK_V2)


def default_layer_ids(num_layers: int) -> list[int]:
    """Capture-before ids (id k = residual stream entering layer k = HF hidden_states[k])."""
    return [2, num_layers // 2, num_layers - 3]


def parse_layers(text: str | None) -> list[int] | None:
    if text is None or text.strip() in ("", "auto"):
        return None
    ids = [int(x) for x in text.split(",")]
    if not ids or sorted(set(ids)) != ids or ids[0] < 1:
        raise ValueError(f"{ENV_LAYERS} must be increasing capture-before ids >= 1 (any number), got {text!r}")
    return ids


def observable_layers(spec: ModelSpec, model, forward_batch) -> set[int]:
    """The decoder layers whose forward runs in the model's plain layer loop (and so takes the
    capture argument) for this batch.  DeepseekV2Model.forward (0.5.23): under two-batch overlap
    the loop stops at `first_k_dense_replace`; the rest runs in `model_forward_stages`."""
    n = model.config.num_hidden_layers
    start = int(getattr(model, "start_layer", 0) or 0)
    end = int(getattr(model, "end_layer", n) or n)
    tbo = bool(getattr(forward_batch, "can_run_tbo", False))
    if tbo and spec.name == QWEN3_MOE.name:  # Qwen2MoeModel.forward: every layer in model_forward_stages
        return set()
    if tbo and spec.name == DEEPSEEK_V2.name:
        k = int(getattr(model, "first_k_dense_replace", getattr(model.config, "first_k_dense_replace", 0)))
        if start < k < end:
            end = k
        elif k < start:
            start = end = 0
    return set(range(start, end))


# ----------------------------------------------------------------------------- dump files


def dump_name(rid: str, start: int) -> str:
    return f"{rid}.{start:09d}.safetensors"


def error_name(rid: str) -> str:
    return f"{rid}.error.json"


def write_atomic(path: str, data: bytes) -> None:
    d = os.path.dirname(path) or "."
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def encode_dump(rid: str, start: int, input_ids, aux, last, layer_ids, extra: dict | None = None) -> bytes:
    """One request's prefill chunk: input_ids [n] int64, aux_hidden_states [n, k*H] (k layers, in
    order, like torch.cat), last_hidden_state [n, H] (post-norm)."""
    import torch
    from safetensors.torch import save

    n = int(input_ids.shape[0])
    if tuple(aux.shape[:1]) != (n,) or tuple(last.shape[:1]) != (n,):
        raise ValueError(f"rows differ: input_ids {n}, aux {tuple(aux.shape)}, last {tuple(last.shape)}")
    meta = {
        "format": DUMP_FORMAT,
        "plugin_version": PLUGIN_VERSION,
        "rid": rid,
        "start": str(int(start)),
        "n_tokens": str(n),
        "layer_ids": json.dumps([int(k) for k in layer_ids]),
        "convention": "capture-before",
        "final_norm": "post",
        "dtype": str(aux.dtype).replace("torch.", ""),
        "hidden_size": str(int(last.shape[-1])),
    }
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    tensors = {
        "input_ids": input_ids.to(torch.int64).contiguous(),
        "aux_hidden_states": aux.contiguous(),
        "last_hidden_state": last.contiguous(),
    }
    return save(tensors, metadata=meta)


def read_dump(path: str):
    """(tensors, metadata) of a dump file (safetensors: never pickle)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != DUMP_FORMAT:
        raise ValueError(f"{path}: not an {DUMP_FORMAT} file (format {meta.get('format')!r})")
    return tensors, meta


class DumpWriter:
    """Writes dumps and error markers from a background thread (off the forward's critical path).
    `threaded=False` writes inline (tests)."""

    def __init__(self, directory: str, threaded: bool = True, max_pending: int = 64):
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.threaded = threaded
        self._q: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="eaglenest-capture-writer", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            rid, job = self._q.get()
            try:
                self._run(rid, job)
            finally:
                self._q.task_done()

    def _run(self, rid: str | None, job) -> None:
        try:
            job()
        except Exception as e:  # a write error must not kill the writer; the client must learn why
            log.exception("eaglenest capture: writing a file for %s failed", rid)
            if rid is not None:
                try:
                    self._write_error(rid, "write_failed", f"the plugin could not write the capture: {type(e).__name__}: {e}")
                except OSError:
                    log.exception("eaglenest capture: cannot write the error file for %s either", rid)

    def _submit(self, rid: str | None, job) -> None:
        if self.threaded:
            self._q.put((rid, job))  # blocks when max_pending jobs wait: back-pressure on the forward
        else:
            self._run(rid, job)

    def dump(self, rid: str, start: int, input_ids, aux, last, layer_ids, extra=None) -> None:
        path = os.path.join(self.dir, dump_name(rid, start))
        self._submit(rid, lambda: write_atomic(path, encode_dump(rid, start, input_ids, aux, last, layer_ids, extra)))

    def error(self, rids, reason: str, message: str) -> None:
        for rid in rids:
            self._submit(None, functools.partial(self._write_error, rid, reason, message))

    def _write_error(self, rid: str, reason: str, message: str) -> None:
        body = json.dumps({"rid": rid, "reason": reason, "message": message, "time": time.time(),
                           "pid": os.getpid(), "plugin_version": PLUGIN_VERSION}).encode()
        write_atomic(os.path.join(self.dir, error_name(rid)), body)

    def flush(self) -> None:
        if self.threaded:
            self._q.join()


# ----------------------------------------------------------------------------- the observer


@dataclass
class _Plan:
    layer_ids: list[int]
    rids: list[str]  # ours, in batch order
    starts: list[int]  # prefix length = first token index of this chunk
    ranges: list[tuple[int, int]]  # rows of each request in the packed batch
    total_rows: int  # rows the whole batch occupies (all requests)
    error: tuple[str, str] | None = None
    tp_rank: int | None = None
    captured: dict = field(default_factory=dict)


def _arg(args, kwargs, index: int, name: str):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _mode_name(forward_batch) -> str | None:
    mode = getattr(forward_batch, "forward_mode", None)
    return getattr(mode, "name", None) if mode is not None else None


def _lens(forward_batch, name: str):
    v = getattr(forward_batch, f"{name}_cpu", None)
    if v is None:
        t = getattr(forward_batch, name, None)
        v = t.tolist() if t is not None else None
    return [int(x) for x in v] if v is not None else None


def _tp_rank() -> int:
    """This process's tensor-parallel rank, as SGLang 0.5.23 publishes it
    (`sglang/srt/runtime_context.py`: `get_parallel().tp_rank`; `sglang.srt.distributed` no longer
    exports `get_tensor_model_parallel_rank`).  Raises if it cannot be read: a rank that cannot be
    told apart from rank 0 must not write (every rank would write the same files)."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def _sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:  # a source checkout without metadata: the version only labels messages
        return "unknown"


class Observer:
    """The AROUND hook around a model's forward.  `around(spec, original_forward, model, *args,
    **kwargs)` returns `original_forward(model, *args, **kwargs)` unchanged."""

    def __init__(self, directory: str, layer_ids: list[int] | None = None, rid_prefix: str = DEFAULT_RID_PREFIX,
                 writer: DumpWriter | None = None, rank_fn=_tp_rank, sglang_version: str | None = None):
        self.dir = directory
        self.layer_ids = layer_ids
        self.rid_prefix = rid_prefix
        self.writer = writer or DumpWriter(directory)
        self.rank_fn = rank_fn
        self.sglang_version = sglang_version or _sglang_version()
        self.forwards_observed = 0

    @classmethod
    def from_env(cls) -> "Observer | None":
        d = os.environ.get(ENV_DIR)
        if not d:
            return None
        return cls(d, parse_layers(os.environ.get(ENV_LAYERS)), os.environ.get(ENV_RID_PREFIX) or DEFAULT_RID_PREFIX)

    def marker(self) -> dict:
        return {
            "plugin_version": PLUGIN_VERSION,
            "target_sglang_version": TARGET_SGLANG_VERSION,
            "sglang_version": self.sglang_version,
            "layer_ids": self.layer_ids or "auto",
            "rid_prefix": self.rid_prefix,
            "pid": os.getpid(),
            "time": time.time(),
        }

    def write_marker(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        write_atomic(os.path.join(self.dir, MARKER_FILE), json.dumps(self.marker(), indent=1).encode())

    # -- planning (cheap, before the forward)
    def plan(self, spec: ModelSpec, model, args, kwargs) -> _Plan | None:
        fb = _arg(args, kwargs, 2, "forward_batch")
        if fb is None or _mode_name(fb) not in ("EXTEND", "MIXED"):
            return None
        rids = list(getattr(fb, "rids", None) or [])
        ours = [j for j, r in enumerate(rids) if isinstance(r, str) and r.startswith(self.rid_prefix)
                and _RID_OK.match(r)]
        if not ours:
            return None
        try:
            rank = self.rank_fn()
        except Exception as e:  # no rank, no writing: an error file says why (same content from every rank)
            return _Plan([], [rids[j] for j in ours], [], [], 0,
                         error=("tp_rank_unknown", f"cannot read the tensor-parallel rank ({type(e).__name__}: {e})"))
        if rank != 0:
            return None  # only TP rank 0 copies to the host and writes (every rank holds the same rows)
        n_layers = int(model.config.num_hidden_layers)
        layer_ids = list(self.layer_ids or default_layer_ids(n_layers))
        seq, pre = _lens(fb, "extend_seq_lens"), _lens(fb, "extend_prefix_lens")
        p = _Plan(layer_ids, [rids[j] for j in ours], [], [], 0, tp_rank=rank)
        if seq is None or pre is None or len(seq) != len(rids) or len(pre) != len(rids):
            p.error = ("bad_layout", f"extend_seq_lens/extend_prefix_lens do not match the batch's {len(rids)} rids")
            return p
        offsets = [0]
        for n in seq:
            offsets.append(offsets[-1] + n)
        p.total_rows = offsets[-1]
        p.starts = [pre[j] for j in ours]
        p.ranges = [(offsets[j], offsets[j + 1]) for j in ours]
        if max(layer_ids) >= n_layers:
            p.error = ("bad_layers", f"layer ids {layer_ids} do not fit a {n_layers}-layer model")
            return p
        pp = getattr(model, "pp_group", None)
        if pp is not None and int(getattr(pp, "world_size", 1) or 1) > 1:
            p.error = ("pipeline_parallel", "pipeline parallelism (pp_size > 1) is not supported by the capture plugin")
            return p
        missing = [k for k in layer_ids if k not in observable_layers(spec, model, fb)]
        if missing:
            tbo = bool(getattr(fb, "can_run_tbo", False))
            p.error = (
                "tbo_unobservable" if tbo else "layer_not_observable",
                f"aux layers {missing} do not run in the model's layer loop for this batch"
                + (" (two-batch overlap runs them without a capture argument); launch without "
                   "--enable-two-batch-overlap" if tbo else ""),
            )
        return p

    # -- during the forward
    def _record(self, p: _Plan, k: int):
        import torch

        def record(value) -> None:
            try:
                if k in p.captured:
                    raise RuntimeError(f"layer {k} reported its input twice in one forward")
                if value.dim() != 2 or value.shape[0] < p.total_rows:
                    raise RuntimeError(f"layer {k} input has shape {tuple(value.shape)}, expected >= {p.total_rows} rows")
                parts = [value[a:b] for a, b in p.ranges]
                p.captured[k] = torch.cat(parts, 0) if len(parts) > 1 else parts[0].clone()
            except Exception as e:  # never break the server's forward
                p.error = p.error or ("capture_failed", f"{type(e).__name__}: {e}")

        return record

    def _pre_hook(self, spec: ModelSpec, p: _Plan, k: int):
        record = self._record(p, k)

        def hook(module, h_args, h_kwargs):
            if len(h_args) > spec.capture_index:
                p.error = p.error or ("layer_not_observable", f"layer {k} got its capture argument positionally")
                return None
            existing = h_kwargs.get(spec.capture_kwarg)
            h_kwargs = dict(h_kwargs)
            h_kwargs[spec.capture_kwarg] = _Chained(record, existing) if spec.collector else _chain(record, existing)
            return h_args, h_kwargs

        return hook

    def around(self, spec: ModelSpec, original, model, *args, **kwargs):
        try:
            p = self.plan(spec, model, args, kwargs)
        except Exception as e:
            log.exception("eaglenest capture: planning failed")
            p = None
            self._error_all(model, args, kwargs, "capture_failed", f"{type(e).__name__}: {e}")
        if p is None:
            return original(model, *args, **kwargs)
        if p.error is not None:
            self.writer.error(p.rids, *p.error)
            return original(model, *args, **kwargs)
        refuse = [k for k in p.layer_ids if not accepts_kwarg(model.layers[k].forward, spec.capture_kwarg)]
        if refuse:
            self.writer.error(p.rids, "layer_not_observable", f"decoder layers {refuse} ({type(model.layers[refuse[0]]).__name__})"
                              f" take no {spec.capture_kwarg} argument: this SGLang version is not supported")
            return original(model, *args, **kwargs)
        handles = []
        try:
            for k in p.layer_ids:
                handles.append(model.layers[k].register_forward_pre_hook(self._pre_hook(spec, p, k), with_kwargs=True))
            out = original(model, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        try:
            self._finish(p, model, args, kwargs, out)
        except Exception as e:
            log.exception("eaglenest capture: writing the capture failed")
            self.writer.error(p.rids, "capture_failed", f"{type(e).__name__}: {e}")
        return out

    def _error_all(self, model, args, kwargs, reason, message) -> None:
        fb = _arg(args, kwargs, 2, "forward_batch")
        rids = [r for r in (getattr(fb, "rids", None) or []) if isinstance(r, str) and r.startswith(self.rid_prefix)
                and _RID_OK.match(r)]
        if rids:
            self.writer.error(rids, reason, message)

    def _finish(self, p: _Plan, model, args, kwargs, out) -> None:
        import torch

        if p.error is not None:
            self.writer.error(p.rids, *p.error)
            return
        missing = [k for k in p.layer_ids if k not in p.captured]
        if missing:
            self.writer.error(p.rids, "layer_not_observed",
                              f"aux layers {missing} never reported their input (a replayed CUDA graph, two-batch "
                              "overlap, or a model class whose layers do not take the capture argument)")
            return
        final = out[0] if isinstance(out, (tuple, list)) else out
        if not torch.is_tensor(final) or final.dim() != 2 or final.shape[0] < p.total_rows:
            self.writer.error(p.rids, "bad_layout", f"model output is {type(final).__name__} "
                              f"{tuple(final.shape) if torch.is_tensor(final) else ''}, not [>= {p.total_rows}, H] rows")
            return
        input_ids = _arg(args, kwargs, 0, "input_ids")
        if not torch.is_tensor(input_ids) or input_ids.shape[0] < p.total_rows:
            self.writer.error(p.rids, "bad_layout", "the forward's input_ids do not cover the batch rows")
            return
        parts = [(final[a:b], input_ids[a:b]) for a, b in p.ranges]
        last = torch.cat([x for x, _ in parts], 0)
        ids = torch.cat([i for _, i in parts], 0)
        aux = torch.cat([p.captured[k] for k in p.layer_ids], dim=-1)
        aux, last, ids = aux.to("cpu"), last.to("cpu"), ids.to("cpu")  # one synchronizing copy per forward
        extra = {"sglang_version": self.sglang_version, "model_class": type(model).__name__, "tp_rank": p.tp_rank,
                 "pid": os.getpid()}
        row = 0
        for rid, start, (a, b) in zip(p.rids, p.starts, p.ranges):
            n = b - a
            self.writer.dump(rid, start, ids[row:row + n].clone(), aux[row:row + n].clone(), last[row:row + n].clone(),
                             p.layer_ids, extra)
            row += n
        self.forwards_observed += 1


def _chain(record, existing):
    """SGLang's `capture_output(value, owned=False)` callback, with ours first (we only read)."""

    def capture(value, *, owned: bool = False):
        record(value)
        if existing is not None:
            existing(value, owned=owned)

    return capture


class _Chained:
    """A collector (`.capture(value, owned=...)`) that gives the value to us, then to SGLang's."""

    def __init__(self, record, existing):
        self._record = record
        self._existing = existing

    def capture(self, value, *, owned: bool = False):
        self._record(value)
        if self._existing is not None:
            self._existing.capture(value, owned=owned)

    def __len__(self):  # AuxHiddenStatePacker/AuxHiddenStateList answer len(); stay transparent
        return len(self._existing) if self._existing is not None else 0


# ----------------------------------------------------------------------------- patching


def patch_class(cls, spec: ModelSpec, observer: Observer) -> bool:
    """Wrap `cls.forward` with the observer, on `cls` itself (an inherited forward is wrapped for
    this class only, e.g. Qwen3MoeModel's Qwen2MoeModel.forward); idempotent."""
    orig = cls.__dict__.get("forward") or getattr(cls, "forward", None)
    if orig is None:
        raise AttributeError(f"{cls.__qualname__} has no forward")
    if getattr(orig, "__eaglenest_capture__", False):
        return False

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        return observer.around(spec, orig, self, *args, **kwargs)

    forward.__eaglenest_capture__ = True
    forward.__wrapped__ = orig
    cls.forward = forward
    return True


class _PostImportPatcher(importlib.abc.MetaPathFinder):
    """Patches a model class right after its module is imported, in whichever process imports it
    (the scheduler / TP workers): the HTTP and detokenizer processes never import model code."""

    def __init__(self, observer: Observer, specs=SPECS):
        self.observer = observer
        self.by_module = {s.module: s for s in specs}

    def find_spec(self, name, path=None, target=None):
        spec_m = self.by_module.get(name)
        if spec_m is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            found = finder.find_spec(name, path, target)
            if found is not None:
                break
        else:
            return None
        loader = found.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        observer = self.observer
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            _patch_loaded(module, spec_m, observer)

        found.loader = _LoaderProxy(loader, exec_module)
        return found


class _LoaderProxy(importlib.abc.Loader):
    def __init__(self, loader, exec_module):
        self._loader = loader
        self._exec = exec_module

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._exec(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _patch_loaded(module, spec: ModelSpec, observer: Observer) -> None:
    try:
        layer = getattr(module, spec.layer_cls, None)
        if layer is None or not accepts_kwarg(layer.forward, spec.capture_kwarg):
            print(f"eaglenest capture: NOT observing {spec.module}.{spec.cls}: {spec.layer_cls}.forward takes no "
                  f"{spec.capture_kwarg} argument (SGLang {observer.sglang_version}; the plugin targets "
                  f"{TARGET_SGLANG_VERSION})", file=sys.stderr, flush=True)
            return
        if patch_class(getattr(module, spec.cls), spec, observer):
            # stderr as well as logging: SGLang's log configuration may hide other loggers' INFO lines
            print(f"eaglenest capture: observing {spec.module}.{spec.cls}.forward (pid {os.getpid()}, layers "
                  f"{observer.layer_ids or 'auto'}, staging {observer.dir})", file=sys.stderr, flush=True)
    except Exception:
        log.exception("eaglenest capture: could not patch %s.%s", spec.module, spec.cls)


def activate(observer: Observer) -> None:
    for spec in SPECS:
        if spec.module in sys.modules:
            _patch_loaded(sys.modules[spec.module], spec, observer)
    if not any(isinstance(f, _PostImportPatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportPatcher(observer))


def register() -> None:
    """Entry point (`sglang.srt.plugins` group): inert unless EAGLENEST_SGLANG_CAPTURE_DIR is set."""
    observer = Observer.from_env()
    if observer is None:
        return
    try:
        observer.write_marker()
    except OSError:
        log.exception("eaglenest capture: cannot write to %s", observer.dir)
    activate(observer)


# ----------------------------------------------------------------------------- check (no eaglenest imports)

# Hook points the plugin relies on, as (file under the package root, class, method, what must be
# there: "param:NAME" = a parameter of the method, anything else = a token of its source).  Checked by reading the files (ast), which
# works whether or not sglang imports on this machine.
HOOK_POINTS = [
    ("sglang/srt/models/llama.py", "LlamaModel", "forward",
     ["param:input_ids", "param:positions", "param:forward_batch", "capture_output=", "self.layers"]),
    ("sglang/srt/models/llama.py", "LlamaDecoderLayer", "forward",
     ["param:capture_output", "capture=capture_output", "attn_boundary.prepare"]),
    ("sglang/srt/models/llama.py", "LlamaForCausalLM", "set_eagle3_layers_to_capture", ["layers_to_capture"]),
    ("sglang/srt/models/deepseek_v2.py", "DeepseekV2Model", "forward",
     ["param:input_ids", "param:positions", "param:forward_batch", "captured_last_layer_outputs=", "can_run_tbo",
      "first_k_dense_replace", "model_forward_stages"]),
    ("sglang/srt/models/deepseek_v2.py", "DeepseekV2DecoderLayer", "forward",
     ["param:captured_last_layer_outputs", "capture_gathered=captured_last_layer_outputs"]),
    ("sglang/srt/models/deepseek_v2.py", "DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture", ["layers_to_capture"]),
    ("sglang/srt/model_executor/forward_batch_info.py", "ForwardBatch", None,
     ["rids", "extend_seq_lens_cpu", "extend_prefix_lens_cpu", "forward_mode", "tbo_split_seq_index"]),
    ("sglang/srt/model_executor/forward_batch_info.py", "ForwardMode", None, ["EXTEND", "MIXED"]),
    ("sglang/srt/plugins/__init__.py", None, None, ['GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"', "def load_plugins"]),
    ("sglang/srt/managers/scheduler.py", None, "run_scheduler_process", ["load_plugins()"]),
    ("sglang/srt/models/qwen2.py", "Qwen2Model", "forward",
     ["param:input_ids", "param:positions", "param:forward_batch", "capture_output=", "self.layers"]),
    ("sglang/srt/models/qwen2.py", "Qwen2DecoderLayer", "forward", ["param:capture_output", "capture=capture_output"]),
    ("sglang/srt/models/qwen3.py", "Qwen3Model", "forward",
     ["param:input_ids", "param:positions", "param:forward_batch", "capture_output=", "self.layers"]),
    ("sglang/srt/models/qwen3.py", "Qwen3DecoderLayer", "forward", ["param:capture_output", "capture=capture_output"]),
    ("sglang/srt/models/qwen2_moe.py", "Qwen2MoeModel", "forward",
     ["param:forward_batch", "captured_last_layer_outputs=", "can_run_tbo", "model_forward_stages"]),
    ("sglang/srt/models/qwen3_moe.py", "Qwen3MoeDecoderLayer", "forward",
     ["param:captured_last_layer_outputs", "capture_gathered=captured_last_layer_outputs"]),
    ("sglang/srt/runtime_context.py", None, "get_parallel", ["return _PARALLEL"]),
    ("sglang/srt/runtime_context.py", "ParallelContext", None, ["def _read", "config._fields"]),
    ("sglang/srt/managers/io_struct.py", "GenerateReqInput", None,
     ["input_ids", "sampling_params", "rid", "extra_key", "return_hidden_states", "return_prompt_token_ids"]),
]


def check_source_tree(root: str) -> list[tuple[str, bool, str]]:
    """[(what, ok, detail)] for every hook point, reading the package's files under `root` (the
    directory that contains `sglang/`)."""
    import ast

    results = []
    trees: dict[str, object] = {}
    for rel, cls_name, meth, needles in HOOK_POINTS:
        what = f"{rel}: {'.'.join(x for x in (cls_name, meth) if x) or '(module)'}"
        path = os.path.join(root, rel)
        try:
            if rel not in trees:
                with open(path, encoding="utf-8") as f:
                    src = f.read()
                trees[rel] = (src, ast.parse(src))
            src, tree = trees[rel]
        except (OSError, SyntaxError) as e:
            results.append((what, False, f"cannot read {path}: {e}"))
            continue
        node = tree
        if cls_name:
            node = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
            if node is None:
                results.append((what, False, f"class {cls_name} not found"))
                continue
        if meth:
            body = node.body if cls_name else tree.body
            fn = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == meth), None)
            if fn is None:
                results.append((what, False, f"{meth} not found"))
                continue
            node = fn
        seg = src if node is tree else (ast.get_source_segment(src, node) or "")
        params = set()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        missing = [t for t in needles if (t[6:] not in params if t.startswith("param:") else t not in seg)]
        results.append((what, not missing, "ok" if not missing else f"missing {missing}"))
    return results


def probe() -> dict:
    """Run inside the SGLang environment: version, where the package is, whether it imports, and
    whether this plugin's entry point is installed.  Prints nothing; returns a JSON-able dict."""
    out: dict = {"python": sys.executable, "target_sglang_version": TARGET_SGLANG_VERSION}
    try:
        from importlib.metadata import entry_points, version

        out["sglang_version"] = version("sglang")
        eps = [f"{e.name} = {e.value}" for e in entry_points(group=ENTRY_POINT_GROUP)]
        out["entry_points"] = eps
        out["plugin_installed"] = any(e.startswith(f"{ENTRY_POINT_NAME} =") for e in eps)
    except Exception as e:
        out.setdefault("sglang_version", None)
        out["metadata_error"] = f"{type(e).__name__}: {e}"
    spec = importlib.util.find_spec("sglang")  # does not execute sglang/__init__.py
    out["package_root"] = os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else None
    try:
        if os.environ.get(ENV_CPU_LAUNCHER) == "1":  # eaglenest's CPU environment: prepared as the launcher does
            from eaglenest.engines.sglang.launcher import prepare_process

            prepare_process()
        import sglang  # noqa: F401

        out["importable"] = True
        out["imported_version"] = getattr(sglang, "__version__", None)
        from sglang.srt.runtime_context import get_parallel  # noqa: F401  (what _tp_rank reads)

        out["tp_rank_source"] = "sglang.srt.runtime_context.get_parallel().tp_rank"
    except Exception as e:
        out.setdefault("importable", False)
        out["import_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if out["package_root"]:
        out["hook_points"] = check_source_tree(out["package_root"])
    return out


if __name__ == "__main__":  # `python eaglenest_sglang_capture.py probe` inside the SGLang env
    # run as a script, this file's directory is sys.path[0]; in the eaglenest tree it holds the
    # client's modules (server.py, protocol.py, ...), which would shadow top-level modules so named
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    if sys.argv[1:] == ["probe"]:
        print(json.dumps(probe()))
    else:
        print(__doc__)
