"""SGLang-shaped models built from transformers modules (test helper, not SGLang).

SGLang 0.5.23 cannot run here (CUDA-only kernels).  To run eaglenest's capture plugin on real
decoder layers, these classes re-create the *calling structure* of SGLang 0.5.23's model code
around transformers' LlamaModel / DeepseekV2Model weights:

  * `ShapedModel.forward(input_ids, positions, forward_batch, input_embeds=None,
    pp_proxy_tensors=None)` -- the signature of `LlamaModel.forward` / `DeepseekV2Model.forward`
    (sglang/srt/models/llama.py, deepseek_v2.py); tokens of all requests are packed in one
    [num_tokens] batch, the residual stream travels separately from the layer output (SGLang's
    `residual_batch` / `forward_batch.residual_stream`), the final norm takes output + residual.
  * Llama flavour: layers are called `layer(positions, hidden_states, forward_batch,
    capture_output=aux.capture if i in self.layers_to_capture else None)` and, at entry, hand
    `capture_output(hidden_states + residual, owned=False)` the residual stream entering the layer,
    as `LlamaDecoderLayer.forward` -> `attn_boundary.prepare(..., capture=...)` does; the model
    returns `hidden_states` or `(hidden_states, aux_hidden_states)` when it captured anything.
  * DeepseekV2 flavour: layers take `captured_last_layer_outputs=` (a collector with
    `.capture(value, owned=...)`) as the 8th parameter and return `(hidden_states, topk_indices)`;
    with `forward_batch.can_run_tbo` the plain loop stops at `first_k_dense_replace` and the rest runs
    through `forward_stages` (standing in for `model_forward_stages`), which takes no capture
    argument and does not go through the layer's `__call__` -- like SGLang's two-batch overlap.

Attention runs per request (each request's rows, causal, positions from `extend_prefix_lens`), so
the values must equal transformers' own forward on each request alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import nn


class ForwardMode(enum.IntEnum):  # names as in sglang/srt/model_executor/forward_batch_info.py
    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()


@dataclass
class FakeForwardBatch:
    """The ForwardBatch fields the plugin reads (same names as SGLang 0.5.23)."""

    forward_mode: ForwardMode
    rids: list[str]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    input_ids: torch.Tensor
    tbo_split_seq_index: int | None = None
    residual_stream: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    @property
    def can_run_tbo(self) -> bool:
        return self.tbo_split_seq_index is not None


def pack(requests: list[list[int]], rids: list[str], mode=ForwardMode.EXTEND, tbo: bool = False):
    ids = torch.tensor([t for r in requests for t in r], dtype=torch.long)
    positions = torch.cat([torch.arange(len(r)) for r in requests])
    fb = FakeForwardBatch(mode, list(rids), [len(r) for r in requests], [0] * len(requests), ids,
                          tbo_split_seq_index=1 if tbo else None)
    return ids, positions, fb


class AuxList(list):
    """sglang.srt.layers.aux_hidden_states.AuxHiddenStateList (0.5.23)."""

    def capture(self, hidden, *, owned: bool = False):
        self.append(hidden if owned else hidden.clone())


class AuxPacker:
    """A minimal AuxHiddenStatePacker: .capture() appends, finalize() concatenates."""

    def __init__(self, n):
        self.n, self.parts = n, []

    def capture(self, hidden, *, owned: bool = False):
        self.parts.append(hidden.clone())

    def __len__(self):
        return len(self.parts)

    def finalize(self):
        return torch.cat(self.parts, -1)


def _causal(n: int, dtype) -> torch.Tensor:
    m = torch.full((n, n), float("-inf"), dtype=dtype).triu(1)
    return m[None, None]


class ShapedLayer(nn.Module):
    def __init__(self, hf_layer, rotary, flavour: str):
        super().__init__()
        self.hf = hf_layer
        self.rotary = rotary
        self.flavour = flavour

    def _attn(self, x, forward_batch):
        outs, a = [], 0
        for n, pre in zip(forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu):
            xi = x[a:a + n][None]
            pos = torch.arange(pre, pre + n)[None]
            pe = self.rotary(xi, pos)
            o = self.hf.self_attn(hidden_states=xi, position_embeddings=pe, attention_mask=_causal(n, xi.dtype))[0]
            outs.append(o[0])
            a += n
        return torch.cat(outs, 0)

    def _body(self, hidden_states, forward_batch, capture):
        res = forward_batch.residual_stream
        residual = hidden_states if res is None else hidden_states + res  # the add of the fused add+norm
        if capture is not None:
            capture(residual)
        x = self.hf.input_layernorm(residual)
        residual = self._attn(x, forward_batch) + residual
        forward_batch.residual_stream = residual
        return self.hf.mlp(self.hf.post_attention_layernorm(residual)[None])[0]

    def forward(self, positions, hidden_states, forward_batch, *rest, capture_output=None, captured_last_layer_outputs=None,
                **kw):
        if self.flavour == "llama":
            return self._body(hidden_states, forward_batch,
                              None if capture_output is None else (lambda v: capture_output(v, owned=False)))
        coll = captured_last_layer_outputs
        out = self._body(hidden_states, forward_batch, None if coll is None else (lambda v: coll.capture(v, owned=False)))
        return out, None

    def forward_stages(self, hidden_states, forward_batch):
        """Two-batch-overlap path: same math, no capture argument, not through __call__."""
        return self._body(hidden_states, forward_batch, None)


class ShapedModel(nn.Module):
    """`LlamaModel` / `DeepseekV2Model` calling structure over a transformers base model."""

    def __init__(self, hf_base, flavour: str):
        super().__init__()
        self.hf = hf_base
        self.flavour = flavour
        self.config = hf_base.config
        self.embed_tokens = hf_base.embed_tokens
        self.norm = hf_base.norm
        self.layers = nn.ModuleList([ShapedLayer(l, hf_base.rotary_emb, flavour) for l in hf_base.layers])
        self.start_layer, self.end_layer = 0, len(self.layers)
        self.layers_to_capture: list[int] = []  # SGLang's own aux capture (set_eagle3_layers_to_capture)
        self.first_k_dense_replace = getattr(self.config, "first_k_dense_replace", 0)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        forward_batch.residual_stream = None
        if self.flavour == "llama":
            aux = AuxList()
            for i in range(self.start_layer, self.end_layer):
                hidden = self.layers[i](positions, hidden, forward_batch,
                                        capture_output=aux.capture if i in self.layers_to_capture else None)
        else:
            aux = AuxPacker(len(self.layers_to_capture))
            end = self.end_layer
            if forward_batch.can_run_tbo and self.start_layer < self.first_k_dense_replace < self.end_layer:
                end = self.first_k_dense_replace
            for i in range(self.start_layer, end):
                hidden, _ = self.layers[i](positions, hidden, forward_batch, None, None, None,
                                           prev_topk_indices=None,
                                           captured_last_layer_outputs=aux if i in self.layers_to_capture else None,
                                           next_full_attention_layer_id=None)
            for i in range(end, self.end_layer):
                hidden = self.layers[i].forward_stages(hidden, forward_batch)
        final = self.norm(hidden + forward_batch.residual_stream)
        forward_batch.residual_stream = None
        if len(aux) == 0:
            return final
        return final, (torch.cat(list(aux), -1) if self.flavour == "llama" else aux.finalize())


def tiny_llama(seed: int = 0, layers: int = 6, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=97, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    return LlamaModel(cfg).to(dtype).eval()


def tiny_deepseek_v2(seed: int = 0, layers: int = 6, dtype=torch.float32):
    from transformers import DeepseekV2Config, DeepseekV2Model

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=4, vocab_size=97, max_position_embeddings=256,
                           kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2,
                           n_group=1, topk_group=1)
    cfg._attn_implementation = "eager"
    return DeepseekV2Model(cfg).to(dtype).eval()
