"""`eaglenest train --dry-run`: the draft a run would build, from the target's config.json alone.

For each attention kind (gqa: one Llama layer; mla: DeepSeek-V2 latent attention) with the run's
EAGLE 3.1 flags, shape overrides and draft vocabulary: the layer's shape, the parameter count of
the draft as exported (built on the meta device: no memory, no weights) and the decoding cache
per token (K and V of every KV head, or MLA's one latent vector), which is what a serving engine
allocates per draft token and request.
"""

from __future__ import annotations

import torch

from eaglenest.draft.model import Eagle3Config, Eagle3Draft
from eaglenest.draft.shape import describe, draft_shape, resolve_attention


def draft_sizes(cfg: Eagle3Config) -> dict:
    """Parameters (total and by part) of the exported draft, and its cache bytes per token (bf16)."""
    with torch.device("meta"):
        d = Eagle3Draft(cfg)
    parts = {"fc": 0, "attention": 0, "mlp": 0, "norms": 0, "lm_head": 0}
    for name, p in d.named_parameters():
        part = ("attention" if ".self_attn." in name and not name.endswith("layernorm.weight") else "mlp" if ".mlp." in name
                else "lm_head" if name.startswith("lm_head") else "fc" if name == "fc.weight" else "norms")
        parts[part] += p.numel()
    return {"parameters": sum(parts.values()), "parameters_by_part": parts, "kv_bytes_per_token": cfg.kv_bytes_per_token(2)}


def dry_run(tcfg) -> str:
    """The text `train --dry-run` prints for a TrainConfig."""
    from eaglenest.capture.layers import default_layer_ids
    from eaglenest.models.target import model_config, resolve_model_path, target_facts

    target = model_config(resolve_model_path(tcfg.model))  # the raw dict: a multimodal wrapper (Kimi-K2.5) needs no transformers class
    f = target_facts(target)
    chosen = resolve_attention(tcfg.draft_attention, f)
    lines = [f"draft plan for {tcfg.model}: {f.family.name} target, {f.num_layers} layers, hidden {f.hidden_size}, "
             f"vocab {f.vocab_size}; draft vocabulary {min(tcfg.draft_vocab, f.vocab_size)}; fc_norm {tcfg.fc_norm}, "
             f"norm_output {tcfg.norm_output}"]
    rows = []
    for kind in ("gqa", "mla"):
        shape = {k: v for k, v in (tcfg.draft_shape or {}).items() if k in draft_shape(f, None, kind).fields()}
        try:
            cfg = Eagle3Config.from_target(target, tcfg.draft_vocab, default_layer_ids(f.num_layers), shape=shape, attention=kind,
                                           fc_norm=tcfg.fc_norm, norm_output=tcfg.norm_output)
        except Exception as e:  # e.g. an MLA draft on a rope the engines cannot serve: say so, show the other kind
            lines.append(f"\n{kind}: not possible for this target: {e}")
            continue
        s = draft_sizes(cfg)
        rows.append((kind, s))
        head, *rest = describe(draft_shape(f, shape, kind), f).split("\n")
        lines += ["", head + ("   <- this run" if kind == chosen else ""), *rest]
        p = s["parameters_by_part"]
        lines.append(f"  parameters {s['parameters']:,} (fc {p['fc']:,}, attention {p['attention']:,}, mlp {p['mlp']:,}, "
                     f"lm_head {p['lm_head']:,}, norms {p['norms']:,}); {2 * s['parameters'] / 2**30:.2f} GiB in bf16")
        lines.append(f"  decoding cache {s['kv_bytes_per_token']:,} bytes per token (bf16)")
    if len(rows) == 2:
        (_, g), (_, m) = rows
        lines.append(f"\nmla vs gqa: {m['parameters'] / g['parameters']:.2f}x the parameters, attention "
                     f"{m['parameters_by_part']['attention'] / g['parameters_by_part']['attention']:.2f}x, "
                     f"cache per token {m['kv_bytes_per_token'] / g['kv_bytes_per_token']:.3f}x")
    return "\n".join(lines)
