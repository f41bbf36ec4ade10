"""The narrow interface every engine implements (transformers in-process, vLLM, SGLang).

capture(): run the target on exactly these token ids and return, per sample, the ids the
engine says it saw (checked against what was sent), the aux states of the engine's layer ids
(capture-before; any number n, EAGLE-3 uses three) concatenated in order, [T, n*H], and the final
state [T, H] (flagged pre/post norm).
generate(): continue prompts given as token ids (for `regenerate`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    id: str
    input_ids: list[int]


@dataclass
class Captured:
    id: str
    input_ids: torch.Tensor  # what the engine reports it processed
    aux_hidden_states: torch.Tensor  # [T, n*H], n = len(EngineInfo.layer_ids)
    last_hidden_state: torch.Tensor  # [T, H]


@dataclass
class Generated:
    id: str
    prompt_ids: list[int]  # echoed by the engine
    output_ids: list[int]
    finish_reason: str = "stop"


@dataclass
class Failure:
    id: str
    reason: str  # short key for counting: timeout, http_5xx, token_mismatch, non_finite, ...
    message: str = ""


@dataclass
class EngineInfo:
    target: str
    target_fingerprint: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    layer_ids: list[int]  # capture-before
    final_norm: str  # "post" | "pre"
    extra: dict = field(default_factory=dict)
    compute_dtype: str | None = None  # what the target computes in (bf16 | fp32 | fp16); None: not known here


class CaptureHandle:
    """What `Engine.capture_async` returns; `result()` gives what `capture` would have."""

    def __init__(self, results: list[Captured | Failure]):
        self._results = results

    def result(self) -> list[Captured | Failure]:
        return self._results


class Engine(ABC):
    name: str = "?"

    @abstractmethod
    def info(self) -> EngineInfo: ...

    @abstractmethod
    def capture(self, batch: list[Request]) -> list[Captured | Failure]: ...

    def capture_async(self, batch: list[Request]) -> CaptureHandle:
        """Start a batch; `capture` calls the next one before reading this one's result, so an
        engine that can (hf on CUDA) overlaps this batch's transfer with the next one's compute."""
        return CaptureHandle(self.capture(batch))

    def generate(
        self, batch: list[Request], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> list[Generated | Failure]:
        raise NotImplementedError(f"engine {self.name} cannot generate")

    def close(self) -> None:
        pass

    def request_stats(self) -> dict | None:
        """A server engine's account of its HTTP requests (engines/http.py `Client.stats()`); None in-process."""
        return None

    def _server_info(self, final_norm: str, compute_dtype: str | None, **extra) -> EngineInfo:
        """info() for the server engines, which keep path/hidden_size/num_layers/vocab_size/layer_ids;
        compute_dtype: the dtype a server we start runs in, None for a server given by URL."""
        from eaglenest.models.target import target_fingerprint

        return EngineInfo(str(self.path), target_fingerprint(self.path), self.hidden_size, self.num_layers,
                          self.vocab_size, list(self.layer_ids), final_norm, extra, compute_dtype)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_echo(sent: list[int], seen: list[int] | torch.Tensor, sid: str) -> Failure | None:
    """Token-exactness: the engine must have processed exactly the ids we sent."""
    seen_l = seen.tolist() if isinstance(seen, torch.Tensor) else list(seen)
    if seen_l == list(sent):
        return None
    first = next((i for i, (a, b) in enumerate(zip(sent, seen_l)) if a != b), min(len(sent), len(seen_l)))
    return Failure(
        sid,
        "token_mismatch",
        f"engine saw {len(seen_l)} ids, sent {len(sent)}; first difference at {first}: "
        f"sent {list(sent)[first:first + 8]} seen {seen_l[first:first + 8]}",
    )
