"""bf16 parameters for the forward and backward, fp32 master weights for the optimizer.

Under bf16 autocast with fp32 parameters every Linear casts its weight per call, every RMSNorm
multiplies by an fp32 weight and hands the next op an fp32 tensor to cast again, and the frozen
embeddings are gathered in fp32: bytes the step moves for nothing.  With `MasterWeights` the draft's
parameters (and its frozen embeddings) are bf16, so the layer runs in bf16 end to end (norms
still reduce in fp32 inside, attention's softmax too); each bf16 gradient is added into an fp32
master's gradient as soon as backward produces it (gradient accumulation over micro-batches is in
fp32), the optimizer updates the fp32 masters, and `sync` copies them back in bf16.  Checkpoints
hold the masters (fp32), so a resumed run and an export see the full-precision weights.
"""

from __future__ import annotations

from functools import partial

import torch


def _to_master(master: torch.Tensor, p: torch.Tensor) -> None:
    """post-accumulate-grad hook: the bf16 gradient goes into the fp32 master's, and is dropped."""
    if master.grad is None:
        master.grad = p.grad.to(torch.float32)
    else:
        master.grad.add_(p.grad)
    p.grad = None


class MasterWeights:
    """The draft's trainable parameters as fp32 masters (`params`, what the optimizer, clipping and the
    all-reduce see) behind bf16 model parameters.  It stands in for the model where checkpoints read
    and write weights (state_dict, exported_state_dict, load_state_dict), always in fp32."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.model, self.dtype = model, dtype
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        live = dict(model.named_parameters())
        self.params = [torch.nn.Parameter(live[n].detach().to(torch.float32).clone()) for n in self.names]
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
            if getattr(model, "embed_tokens", None) is not None:
                model.embed_tokens = model.embed_tokens.to(dtype)  # gathered in the compute dtype
        for n, m in zip(self.names, self.params):
            live[n].register_post_accumulate_grad_hook(partial(_to_master, m))

    @torch.no_grad()
    def sync(self) -> None:
        """After an optimizer step: the model's bf16 parameters from the updated masters."""
        live = dict(self.model.named_parameters())
        for n, m in zip(self.names, self.params):
            live[n].copy_(m)

    def _fp32(self, sd: dict) -> dict:
        masters = dict(zip(self.names, self.params))
        return {k: (masters[k].detach() if k in masters else v.float() if v.is_floating_point() else v) for k, v in sd.items()}

    def state_dict(self) -> dict:
        return self._fp32(self.model.state_dict())

    def exported_state_dict(self) -> dict:
        return self._fp32(self.model.exported_state_dict())

    def load_state_dict(self, sd: dict, strict: bool = True):
        out = self.model.load_state_dict(sd, strict=strict)  # cast into the bf16 parameters
        with torch.no_grad():
            for n, m in zip(self.names, self.params):
                m.copy_(sd[n])
        return out
