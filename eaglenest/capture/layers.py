"""The one layer-numbering convention eaglenest uses, and converters to the other one.

eaglenest stores and passes layer ids in the **capture-before** convention everywhere:
id k = the residual stream *entering* decoder layer k = HF `output_hidden_states[k]`
(k = 0 is the embedding output, k = N the last layer's output before the final norm).
The canonical EAGLE-3 ids are then `[2, N//2, N-3]` (vLLM, SGLang default, EAGLE reference).
Any number of layers can be captured (DFlash reads 5 by default, `spread_layer_ids`); a feature
store holds the aux states of all of them concatenated, [T, n*H], n = len(store.json layer_ids).

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


DFLASH_LAYERS = 5  # target layers a DFlash draft reads by default (the reference configs' count)


def spread_layer_ids(num_layers: int, count: int) -> list[int]:
    """`count` layers spread over the depth, capture-before: DFlash's default.  The reference
    (`build_target_layer_ids` in SGLang 0.5.23 sglang/srt/speculative/dflash_utils.py, which
    mirrors z-lab/dflash) picks 0-based output-of ids round(1 + i*(N-4)/(count-1)); here they
    are +1 (the same tensors): first 2, last N-2 (EAGLE-3's canonical three end at N-3)."""
    if count < 1:
        raise EaglenestError(f"need at least one layer (asked for {count})")
    if num_layers < 4:
        raise EaglenestError(f"spreading layers needs a target with at least 4 layers (has {num_layers})")
    if count == 1:
        return [num_layers // 2 + 1]
    span = num_layers - 4
    out_of = [int(round(1 + i * span / (count - 1))) for i in range(count)]
    if len(set(out_of)) != count:
        raise EaglenestError(f"{count} layers do not spread over a {num_layers}-layer target without repeats")
    return from_output_of(out_of)


def parse_layer_ids(spec: str | list[int] | None, num_layers: int) -> list[int]:
    """`auto`/None -> the canonical EAGLE-3 ids; `dflash` -> DFlash's default (DFLASH_LAYERS spread over
    the depth); `i,j,k,...` (any count) -> validated capture-before ids."""
    if spec in (None, "", "auto"):
        return default_layer_ids(num_layers)
    if spec == "dflash":
        return spread_layer_ids(num_layers, DFLASH_LAYERS)
    if isinstance(spec, str):
        try:
            ids = [int(x) for x in spec.split(",")]
        except ValueError:
            raise EaglenestError(f"--layers must be 'auto' or integers like 2,15,27 (got {spec!r})") from None
    else:
        ids = [int(k) for k in spec]
    if not ids:
        raise EaglenestError("--layers names no layer")
    for k in ids:
        if not 1 <= k <= num_layers - 1:
            raise EaglenestError(
                f"layer id {k} out of range: capture-before ids must be in 1..{num_layers - 1} for a {num_layers}-layer target"
            )
    if sorted(set(ids)) != ids:
        raise EaglenestError(f"layer ids must be strictly increasing (got {ids})")
    return ids


def require_layer_count(ids: list[int], count: int, what: str, source: str) -> None:
    """Refuse `ids` unless there are exactly `count` of them (EAGLE-3's fc reads three)."""
    if len(ids) != count:
        raise EaglenestError(f"{what} reads exactly {count} aux layers; {source} holds {len(ids)} ({ids}): "
                             f"capture with --layers auto or {count} ids")
