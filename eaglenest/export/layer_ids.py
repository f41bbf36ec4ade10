"""Which aux-layer ids a draft's config.json must carry so that each engine captures exactly the
layers the draft was trained on, and which layers an engine will capture for a given config.

eaglenest's ids are capture-before (capture/layers.py): id k = the residual stream entering
decoder layer k = HF `hidden_states[k]`.  Both engines capture that same tensor for an id in their
*internal* list (SGLang: `layers_to_capture`, appended at layer k's entry; vLLM:
`aux_hidden_state_layers`, `hidden_states + residual` before layer k), but they fill that list
from the draft's config differently (read from the released source, see docs/sglang.md):

  * SGLang 0.5.23 reads only `eagle_config.eagle_aux_hidden_state_layer_ids` (w) and hands it to
    the *target* class's `set_eagle3_layers_to_capture(w)`, whose rule depends on the class
    (SGLANG_CLASS_RULE); w absent -> the class's default.
  * vLLM 0.32 (`gpu_model_runner._get_eagle3_aux_layers_from_config`) reads top-level
    `eagle_aux_hidden_state_layer_ids`; when that is absent, `eagle_config`'s ids *as they are*
    (no +1); when both are absent, the model's default [2, N//2, N-3]; then sorts them.  Only
    target classes implementing `SupportsEagle3` can serve an EAGLE-3 draft at all.

`config_keys` picks, per the rules, the ids to write (omitted when the engines' defaults already
are the trained layers) and refuses a layer set an engine cannot express; `engine_capture` is
what check-draft uses to judge any draft (ours or another trainer's) engine by engine.

SGLANG_CLASS_RULE is the one home of SGLang's layer rule: the SGLang engine (stock-mode aux
servers: `sglang_ids_for`), the plugin's launch commands and the live tests read it from here, and
tests/test_layer_ids.py executes every entry's method from the released 0.5.23 source.  The rules
are written for any number of ids (EAGLE-3 uses three, DFlash five): SGLang's methods map each id.
"""

from __future__ import annotations

from collections.abc import Callable

from eaglenest import EaglenestError
from eaglenest.capture.layers import default_layer_ids

ENGINES = ("sglang", "vllm")


def _sg_plus1(w, n):
    return default_layer_ids(n) if w is None else [v + 1 for v in w]


def _sg_plus1_if_first_is_1(w, n):
    if w is None:
        return default_layer_ids(n)
    return [v + 1 for v in w] if w and w[0] == 1 else list(w)


def _sg_plus1_unless_max_is_n(w, n):
    if w is None:
        return default_layer_ids(n)
    return list(w) if w and max(w) == n else [v + 1 for v in w]


def _sg_plus1_default_too(w, n):
    return [v + 1 for v in (default_layer_ids(n) if w is None else w)]


# rule name -> (what SGLang does with eagle_config ids w, for an N-layer target; description)
SGLANG_RULES: dict[str, tuple[Callable, str]] = {
    "plus1": (_sg_plus1, "captures before w+1; default [2, N//2, N-3]"),
    "plus1_if_first_is_1": (_sg_plus1_if_first_is_1, "captures before w+1 if w[0] == 1, else before w as given; default [2, N//2, N-3]"),
    "plus1_unless_max_is_n": (_sg_plus1_unless_max_is_n, "captures before w as given if max(w) == N, else before w+1; default [2, N//2, N-3]"),
    "plus1_default_too": (_sg_plus1_default_too, "captures before w+1, and its default is [3, N//2+1, N-2] (the canonical ids +1)"),
}

# target architecture (config.json `architectures[0]`) -> its SGLang 0.5.23 rule, from
# sglang/srt/models/<file>.py `set_eagle3_layers_to_capture` (tests/test_layer_ids.py executes that source)
SGLANG_CLASS_RULE: dict[str, str] = {
    "LlamaForCausalLM": "plus1",  # llama.py
    "Phi3ForCausalLM": "plus1",  # llama.py (a LlamaForCausalLM subclass)
    "InternLM3ForCausalLM": "plus1",  # llama.py (a LlamaForCausalLM subclass)
    "IQuestCoderForCausalLM": "plus1",  # llama.py (a LlamaForCausalLM subclass)
    "MistralForCausalLM": "plus1",  # mistral.py (inherits llama.py's)
    "Qwen2ForCausalLM": "plus1",  # qwen2.py
    "Qwen3ForCausalLM": "plus1",  # qwen3.py
    "Qwen2MoeForCausalLM": "plus1",  # qwen2_moe.py
    "Qwen3MoeForCausalLM": "plus1",  # qwen3_moe.py
    "Glm4MoeForCausalLM": "plus1",  # glm4_moe.py
    "MiniMaxM2ForCausalLM": "plus1",  # minimax_m2.py
    "MiniMaxM3SparseForCausalLM": "plus1",  # minimax_m3.py
    "Gemma3ForCausalLM": "plus1",  # gemma3_causal.py
    "DeepseekV2ForCausalLM": "plus1_if_first_is_1",  # deepseek_v2.py
    "DeepseekV3ForCausalLM": "plus1_if_first_is_1",  # deepseek_v2.py (inherits; also Kimi-K2)
    "DeepseekV32ForCausalLM": "plus1_if_first_is_1",  # deepseek_v2.py (inherits)
    "KimiK25ForConditionalGeneration": "plus1_if_first_is_1",  # kimi_k25.py -> its DeepseekV3 language model
    "Glm4MoeLiteForCausalLM": "plus1_if_first_is_1",  # glm4_moe_lite.py
    "GptOssForCausalLM": "plus1_unless_max_is_n",  # gpt_oss.py
    "MiniMaxM3SparseForConditionalGeneration": "plus1_default_too",  # minimax_m3_vl.py
}

# target classes of vLLM 0.32 that implement SupportsEagle3 (supports_eagle3(cls) in .venv-vllm;
# tests/test_vllm_unit.py re-checks the list against the installed vLLM)
VLLM_EAGLE3_CLASSES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "GptOssForCausalLM",
    "MiniMaxM2ForCausalLM",
})
# checked in vLLM 0.32 and found without SupportsEagle3 (no EAGLE-3 serving for these targets)
VLLM_NO_EAGLE3 = frozenset({"Qwen2MoeForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "Gemma3ForCausalLM",
                            "Gemma2ForCausalLM"})
# Gemma2ForCausalLM has no SGLang rule either: sglang/srt/models/gemma2.py defines no
# set_eagle3_layers_to_capture, so neither engine serves an EAGLE-3 draft on it (export refused)


def _eagle_config_ids(config: dict):
    ec = config.get("eagle_config")
    ids = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
    return list(ids) if ids else None


def sglang_captures(arch: str | None, ids: list[int] | None, n: int) -> list[int]:
    """The capture-before layers SGLang 0.5.23 captures on an N-layer `arch` target when handed
    `ids` (a draft's eagle_config ids, or a server's --return-aux-hidden-state-layer-ids); None =
    the class's default.  Raises EaglenestError for a class without a known rule."""
    rule = SGLANG_CLASS_RULE.get(arch or "")
    if rule is None:
        raise EaglenestError(
            f"SGLang 0.5.23: no EAGLE-3 layer rule known for target class {arch} (known: {', '.join(sorted(SGLANG_CLASS_RULE))}); "
            "add it to eaglenest/export/layer_ids.py from sglang/srt/models/*.py"
        )
    return list(SGLANG_RULES[rule][0](None if ids is None else list(ids), n))


def sglang_ids_for(arch: str | None, n: int, capture_before: list[int]) -> list[int] | None:
    """The ids to hand SGLang so that it captures exactly `capture_before` on an N-layer `arch`
    target: output-of (`c - 1`, SpecForge's and TorchSpec's form) where the rule allows, else the
    ids as given; None when no ids do (e.g. the DeepSeek rule and a first layer of 1)."""
    for w in ([k - 1 for k in capture_before], list(capture_before)):
        if min(w) >= 0 and sglang_captures(arch, w, n) == list(capture_before):
            return w
    return None


def engine_capture(engine: str, arch: str | None, n: int, config: dict) -> list[int]:
    """The capture-before layer ids `engine` captures for a draft with this config.json on an
    N-layer target of class `arch`.  Raises EaglenestError when the engine cannot serve an EAGLE-3
    draft on that class at all (or eaglenest does not know how it numbers layers)."""
    if engine == "sglang":
        return sglang_captures(arch, _eagle_config_ids(config), n)
    if engine == "vllm":
        if arch not in VLLM_EAGLE3_CLASSES:
            known = "does not implement SupportsEagle3" if arch in VLLM_NO_EAGLE3 else "is not known to implement SupportsEagle3"
            raise EaglenestError(f"vLLM 0.32: target class {arch} {known}: it cannot serve an EAGLE-3 draft")
        ids = config.get("eagle_aux_hidden_state_layer_ids") or _eagle_config_ids(config) or default_layer_ids(n)
        return sorted(set(ids))
    raise EaglenestError(f"unknown engine {engine!r} (one of {', '.join(ENGINES)})")


def rule_text(engine: str, arch: str | None) -> str:
    if engine == "sglang":
        r = SGLANG_CLASS_RULE.get(arch or "")
        return f"SGLang {arch} ({r}): {SGLANG_RULES[r][1]}" if r else f"SGLang {arch}: no rule known"
    return "vLLM: top-level ids as given, else eagle_config's ids as given, else [2, N//2, N-3]"


def config_keys(arch: str | None, n: int, trained: list[int], engines=ENGINES) -> dict:
    """The layer-id keys to put in config.json so that every engine in `engines` captures exactly
    `trained` (capture-before ids).  Omitted where the defaults already are those layers; the
    SGLang ids are written output-of (`trained - 1`) when the rule allows, like SpecForge and
    TorchSpec; refused with the reason when an engine cannot express the layer set."""
    trained = list(trained)
    sglang_candidates: list[list[int] | None] = [None, [k - 1 for k in trained], trained]
    for w in sglang_candidates if "sglang" in engines else [None]:
        keys: dict = {}
        if w is not None:
            keys["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": w}
        if w is not None or trained != default_layer_ids(n):
            keys["eagle_aux_hidden_state_layer_ids"] = trained  # vLLM: capture-before, read before eagle_config
        if all(engine_capture(e, arch, n, keys) == trained for e in engines):
            return keys
    raise EaglenestError(
        f"layers {trained} (capture-before) cannot be served on SGLang 0.5.23 for a {arch} target: "
        f"{rule_text('sglang', arch)}, so no eagle_config ids make it capture before {trained}; "
        f"train on other layers (e.g. with a first id other than 1) or export for vLLM only (--engine vllm)"
    )


def trained_layers(config: dict, n: int) -> tuple[list[int], str]:
    """The layers a draft was trained on (capture-before) and how that was read: eaglenest's own
    record; else a top-level `eagle_aux_hidden_state_layer_ids` (the vLLM / speculators
    convention: capture-before); else `eagle_config`'s ids, which SpecForge and TorchSpec write
    in the output-of convention (k = output of layer k = capture-before k+1); else the canonical
    layers, which every trainer uses by default."""
    ours = (config.get("eaglenest") or {}).get("draft_config", {}).get("aux_layer_ids")
    if ours:
        return list(ours), "eaglenest's record"
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return list(config["eagle_aux_hidden_state_layer_ids"]), "top-level eagle_aux_hidden_state_layer_ids (capture-before)"
    w = _eagle_config_ids(config)
    if w:
        return [k + 1 for k in w], f"eagle_config ids {w} read as output-of (SpecForge/TorchSpec convention)"
    return default_layer_ids(n), "no ids in the config: the canonical layers"
