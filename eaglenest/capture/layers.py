"""The one layer-numbering convention eaglenest uses, and converters to the other one.

eaglenest stores and passes layer ids in the **capture-before** convention everywhere:
id k = the residual stream *entering* decoder layer k = HF `output_hidden_states[k]`
(k = 0 is the embedding output, k = N the last layer's output before the final norm).
The canonical EAGLE-3 ids are then `[2, N//2, N-3]` (vLLM, SGLang default, EAGLE reference).

SpecForge/ModelOpt use **output-of** ids: id k = output of layer k = HF `hidden_states[k+1]`;
convert with `to_output_of` / `from_output_of`.  What each engine makes of the ids in a draft's
config depends on the engine and on the target's class: export/layer_ids.py.
"""

from __future__ import annotations

from eaglenest import EaglenestError

CONVENTION = "capture-before"


def default_layer_ids(num_layers: int) -> list[int]:
    if num_layers < 4:
        raise EaglenestError(f"EAGLE-3 needs a target with at least 4 layers (has {num_layers})")
    return [2, num_layers // 2, num_layers - 3]


def to_output_of(ids: list[int]) -> list[int]:
    """capture-before id k -> output-of id k-1 (the same tensor)."""
    return [k - 1 for k in ids]


def from_output_of(ids: list[int]) -> list[int]:
    """output-of id k -> capture-before id k+1 (the same tensor)."""
    return [k + 1 for k in ids]


def parse_layer_ids(spec: str | list[int] | None, num_layers: int) -> list[int]:
    """`auto`/None -> canonical ids; `i,j,k` -> validated capture-before ids."""
    if spec in (None, "", "auto"):
        return default_layer_ids(num_layers)
    if isinstance(spec, str):
        try:
            ids = [int(x) for x in spec.split(",")]
        except ValueError:
            raise EaglenestError(f"--layers must be 'auto' or three integers like 2,15,27 (got {spec!r})") from None
    else:
        ids = list(spec)
    if len(ids) != 3:
        raise EaglenestError(f"EAGLE-3 uses exactly three aux layers (got {ids})")
    for k in ids:
        if not 1 <= k <= num_layers - 1:
            raise EaglenestError(
                f"layer id {k} out of range: capture-before ids must be in 1..{num_layers - 1} for a {num_layers}-layer target"
            )
    if sorted(set(ids)) != ids:
        raise EaglenestError(f"layer ids must be strictly increasing (got {ids})")
    return ids
