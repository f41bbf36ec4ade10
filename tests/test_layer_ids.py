"""Layer ids right for every engine and family (export/layer_ids.py).

* The SGLang rule table -- the only one: the SGLang engine, its plugin commands and the live tests
  read it -- is checked against SGLang 0.5.23's released source: every entry is a class SGLang
  serves (an `EntryClass`), and its `set_eagle3_layers_to_capture` is executed (a pure-Python
  method) on a stand-in `self`, for many id lists (three ids and five) and layer counts, and must do
  what our rule says.  Every architecture the capture plugin observes has an entry.
* For Llama, Qwen2/3, DeepSeek-V2/V3/Kimi (and the other classes in the table), with canonical and
  non-canonical layers, the ids we write make both engines capture exactly the trained layers, or
  the export is refused.
* Drafts written by other trainers in the output-of convention (SpecForge, TorchSpec's Kimi-K2.5)
  are judged per engine.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from eaglenest import EaglenestError
from eaglenest.capture.layers import default_layer_ids
from eaglenest.export.layer_ids import (
    SGLANG_CLASS_RULE,
    SGLANG_RULES,
    VLLM_EAGLE3_CLASSES,
    config_keys,
    engine_capture,
    sglang_captures,
    sglang_ids_for,
    trained_layers,
)
from foreign import SGLANG_VERSION, unpacked_wheel

# classes whose method hands the ids to their language model's class
DELEGATES = {"KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM"}


class _SGLangSource:
    """The `set_eagle3_layers_to_capture` of every class in sglang/srt/models, from the source."""

    def __init__(self, root: Path):
        self.classes: dict[str, tuple[list[str], dict]] = {}
        self.entry_classes: set[str] = set()  # what SGLang serves: each model file's EntryClass
        for f in sorted((root / "sglang/srt/models").glob("*.py")):
            for node in ast.parse(f.read_text()).body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EntryClass" for t in node.targets):
                    v = node.value
                    self.entry_classes |= {e.id for e in (v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v])
                                           if isinstance(e, ast.Name)}
                if isinstance(node, ast.ClassDef):
                    bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                    methods = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
                    self.classes.setdefault(node.name, (bases, methods))

    def method(self, cls: str) -> ast.FunctionDef:
        bases, methods = self.classes[cls]
        if "set_eagle3_layers_to_capture" in methods:
            return methods["set_eagle3_layers_to_capture"]
        for b in bases:
            if b in self.classes:
                return self.method(b)
        raise KeyError(f"{cls} has no set_eagle3_layers_to_capture")

    def _compiled(self, cls: str):
        fn = copy.deepcopy(self.method(cls))
        fn.decorator_list, fn.returns = [], None
        for a in fn.args.args:
            a.annotation = None  # the module's typing names are not needed to run the rule
        ns: dict = {"get_parallel": lambda: NS(pp_group=NS(is_last_rank=True))}
        exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), f"<sglang {cls}>", "exec"), ns)
        return ns[fn.name]

    def run(self, cls: str, ids, n: int, me=None) -> list[int]:
        """What the class's method stores in `model.layers_to_capture` for eagle_config ids `ids`."""
        me = me or self._fake(n)
        if cls in DELEGATES:
            inner = self._fake(n)
            me.language_model = NS(set_eagle3_layers_to_capture=lambda layer_ids: self.run(DELEGATES[cls], layer_ids, n, inner))
            self._compiled(cls)(me, ids)
            return list(inner.model.layers_to_capture)
        self._compiled(cls)(me, ids)
        return list(me.model.layers_to_capture)

    @staticmethod
    def _fake(n: int):
        model = NS(layers=[NS() for _ in range(n)], layers_to_capture=[])
        model.set_eagle3_layers_to_capture = lambda ids: setattr(model, "layers_to_capture", list(ids))
        return NS(pp_group=NS(is_last_rank=True), capture_aux_hidden_states=False, model=model,
                  config=NS(num_hidden_layers=n, text_config=NS(num_hidden_layers=n)))


@pytest.fixture(scope="module")
def sglang_source():
    return _SGLangSource(unpacked_wheel("sglang", SGLANG_VERSION))


def test_without_sglangs_source_the_comparisons_fail_not_skip(tmp_path, monkeypatch):
    """No SGLang environment, no unpacked wheel, PyPI unreachable: a failure saying how to provide it."""
    import re
    import sys

    monkeypatch.delenv("EAGLENEST_SGLANG_SRC", raising=False)
    monkeypatch.setenv("EAGLENEST_SGLANG_PYTHON", sys.executable)  # this environment: no SGLang in it
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(pytest.fail.Exception, match=f"setup_sglang.sh.*{re.escape(sys.executable)} has no sglang=="):
        unpacked_wheel("sglang", SGLANG_VERSION)


@pytest.mark.parametrize("cls", sorted(SGLANG_CLASS_RULE))
def test_sglang_rules_match_the_released_source(sglang_source, cls):
    assert cls in sglang_source.entry_classes  # an architecture SGLang 0.5.23 serves
    rule = SGLANG_RULES[SGLANG_CLASS_RULE[cls]][0]
    for n in (24, 30, 61):
        probes = [None, default_layer_ids(n), [k - 1 for k in default_layer_ids(n)], [1, 5, 9], [2, 5, 9], [3, 5, 9],
                  [0, n // 2, n - 1], [4, 9, n], [1, 8, 14, 20, 21], [2, 9, 15, 21, n - 2], [3, 5, 7, 9, n]]
        for ids in probes:
            assert sglang_source.run(cls, None if ids is None else list(ids), n) == rule(ids, n), (cls, n, ids)


LLAMA_LIKE = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MistralForCausalLM"]
DEEPSEEK_LIKE = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"]


@pytest.mark.parametrize("arch", LLAMA_LIKE + DEEPSEEK_LIKE + ["GptOssForCausalLM"])
@pytest.mark.parametrize("n", [30, 61])
def test_written_ids_make_both_engines_capture_the_trained_layers(arch, n):
    cases = [default_layer_ids(n), [2, 10, n - 5], [3, n // 2, n - 3], [5, 6, 7], [1, 10, 20]]
    for trained in cases:
        try:
            keys = config_keys(arch, n, trained)
        except EaglenestError as e:
            # only the DeepSeek rule cannot express a set starting at layer 1
            assert arch in DEEPSEEK_LIKE and trained[0] == 1, (arch, trained, e)
            assert "w+1 if w[0] == 1" in str(e)
            assert config_keys(arch, n, trained, engines=("vllm",)) == {"eagle_aux_hidden_state_layer_ids": trained}
            continue
        for engine in ("sglang", "vllm"):
            assert engine_capture(engine, arch, n, keys) == trained, (arch, engine, trained, keys)
        if trained == default_layer_ids(n):
            assert keys == {}  # canonical: left to the engines' defaults
        else:
            assert keys["eagle_aux_hidden_state_layer_ids"] == trained  # vLLM: capture-before


def test_what_we_write_per_family():
    # Llama/Qwen: output-of ids in eagle_config (SGLang adds 1)
    assert config_keys("Qwen2ForCausalLM", 24, [3, 12, 21]) == {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 11, 20]}, "eagle_aux_hidden_state_layer_ids": [3, 12, 21]}
    # DeepSeek/Kimi: output-of when the first id becomes 1 (SGLang adds 1), else capture-before as given
    assert config_keys("DeepseekV3ForCausalLM", 61, [2, 20, 40])["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 19, 39]
    assert config_keys("DeepseekV3ForCausalLM", 61, [3, 20, 40])["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 20, 40]
    # MiniMax-M3 VL shifts even its default: the canonical layers must be written
    keys = config_keys("MiniMaxM3SparseForConditionalGeneration", 40, default_layer_ids(40), engines=("sglang",))
    assert keys["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 19, 36]
    with pytest.raises(EaglenestError, match="no EAGLE-3 layer rule known"):
        config_keys("FalconForCausalLM", 30, [3, 10, 20])
    with pytest.raises(EaglenestError, match="does not implement SupportsEagle3"):
        config_keys("Glm4MoeLiteForCausalLM", 30, [3, 10, 20])  # SGLang can, vLLM 0.32 cannot
    assert config_keys("Glm4MoeLiteForCausalLM", 30, [3, 10, 20], engines=("sglang",)) == {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 10, 20]}, "eagle_aux_hidden_state_layer_ids": [3, 10, 20]}


def test_other_trainers_output_of_ids_are_judged_per_engine():
    # SpecForge for a 30-layer Llama with non-default layers: eagle_config only, output-of
    spec = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 14, 25]}}
    trained, how = trained_layers(spec, 30)
    assert trained == [3, 15, 26] and "output-of" in how
    assert engine_capture("sglang", "LlamaForCausalLM", 30, spec) == trained
    assert engine_capture("vllm", "LlamaForCausalLM", 30, spec) == [2, 14, 25]  # vLLM reads eagle_config as given: one off
    # TorchSpec's published Kimi-K2.5 draft: [1, 29, 57] output-of = capture-before [2, 30, 58] (canonical for 61)
    kimi = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    assert trained_layers(kimi, 61)[0] == [2, 30, 58] == default_layer_ids(61)
    assert engine_capture("sglang", "KimiK25ForConditionalGeneration", 61, kimi) == [2, 30, 58]
    assert engine_capture("vllm", "KimiK25ForConditionalGeneration", 61, kimi) == [1, 29, 57]
    # our own export carries both forms: vLLM reads the top-level ids first
    ours = config_keys("KimiK25ForConditionalGeneration", 61, [2, 30, 50])
    assert all(engine_capture(e, "KimiK25ForConditionalGeneration", 61, ours) == [2, 30, 50] for e in ("sglang", "vllm"))


def test_every_architecture_the_plugin_observes_has_a_rule():
    from eaglenest.engines.sglang import plugin

    assert set(plugin.ARCHITECTURES) <= set(SGLANG_CLASS_RULE), set(plugin.ARCHITECTURES) - set(SGLANG_CLASS_RULE)


def test_sglang_captures_and_the_ids_that_give_a_layer_set():
    """The engine-side helpers over the table (stock-mode aux servers, `sglang-plugin command`)."""
    for arch in ("LlamaForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert sglang_captures(arch, [1, 14, 26], 30) == [2, 15, 27]
        assert sglang_ids_for(arch, 30, [3, 4, 6]) == [2, 3, 5]
        assert sglang_ids_for(arch, 30, [2, 9, 15, 21, 28]) == [1, 8, 14, 20, 27]  # five layers: the same rule
    for ds in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"):
        assert sglang_captures(ds, [1, 3, 5], 61) == [2, 4, 6]
        assert sglang_captures(ds, [2, 3, 5], 61) == [2, 3, 5]
        assert sglang_ids_for(ds, 61, [2, 30, 58]) == [1, 29, 57]  # the published Kimi-K2.5 draft's ids
        assert sglang_ids_for(ds, 61, [3, 4, 6]) == [3, 4, 6]
        assert sglang_ids_for(ds, 61, [1, 4, 6]) is None
        assert sglang_ids_for(ds, 61, [2, 16, 31, 45, 59]) == [1, 15, 30, 44, 58]
    assert sglang_captures("LlamaForCausalLM", None, 30) == [2, 15, 27]
    with pytest.raises(EaglenestError, match="no EAGLE-3 layer rule known for target class FalconForCausalLM"):
        sglang_captures("FalconForCausalLM", [1, 2, 3], 30)


def test_gemma2_has_no_rule_in_either_engine_and_its_export_is_refused(sglang_source):
    with pytest.raises(KeyError, match="Gemma2ForCausalLM has no set_eagle3_layers_to_capture"):
        sglang_source.method("Gemma2ForCausalLM")  # SGLang 0.5.23 serves it, with no EAGLE-3 capture
    assert "Gemma2ForCausalLM" in sglang_source.entry_classes and "Gemma2ForCausalLM" not in SGLANG_CLASS_RULE
    for engines in (("sglang",), ("vllm",), ("sglang", "vllm")):
        with pytest.raises(EaglenestError, match="no EAGLE-3 layer rule known|does not implement SupportsEagle3"):
            config_keys("Gemma2ForCausalLM", 26, default_layer_ids(26), engines=engines)


def test_vllm_eagle3_table_is_a_subset_of_the_sglang_table():
    # every vLLM class we accept also has a known SGLang rule (the docs table lists both)
    assert VLLM_EAGLE3_CLASSES <= set(SGLANG_CLASS_RULE)
