"""What a server's `/server_info` must say before eaglenest captures through it (SGLang 0.5.23
records; some are nested, hence `find_key`)."""

from __future__ import annotations

from eaglenest.engines.sglang.protocol import TARGET_SGLANG_VERSION
from eaglenest.export.layer_ids import rule_text, sglang_captures, sglang_ids_for


def find_key(obj, key: str):
    """First value of `key` anywhere in nested dicts (/server_info nests some records)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            r = find_key(v, key)
            if r is not None:
                return r
    return None


def preflight_problems(info: dict, mode: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) about a server's /server_info for capture in `mode`."""
    errors, warnings = [], []
    version = info.get("version")
    if version != TARGET_SGLANG_VERSION:
        warnings.append(f"server runs SGLang {version}, eaglenest targets {TARGET_SGLANG_VERSION}")
    if (find_key(info, "pp_size") or 1) > 1:
        errors.append("pp_size > 1: capture needs pipeline parallelism off")
    if find_key(info, "enable_dp_attention"):
        errors.append("DP attention is on: the plugin writes from TP rank 0 only")
    if mode == "plugin":
        cg = find_key(info, "cuda_graph_config")
        backend = (cg or {}).get("prefill", {}).get("backend") if isinstance(cg, dict) else find_key(info, "cuda_graph_backend_prefill")
        if backend not in (None, "disabled"):
            errors.append(f"prefill CUDA graph backend is {backend!r}: a replayed graph runs no Python hooks; "
                          "launch with --cuda-graph-backend-prefill disabled")
        if find_key(info, "enable_two_batch_overlap"):
            warnings.append("two-batch overlap is on: DeepseekV2 aux layers under TBO cannot be observed (those samples fail)")
    else:
        if not (find_key(info, "enable_return_hidden_states") or find_key(info, "return_hidden_states_mode") == "full"):
            errors.append("the server was not started with --enable-return-hidden-states")
    return errors, warnings



def aux_server_problem(info: dict, arch: str, num_layers: int, wanted: list[int]) -> str | None:
    """Why a stock aux server does not capture exactly the capture-before layers `wanted`, or None.
    0.5.23 records `enable_return_aux_hidden_states`, the convention `aux_hidden_state_capture`
    ("eagle3" | "dflash" | "dspark", from --speculative-algorithm) and the ids
    `return_aux_hidden_state_layer_ids` (None: the class's EAGLE-3 default) in /server_info; under
    "eagle3" the target class's rule (export/layer_ids.py) says which layers those ids capture."""
    if not find_key(info, "enable_return_aux_hidden_states"):
        return "not started with --enable-return-aux-hidden-states (it would return the final state, not the aux states)"
    convention = find_key(info, "aux_hidden_state_capture")
    if convention not in (None, "eagle3"):
        return (f"captures in the {convention!r} convention; eaglenest reads aux servers in the EAGLE-3 one, whose "
                "layer rule it knows: start it with --speculative-algorithm EAGLE3")
    ids = find_key(info, "return_aux_hidden_state_layer_ids")
    got = sglang_captures(arch, ids, num_layers)
    if got == list(wanted):
        return None
    fix = sglang_ids_for(arch, num_layers, wanted)
    how = (f"start it with --return-aux-hidden-state-layer-ids {' '.join(map(str, fix))}" if fix is not None else
           f"no ids make SGLang capture before {wanted} on this model ({rule_text('sglang', arch)}): pick other layers")
    return f"captures before layers {got} (ids {ids}), this run wants {wanted}: {how}"
