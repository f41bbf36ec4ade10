"""In-process transformers engine (the default, and the one embedded in the other stages).

Capture keeps only what the draft needs: forward pre-hooks on the aux decoder layers (any number:
EAGLE-3's three, DFlash's five) copy the residual stream *entering* them (= HF hidden_states[k],
capture-before), and the base
model's output is the post-norm final state; lm_head is never run and the other layers' states
are never materialized.  On CUDA, the states go to two pinned host buffers that are reused batch
after batch, copied on a side stream: batch i's copy runs while batch i+1 is computed, and the
host waits on batch i's event only when it reads batch i (or reuses its buffer unread).
"""

from __future__ import annotations

import torch

from eaglenest.capture.layers import parse_layer_ids
from eaglenest.engines.base import Captured, CaptureHandle, Engine, EngineInfo, Failure, Generated, Request
from eaglenest.features.store import DTYPES
from eaglenest.models.target import decoder_layers, eos_token_ids, load_target, resolve_model_path, target_fingerprint

NAME = "hf"


def add_arguments(p) -> None:
    p.add_argument("--device", default="auto", help="hf engine: cpu, cuda, cuda:N or auto")
    p.add_argument("--trust-remote-code", action="store_true", help="hf engine: allow custom model code")


def create(args) -> "HFEngine":
    return HFEngine(
        args.model,
        layers=getattr(args, "layers", "auto"),
        dtype=getattr(args, "dtype", "bf16"),
        device=getattr(args, "device", "auto"),
        trust_remote_code=getattr(args, "trust_remote_code", False),
        states_dtype=getattr(args, "states_dtype", None),
    )


class CudaCopies:
    """The CUDA half of HostStaging: pinned buffers, copies on a side stream, events."""

    def __init__(self, device: str):
        self.stream = torch.cuda.Stream(device)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        ready = torch.cuda.Event()
        ready.record()  # after the forward that produced the sources, on the compute stream
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(self.stream)  # the allocator must not give src to the next forward before this copy
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, event) -> None:
        event.synchronize()


class HostCopies:
    """HostStaging's operations for a model on the CPU: plain copies, nothing to wait for."""

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def copy(self, pairs):
        for dst, src in pairs:
            dst.copy_(src)
        return None

    def wait(self, event) -> None:
        pass


class HostStaging:
    """Host buffers for captured states, reused round-robin (`slots` of them, grown when a batch
    needs more).  `ops` does the device part (CudaCopies / HostCopies, or a test's recorder)."""

    def __init__(self, ops, slots: int = 2):
        self.ops = ops
        self.bufs: list[torch.Tensor | None] = [None] * slots
        self.unread: list[PendingCapture | None] = [None] * slots
        self.next = 0

    def stage(self, tensors: list[torch.Tensor], build) -> "PendingCapture":
        """Queue copies of `tensors` into the next slot; `build(host_views)` makes the result once they landed."""
        k = self.next
        self.next = (k + 1) % len(self.bufs)
        if self.unread[k] is not None:  # reused before its batch was read: read it now (waits on its event)
            self.unread[k].result()
        need = sum(t.numel() for t in tensors)
        buf = self.bufs[k]
        if buf is None or buf.numel() < need or buf.dtype != tensors[0].dtype:
            buf = self.bufs[k] = self.ops.empty(max(need, 0 if buf is None else 2 * buf.numel()), tensors[0].dtype)
        views, off = [], 0
        for t in tensors:
            views.append(buf[off : off + t.numel()].view(t.shape))
            off += t.numel()
        pending = PendingCapture(self, k, views, self.ops.copy(list(zip(views, tensors))), build)
        self.unread[k] = pending
        return pending


class PendingCapture(CaptureHandle):
    def __init__(self, staging: HostStaging, slot: int, views, event, build):
        super().__init__(None)
        self._staging, self._slot, self._views, self._event, self._build = staging, slot, views, event, build

    def result(self):
        if self._results is None:
            self._staging.ops.wait(self._event)
            self._results = self._build(self._views)  # copies out of the slot: it can be reused after this
            if self._staging.unread[self._slot] is self:
                self._staging.unread[self._slot] = None
            self._views = None
        return self._results


class HFEngine(Engine):
    name = NAME

    def __init__(self, model, layers="auto", dtype="bf16", device="auto", trust_remote_code=False, model_obj=None, host_ops=None,
                 states_dtype: torch.dtype | None = None):
        """`states_dtype`: cast the captured states to it (capture --dtype auto runs fp32 on CPUs that
        emulate bf16 but hands on bf16 states, as a bf16 run would)."""
        from eaglenest.utils import resolve_device

        self.device = resolve_device(device)
        self.states_dtype = states_dtype
        self.path = resolve_model_path(model) if model_obj is None else model
        self.model = model_obj if model_obj is not None else load_target(model, dtype, self.device, trust_remote_code)
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        self.layer_ids = parse_layer_ids(layers, self.num_layers)
        self.base = self.model.get_decoder()
        self.staging = HostStaging(host_ops or (CudaCopies(self.device) if self.device.startswith("cuda") else HostCopies()))
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [
            decoder_layers(self.model)[k].register_forward_pre_hook(self._make_hook(k), with_kwargs=True)
            for k in self.layer_ids
        ]

    def _make_hook(self, k: int):
        def hook(module, args, kwargs):
            self._captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def info(self) -> EngineInfo:
        cfg = self.model.config
        return EngineInfo(
            target=str(self.path),
            target_fingerprint=target_fingerprint(self.path),
            hidden_size=cfg.hidden_size,
            num_layers=self.num_layers,
            vocab_size=cfg.vocab_size,
            layer_ids=self.layer_ids,
            final_norm="post",  # LlamaModel applies the final norm to last_hidden_state
            compute_dtype=next((k for k, v in DTYPES.items() if v == self.model.dtype), str(self.model.dtype)),
        )

    def _pad(self, seqs: list[list[int]]):
        T = max(len(s) for s in seqs)
        cuda = self.device.startswith("cuda")
        ids = torch.zeros(len(seqs), T, dtype=torch.long, pin_memory=cuda)
        att = torch.zeros(len(seqs), T, dtype=torch.long, pin_memory=cuda)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            att[i, : len(s)] = 1
        # pinned + non-blocking: a pageable copy would wait for the previous batch's forward to finish
        return ids.to(self.device, non_blocking=cuda), att.to(self.device, non_blocking=cuda)

    @torch.inference_mode()
    def forward_states(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded batch -> (aux [B, T, n*H] in layer_ids order, final post-norm [B, T, H]) on the model's device."""
        ids, att = self._pad(seqs)
        self._captured.clear()
        out = self.base(input_ids=ids, attention_mask=att, use_cache=False)
        aux = torch.cat([self._captured[k] for k in self.layer_ids], dim=-1)
        self._captured.clear()
        last = out.last_hidden_state
        if self.states_dtype is not None:
            aux, last = aux.to(self.states_dtype), last.to(self.states_dtype)
        return aux, last

    def capture(self, batch: list[Request]) -> list[Captured | Failure]:
        return self.capture_async(batch).result()

    def capture_async(self, batch: list[Request]) -> CaptureHandle:
        """Run the batch's forward and queue its states' copy to the host; `result()` waits for them."""
        vocab = self.model.config.vocab_size
        results: list[Captured | Failure | None] = [None] * len(batch)
        ok = []
        for i, r in enumerate(batch):
            if not r.input_ids:
                results[i] = Failure(r.id, "empty", "no tokens")
            elif min(r.input_ids) < 0 or max(r.input_ids) >= vocab:
                results[i] = Failure(r.id, "token_out_of_vocab", f"token id outside [0, {vocab})")
            else:
                ok.append(i)
        if not ok:
            return CaptureHandle(results)  # type: ignore[arg-type]

        def build(views):
            aux_h, last_h = views
            for j, i in enumerate(ok):
                T = len(batch[i].input_ids)
                # in-process: the ids are exactly what we ran; clones, so the slot can be reused
                results[i] = Captured(batch[i].id, torch.tensor(batch[i].input_ids), aux_h[j, :T].clone(), last_h[j, :T].clone())
            return results

        return self.staging.stage(list(self.forward_states([batch[i].input_ids for i in ok])), build)

    @torch.inference_mode()
    def generate(self, batch: list[Request], max_new_tokens: int, temperature: float = 0.0, seed: int = 0, max_batch: int = 32):
        """Batched generation (left-padded, KV cache): our own loop, because transformers'
        `generate` ran ~20x slower than the plain forward on this CPU (bf16, padded batch)."""
        eos = eos_token_ids(self.path)
        out: list[Generated | None] = [None] * len(batch)
        order = sorted(range(len(batch)), key=lambda i: len(batch[i].input_ids))  # similar lengths pad less
        g = torch.Generator(device=self.device).manual_seed(seed)
        for c in range(0, len(order), max_batch):
            idx = order[c : c + max_batch]
            gens = self._generate_padded([batch[i].input_ids for i in idx], max_new_tokens, temperature, eos, g)
            for i, new in zip(idx, gens):
                stopped = bool(new) and new[-1] in eos
                out[i] = Generated(batch[i].id, list(batch[i].input_ids), new, "stop" if stopped else "length")
        return out  # type: ignore[return-value]

    def _generate_padded(self, prompts, max_new_tokens, temperature, eos, g):
        B, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, T, dtype=torch.long)
        att = torch.zeros(B, T, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, T - len(p) :] = torch.tensor(p)
            att[r, T - len(p) :] = 1
        ids, att = ids.to(self.device), att.to(self.device)
        pos = (att.cumsum(-1) - 1).clamp_min(0)
        eos_t = torch.tensor(eos or [-1], device=self.device)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        new: list[list[int]] = [[] for _ in range(B)]
        cache, step_ids = None, ids
        for _ in range(max_new_tokens):
            o = self.model(input_ids=step_ids, attention_mask=att, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, logits = o.past_key_values, o.logits[:, -1].float()
            if temperature > 0:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g).squeeze(1)
            else:
                nxt = logits.argmax(-1)
            for r in (~done).nonzero(as_tuple=True)[0].tolist():
                new[r].append(int(nxt[r]))
            done |= torch.isin(nxt, eos_t)
            if bool(done.all()):
                break
            step_ids = nxt[:, None]
            att = torch.cat([att, torch.ones(B, 1, dtype=att.dtype, device=att.device)], 1)
            pos = pos[:, -1:] + 1
        return new

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
