"""Live: a tiny random DeepSeek-V3 (transformers' DeepseekV3ForCausalLM: MLA + MoE, YaRN, 8 layers,
SmolLM2's tokenizer) served by SGLang 0.5.23's CPU engine in fp32, with eaglenest's capture plugin.

Two servers, each given the aux layer ids as a draft's `eagle_config` would give them
(`--return-aux-hidden-state-layer-ids` goes through the same
`DeepseekV2ForCausalLM.set_eagle3_layers_to_capture`):
  * ids [1, 3, 5] (first id 1: SGLang adds 1 -> captures before layers [2, 4, 6]), plugin on [2, 4, 6];
  * ids [2, 4, 5] (first id not 1: used as given -- the canonical [2, N//2, N-3]), plugin on [2, 4, 5].
Checked: what SGLang captures for those ids (its own aux capture, which feeds a served draft) is
exactly what the plugin captures at the layers `sglang_captures` (export/layer_ids.py) predicts -- the DeepSeek rule,
live, on SGLang's own numbers.  Not asserted, measured and reported: SGLang's CPU forward of this
model does not agree with transformers' (printed by the test): SGLang 0.5.23's MLA prefill on the
torch_native backend attends over the latent KV pool instead of the k/v it is given, which this
config's shapes (nope 32 == kv_lora_rank 32, v 32) happen to allow (docs/sglang.md).
"""

from __future__ import annotations

import pytest
import torch

from sglang_live import hf_hidden_states, make_tiny_deepseek_v3, requires_sglang, served

pytestmark = [pytest.mark.sglang, pytest.mark.slow, requires_sglang]

ARCH = "DeepseekV3ForCausalLM"
CASES = {  # eagle_config ids -> the capture-before layers SGLang should capture (the plugin's, on the same server)
    "first_id_1": ([1, 3, 5], [2, 4, 6]),
    "first_id_not_1": ([2, 4, 5], [2, 4, 5]),
}
PROMPTS = [[1, 9690, 198, 2683, 314, 253, 5356, 30, 1062, 7], [1, 504, 1115, 5420, 28, 3400, 260, 4389]]


@pytest.fixture(scope="module")
def tiny_ds(tmp_path_factory, smollm2):
    return make_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny_ds") / "model", smollm2)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tiny_ds, tmp_path_factory):
    ids, layers = CASES[request.param]
    staging = tmp_path_factory.mktemp(f"ds_staging_{request.param}")
    extra = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
             "--return-aux-hidden-state-layer-ids", *map(str, ids), "--disable-radix-cache"]
    with served(tiny_ds, tmp_path_factory.mktemp(f"ds_{request.param}"), capture_dir=staging, layer_ids=layers,
                extra=extra) as srv:
        yield request.param, ids, layers, srv.url, staging


def _cos(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).min())


def test_sglang_deepseek_rule_and_plugin_capture(tiny_ds, case):
    import httpx

    from eaglenest.engines.base import Captured, Request
    from eaglenest.engines.sglang.engine import SGLangEngine
    from eaglenest.export.layer_ids import sglang_captures

    name, ids, layers, url, staging = case
    H = 128
    assert sglang_captures(ARCH, ids, 8) == layers  # the one rule table, checked live here
    with SGLangEngine(tiny_ds, urls=[url], staging=staging, layers=",".join(map(str, layers)), batch=2) as e:
        got = e.capture([Request(f"p{i}", p) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        c = got[i]
        assert isinstance(c, Captured), c
        assert c.input_ids.tolist() == prompt
        # SGLang's own capture, as it would feed a draft whose eagle_config says `ids`
        r = httpx.post(url + "/generate", json={"input_ids": [prompt], "rid": [f"rule-{name}-{i}"],
                                                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                                                "return_hidden_states": True}, timeout=600)
        r.raise_for_status()
        aux = torch.tensor(r.json()[0]["meta_info"]["hidden_states"][0])
        assert aux.shape == (len(prompt), 3 * H)
        for j in range(3):
            sg, ours = aux[:, j * H:(j + 1) * H], c.aux_hidden_states[:, j * H:(j + 1) * H].float()
            assert _cos(sg, ours) >= 0.99999, (name, j)
            for m in range(3):  # the three layers are told apart: an off-by-one could not pass
                if m != j:
                    assert _cos(sg, c.aux_hidden_states[:, m * H:(m + 1) * H]) < 0.999
        hf = hf_hidden_states(tiny_ds, prompt)
        agreement = [round(_cos(c.aux_hidden_states[:, j * H:(j + 1) * H], hf[k]), 4) for j, k in enumerate(layers)]
        print(f"{name} prompt {i}: plugin layers {layers} vs HF hidden_states, per-token cosine min {agreement}; "
              f"final {round(_cos(c.last_hidden_state, hf[-1]), 4)}")
