"""The SGLang client's requests against SGLang 0.5.23's published `/generate` schema (field lists
as data in tests/sglang_schema.py, with their source), its response checks, the preflight, and the
plugin's install / check plumbing.  No live SGLang is involved.

Two more read the real source, the released sglang-0.5.23 wheel unpacked (tests/foreign.py, as
test_layer_ids.py does; EAGLENEST_SGLANG_SRC overrides it): the field lists are re-extracted from
it, and the payloads are decoded by SGLang's own contract decoder (`sglang/api/v1/api_types.py`,
loaded as a lone file; it needs `msgspec`, in the test extra)."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sglang_schema as schema
from eaglenest.engines.http import RequestFailed
from eaglenest.engines.sglang import install, plugin
from eaglenest.engines.sglang import plugin_cli as pcli
from eaglenest.engines.sglang import preflight
from eaglenest.engines.sglang import protocol as eng



@pytest.fixture(scope="module")
def sglang_src() -> Path:
    from foreign import SGLANG_VERSION, unpacked_wheel

    return unpacked_wheel("sglang", SGLANG_VERSION)


def payloads():
    ids = [[1, 2, 3], [4, 5]]
    return {
        "capture_plugin": eng.generate_payload(ids, ["eaglenest-cap-s-0-a0", "eaglenest-cap-s-1-a0"], eng.capture_sampling(),
                                               extra_keys=["eaglenest-cap-s-0-a0", "eaglenest-cap-s-1-a0"]),
        "capture_stock": eng.generate_payload(ids, ["r0", "r1"], eng.capture_sampling(), extra_keys=["r0", "r1"],
                                              return_hidden_states=True),
        "generate_greedy": eng.generate_payload(ids, ["g0", "g1"], eng.generate_sampling(64, 0.0, 0, [2])),
        "generate_sampled": eng.generate_payload(ids, ["g2", "g3"], eng.generate_sampling(64, 0.7, 5, [2, 7])),
    }


@pytest.mark.parametrize("name", sorted(payloads()))
def test_payload_fields_are_sglang_0_5_23_fields(name):
    body = payloads()[name]
    assert "prompt_token_ids" not in body  # a response field only: never sent
    assert set(body) <= set(schema.GENERATE_REQ_INPUT_FIELDS), set(body) - set(schema.GENERATE_REQ_INPUT_FIELDS)
    assert set(body) <= set(schema.GENERATE_REQUEST_CONTRACT_FIELDS)
    assert set(body["sampling_params"]) <= set(schema.SAMPLING_PARAMS_FIELDS)
    assert set(eng.REQUEST_FIELDS) <= set(schema.GENERATE_REQ_INPUT_FIELDS)
    assert set(eng.SAMPLING_FIELDS) <= set(schema.SAMPLING_PARAMS_FIELDS)
    # batch form: list of lists, one unique rid per sample
    assert all(isinstance(x, list) for x in body["input_ids"]) and len(body["rid"]) == len(body["input_ids"])
    assert len(set(body["rid"])) == len(body["rid"]) and body["return_prompt_token_ids"] is True
    if name.startswith("capture"):
        assert body["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
        assert len(set(body["extra_key"])) == len(body["input_ids"])  # unique per sample: no radix reuse
    assert body.get("return_hidden_states", False) is (name == "capture_stock")
    if name == "generate_sampled":
        assert body["sampling_params"]["sampling_seed"] == 5
    json.dumps(body)


def test_payload_builder_refuses_duplicate_rids():
    with pytest.raises(ValueError):
        eng.generate_payload([[1], [2]], ["same", "same"], {})
    with pytest.raises(ValueError):
        eng.generate_payload([[1], [2]], ["a", "b"], {}, extra_keys=["a"])


def test_response_checks():
    ok = {"output_ids": [9], "meta_info": {"id": "r", "prompt_tokens": 3, "finish_reason": {"type": "length", "length": 1}},
          "prompt_token_ids": [1, 2, 3]}
    assert eng.check_item(ok, "r", [1, 2, 3], "s") is None
    f = eng.check_item({**ok, "meta_info": {**ok["meta_info"], "prompt_tokens": 4}}, "r", [1, 2, 3], "s")
    assert f.reason == "token_mismatch" and "4 prompt tokens, 3 were sent" in f.message
    f = eng.check_item({**ok, "prompt_token_ids": [1, 2, 4]}, "r", [1, 2, 3], "s")
    assert f.reason == "token_mismatch"
    assert eng.check_item(ok, "other", [1, 2, 3], "s").reason == "bad_response"
    ab = {**ok, "meta_info": {**ok["meta_info"], "finish_reason": {"type": "abort", "message": "x"}}}
    assert eng.check_item(ab, "r", [1, 2, 3], "s").reason == "aborted"
    # finish: a stop-token ending always ends with that token
    g = eng.finish("s", [1], {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}, [2])
    assert g.output_ids == [5, 6, 2] and g.finish_reason == "stop"
    g = eng.finish("s", [1], {"output_ids": [5, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}, [2])
    assert g.output_ids == [5, 2]
    g = eng.finish("s", [1], {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2}}}, [2])
    assert g.finish_reason == "length"
    with pytest.raises(RequestFailed):
        eng.response_items([{}, {}], 3)
    # stock hidden states: one 2-D block per prefill chunk, then one row per generated token
    rows = eng.hidden_rows({"meta_info": {"hidden_states": [[[1.0, 2.0]] * 3, [[3.0, 4.0]] * 2, [5.0, 6.0]]}})
    assert rows.shape == (5, 2) and rows[3].tolist() == [3.0, 4.0]


def test_preflight():
    good = {"version": "0.5.23", "cuda_graph_config": {"prefill": {"backend": "disabled"}}, "pp_size": 1}
    assert preflight.preflight_problems(good, "plugin") == ([], [])
    errs, _ = preflight.preflight_problems({**good, "cuda_graph_config": {"prefill": {"backend": "breakable"}}}, "plugin")
    assert errs and "--cuda-graph-backend-prefill disabled" in errs[0]
    errs, warns = preflight.preflight_problems({**good, "version": "0.5.9"}, "stock")
    assert "--enable-return-hidden-states" in errs[0] and "0.5.9" in warns[0]
    assert preflight.preflight_problems({**good, "exec": {"enable_return_hidden_states": True}}, "stock")[0] == []


def test_aux_server_layers_are_read_from_server_info():
    """Stock aux servers: which layers they capture follows from the ids /server_info records and
    the target class's rule (the one table); a mismatch is refused with the ids that would do."""
    ok = {"version": "0.5.23", "enable_return_aux_hidden_states": True, "aux_hidden_state_capture": "eagle3"}
    llama, five = "LlamaForCausalLM", [2, 9, 15, 21, 28]
    assert preflight.aux_server_problem({**ok, "return_aux_hidden_state_layer_ids": [1, 14, 26]}, llama, 30, [2, 15, 27]) is None
    assert preflight.aux_server_problem({**ok, "return_aux_hidden_state_layer_ids": None}, llama, 30, [2, 15, 27]) is None
    assert preflight.aux_server_problem({**ok, "return_aux_hidden_state_layer_ids": [1, 8, 14, 20, 27]}, llama, 30, five) is None
    bad = preflight.aux_server_problem({**ok, "return_aux_hidden_state_layer_ids": [2, 15, 27]}, llama, 30, [2, 15, 27])
    assert "captures before layers [3, 16, 28] (ids [2, 15, 27])" in bad and "--return-aux-hidden-state-layer-ids 1 14 26" in bad
    bad = preflight.aux_server_problem({**ok, "return_aux_hidden_state_layer_ids": [1, 3, 5]}, "DeepseekV3ForCausalLM", 8, [1, 4, 6])
    assert "no ids make SGLang capture before [1, 4, 6]" in bad
    assert "'dflash' convention" in preflight.aux_server_problem({**ok, "aux_hidden_state_capture": "dflash"}, llama, 30, five)
    assert "not started with --enable-return-aux-hidden-states" in preflight.aux_server_problem({"version": "0.5.23"}, llama, 30, five)


# ------------------------------------------------------------------------------- plugin plumbing

MINI = {
    "sglang/srt/models/llama.py": """
class LlamaDecoderLayer:
    def forward(self, positions, hidden_states, forward_batch, capture_output=None):
        return self.attn_boundary.prepare(hidden_states, forward_batch, capture=capture_output)
class LlamaModel:
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        for i in range(3):
            self.layers[i](positions, None, forward_batch, capture_output=None)
class LlamaForCausalLM:
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = layer_ids
""",
    "sglang/srt/models/deepseek_v2.py": """
class DeepseekV2DecoderLayer:
    def forward(self, positions, hidden_states, forward_batch, captured_last_layer_outputs=None):
        return self.attn_boundary.prepare(hidden_states, forward_batch,
                                          capture_gathered=captured_last_layer_outputs)
class DeepseekV2Model:
    def forward(self, input_ids, positions, forward_batch):
        if forward_batch.can_run_tbo:
            end = self.first_k_dense_replace
        model_forward_stages()
        self.layers[0](captured_last_layer_outputs=None)
class DeepseekV2ForCausalLM:
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = layer_ids
""",
    "sglang/srt/model_executor/forward_batch_info.py": """
class ForwardMode:
    EXTEND = 1
    MIXED = 3
class ForwardBatch:
    forward_mode = None
    rids = None
    extend_seq_lens_cpu = None
    extend_prefix_lens_cpu = None
    tbo_split_seq_index = None
""",
    "sglang/srt/plugins/__init__.py": 'GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"\ndef load_plugins():\n    pass\n',
    "sglang/srt/managers/scheduler.py": "def run_scheduler_process():\n    load_plugins()\n",
    "sglang/srt/managers/io_struct.py": """
class GenerateReqInput:
    rid = None
    input_ids = None
    sampling_params = None
    extra_key = None
    return_hidden_states = False
    return_prompt_token_ids = False
""",
    "sglang/srt/models/qwen2.py": """
class Qwen2DecoderLayer:
    def forward(self, positions, hidden_states, forward_batch, capture_output=None):
        return self.attn_boundary.prepare(hidden_states, forward_batch, capture=capture_output)
class Qwen2Model:
    def forward(self, input_ids, positions, forward_batch):
        self.layers[0](capture_output=None)
""",
    "sglang/srt/models/qwen3.py": """
class Qwen3DecoderLayer:
    def forward(self, positions, hidden_states, forward_batch, post_residual_addition=None, capture_output=None):
        return self.attn_boundary.prepare(hidden_states, forward_batch, capture=capture_output)
class Qwen3Model:
    def forward(self, input_ids, positions, forward_batch):
        self.layers[0](capture_output=None)
""",
    "sglang/srt/models/qwen2_moe.py": """
class Qwen2MoeModel:
    def forward(self, input_ids, positions, forward_batch):
        if forward_batch.can_run_tbo:
            model_forward_stages()
        self.layers[0](captured_last_layer_outputs=None)
""",
    "sglang/srt/models/qwen3_moe.py": """
class Qwen3MoeDecoderLayer:
    def forward(self, positions, hidden_states, forward_batch, captured_last_layer_outputs=None, capture_output=None):
        return self.attn_boundary.prepare(hidden_states, forward_batch, capture_gathered=captured_last_layer_outputs)
""",
    "sglang/srt/runtime_context.py": """
class ParallelContext:
    def _read(self, name):
        return config._fields
def get_parallel():
    return _PARALLEL
""",
    "sglang/_version.py": "__version__ = version = '0.5.23'\n",
}


def write_tree(root: Path, files=MINI) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_check_source_tree_finds_every_hook_point(tmp_path):
    root = write_tree(tmp_path)
    res = plugin.check_source_tree(str(root))
    assert len(res) == len(plugin.HOOK_POINTS) and all(ok for _, ok, _ in res), res
    assert pcli.source_version(root) == "0.5.23"
    # an SGLang whose DeepseekV2 layer no longer takes the capture argument fails the check
    broken = dict(MINI)
    broken["sglang/srt/models/deepseek_v2.py"] = MINI["sglang/srt/models/deepseek_v2.py"].replace(
        "captured_last_layer_outputs=None):", "aux=None):").replace("capture_gathered=captured_last_layer_outputs",
                                                                      "capture_gathered=aux")
    res = plugin.check_source_tree(str(write_tree(tmp_path / "b", broken)))
    bad = [w for w, ok, _ in res if not ok]
    assert bad == ["sglang/srt/models/deepseek_v2.py: DeepseekV2DecoderLayer.forward"]


def test_check_cli(tmp_path, capsys):
    from eaglenest.cli import main

    root = write_tree(tmp_path)
    assert main(["sglang-plugin", "check", "--source", str(root)]) == 0
    (root / "sglang/_version.py").write_text("__version__ = version = '0.5.9'\n")
    assert main(["sglang-plugin", "check", "--source", str(root)]) == 1
    assert main(["sglang-plugin", "check", "--source", str(root), "--allow-version-mismatch"]) == 0
    assert "0.5.9 is not the targeted 0.5.23" in capsys.readouterr().out


def test_install_registers_an_sglang_plugin_entry_point(tmp_path):
    """`install` writes a module + dist-info that importlib.metadata (which SGLang's load_plugins()
    uses) discovers in the `sglang.srt.plugins` group; the entry point loads `register`."""
    site = tmp_path / "site"
    site.mkdir()
    written = install.install_into(site)
    assert (site / "eaglenest_sglang_capture.py").exists() and len(written) == 6
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); from importlib.metadata import entry_points; "
            "eps = [e for e in entry_points(group='sglang.srt.plugins')]; f = eps[0].load(); "
            "print(json.dumps([[e.name, e.value] for e in eps] + [f.__name__, f.__module__]))")
    out = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [["eaglenest_capture", "eaglenest_sglang_capture:register"], "register",
                                      "eaglenest_sglang_capture"]
    # the installed module is this plugin, self-contained: importing it needs no eaglenest
    # (-S: no site-packages at all, so neither eaglenest nor torch: importing needs the stdlib only)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "import eaglenest_sglang_capture as m; assert 'eaglenest' not in sys.modules; print(m.TARGET_SGLANG_VERSION)")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(site)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "0.5.23", out.stderr
    removed = install.uninstall_from(site)
    assert len(removed) == 2 and not list(site.iterdir())


def test_launch_commands():
    cmd = pcli.launch_command("/m", "plugin", layer_ids=[2, 16, 29], num_layers=32)
    assert cmd.startswith("EAGLENEST_SGLANG_CAPTURE_DIR=/dev/shm/eaglenest python -m sglang.launch_server")
    assert "--cuda-graph-backend-prefill disabled" in cmd and plugin.ENV_LAYERS not in cmd
    assert "EAGLENEST_SGLANG_LAYERS=3,16,29" in pcli.launch_command("/m", "plugin", layer_ids=[3, 16, 29], num_layers=32)
    aux = pcli.launch_command("/m", "stock-aux", layer_ids=[2, 16, 29], num_layers=32)
    assert "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids 1 15 28" in aux
    ds = pcli.launch_command("/m", "stock-aux", layer_ids=[3, 16, 29], num_layers=32, architecture="DeepseekV3ForCausalLM")
    assert "--return-aux-hidden-state-layer-ids 3 16 29" in ds  # DeepSeek: as given unless the first id is 1
    with pytest.raises(Exception, match="cannot capture before layers"):
        pcli.launch_command("/m", "stock-aux", layer_ids=[1, 16, 29], num_layers=32, architecture="DeepseekV3ForCausalLM")
    d = pcli.launch_command("/m", "serve-draft", layer_ids=[2, 16, 29], num_layers=32, draft="/d", steps=3, topk=1)
    assert ("--speculative-algorithm EAGLE3 --speculative-draft-model-path /d --speculative-num-steps 3 "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4") in d


# ------------------------------------------------------------------------ against the real source


def _fields(path: Path, cls: str) -> tuple[str, ...]:
    tree = ast.parse(path.read_text())
    c = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return tuple(n.target.id for n in c.body if isinstance(n, ast.AnnAssign))


def test_schema_data_matches_the_real_source(sglang_src):
    root = sglang_src
    assert pcli.source_version(root) == schema.VERSION
    assert _fields(root / "sglang/srt/managers/io_struct.py", "GenerateReqInput") == schema.GENERATE_REQ_INPUT_FIELDS
    api = root / "sglang/api/v1/api_types.py"
    assert _fields(api, "GenerateRequest") == schema.GENERATE_REQUEST_CONTRACT_FIELDS
    assert _fields(api, "SamplingParams") == schema.SAMPLING_PARAMS_FIELDS
    assert _fields(api, "GenerateResponse") == schema.GENERATE_RESPONSE_FIELDS
    assert _fields(api, "GenerateMetaInfo") == schema.GENERATE_META_INFO_FIELDS
    assert all(ok for _, ok, _ in plugin.check_source_tree(str(root)))


def test_payloads_pass_sglangs_own_contract_decoder(sglang_src):
    spec = importlib.util.spec_from_file_location("sglang_api_types_0_5_23", sglang_src / "sglang/api/v1/api_types.py")
    api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api)
    for body in payloads().values():
        req = api.GenerateRequest.from_json_value(body)
        assert req.input_ids == body["input_ids"] and req.rid == body["rid"]
    # unknown request keys are ignored by the contract: sending prompt_token_ids would be a silent no-op
    api.GenerateRequest.from_json_value({**payloads()["capture_plugin"], "prompt_token_ids": [[1]]})
    with pytest.raises(api.JsonContractError):  # SamplingParams rejects unknown keys
        api.GenerateRequest.from_json_value({"input_ids": [1], "sampling_params": {"max_tokens": 1}})
    resp = api.GenerateResponse.from_json_value({"output_ids": [3], "prompt_token_ids": [1, 2],
                                                 "meta_info": {"id": "r", "prompt_tokens": 2, "completion_tokens": 1,
                                                               "finish_reason": {"type": "length", "length": 1}}})
    assert resp.meta_info.prompt_tokens == 2


def test_hidden_rows_keep_json_floats_exact():
    x = torch.randn(4, 8).to(torch.bfloat16)
    rows = eng.hidden_rows({"meta_info": {"hidden_states": [x.float().tolist()]}})
    assert torch.equal(rows.to(torch.bfloat16), x)
