"""Typed configs (eaglenest/config.py) as `eaglenest train` uses them: flags > --config file >
defaults, by presence; YAML errors name the file, line and field; --print-config."""

import argparse
from dataclasses import dataclass

import pytest

from eaglenest import EaglenestError
from eaglenest.cli import build_parser, main
from eaglenest.config import add_arguments, from_args, option
from eaglenest.train.cli import config_from_args

REQ = ["--model", "M", "--features", "F", "--out", "O"]


def train_args(argv):
    return build_parser().parse_args(["train", *argv])


def test_a_flag_beats_the_file_even_when_it_equals_the_default(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("lr: 3.0e-4\nbatch_tokens: 1024\nttt_steps: 3\n")
    cfg = config_from_args(train_args([*REQ, "--config", str(y), "--lr", "1e-4", "--ttt-steps", "7"]))  # both = the defaults
    assert cfg.lr == 1e-4 and cfg.ttt_steps == 7
    assert cfg.batch_tokens == 1024  # from the file
    assert cfg.grad_accum == 1  # the default
    # booleans: --no-X given on the line beats `X: true` in the file
    y.write_text("freeze_head: true\n")
    assert config_from_args(train_args([*REQ, "--config", str(y)])).freeze_head is True
    assert config_from_args(train_args([*REQ, "--config", str(y), "--no-freeze-head"])).freeze_head is False


def test_required_options_may_come_from_the_file(tmp_path, capsys):
    y = tmp_path / "run.yaml"
    y.write_text("model: smollm2\nfeatures: feats\nout: run\nepochs: 2\nmax_steps: null\n")
    assert main(["train", "--config", str(y), "--out", "run2", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "model: smollm2\n" in printed and "out: run2\n" in printed and "epochs: 2.0\n" in printed and "max_steps: null\n" in printed
    with pytest.raises(EaglenestError, match="missing required option.*--model"):
        config_from_args(train_args(["--out", "o"]))
    with pytest.raises(EaglenestError, match="--features FEAT_DIR is required"):  # unless --online --data
        config_from_args(train_args(["--model", "m", "--out", "o"]))


@pytest.mark.parametrize("text,msg", [
    ("lr: 1e-3\nbatch_tokns: 5\n", r"run.yaml:2: batch_tokns: unknown option"),
    ("lr: 1e-3\nttt_steps: three\n", r"run.yaml:2: ttt_steps: expected int, got 'three'"),
    ("ttt_steps: 2.5\n", r"run.yaml:1: ttt_steps: expected int"),
    ("lr: [1\n", r"run.yaml:\d+: not valid YAML"),
    ("- lr\n", r"run.yaml:1: a config file is a mapping"),
    ("grad_accum: 0\n", r"--grad-accum must be positive"),
])
def test_bad_config_files_are_one_line_errors_naming_file_line_and_field(tmp_path, text, msg):
    y = tmp_path / "run.yaml"
    y.write_text(text)
    with pytest.raises(EaglenestError, match=msg):
        config_from_args(train_args([*REQ, "--config", str(y)]))


def test_the_mechanism_is_reusable_by_any_stage(tmp_path):
    @dataclass
    class Toy:
        data: str = option(help="input")
        n: int = option(3, "how many")
        mode: str = option("a", "which", choices=["a", "b"])
        cap: float | None = option(None, "optional cap")
        fast: bool = option(False, "go fast")

    p = argparse.ArgumentParser()
    add_arguments(p, Toy)
    y = tmp_path / "t.yaml"
    y.write_text("data: x\nn: 5\ncap: 2\n")
    t = from_args(p.parse_args(["--config", str(y), "--mode", "b", "--fast"]), Toy)
    assert t == Toy(data="x", n=5, mode="b", cap=2.0, fast=True)
    assert from_args(p.parse_args(["--data", "y", "--cap", "none"]), Toy) == Toy(data="y")
    with pytest.raises(SystemExit):
        p.parse_args(["--data", "y", "--mode", "c"])  # choices are enforced by argparse
    assert "how many (default: 3)" in p.format_help()


def test_the_readme_example_config_is_valid(tmp_path):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text.split("# run.yaml", 1)[1].split("```", 1)[0].split("\n", 1)[1]
    y = tmp_path / "run.yaml"
    y.write_text(block)
    cfg = config_from_args(train_args(["--config", str(y), "--epochs", "1"]))
    assert (cfg.model, cfg.ttt_steps, cfg.lr, cfg.batch_tokens, cfg.grad_accum, cfg.report_to, cfg.epochs) == \
        ("/models/Llama-3.1-8B-Instruct", 7, 1e-4, 8192, 4, "tensorboard", 1.0)


# Every other command: (argv before the options, YAML file, flags, what --print-config must show).
# Each row has a value only the file sets, a flag that overrides the file, and a default nobody set.
COMMANDS = [
    (["prepare"], "model: smollm2\ndata: [a.jsonl, b.jsonl]\nout: d\nlimit: 5\n", ["--limit", "7"],
     {"data": ["a.jsonl", "b.jsonl"], "limit": 7, "max_length": 2048}),
    (["capture"], "model: m\nout: f\nbatch_tokens: 1024\ndtype: fp32\n", ["--dtype", "auto"],  # the flag = the default
     {"batch_tokens": 1024, "dtype": "auto", "store_dtype": "auto"}),
    (["regenerate"], "model: m\ndata: d\nout: o\ntemperature: 0\nmax_new_tokens: 64\n", ["--max-new-tokens", "512"],
     {"temperature": 0.0, "max_new_tokens": 512, "batch_size": 32}),
    (["eval"], "model: m\ndraft: d\nout: r.json\nsteps: 5\nengine_arg: [a=1]\n", ["--steps", "3", "--engine-arg", "b=2"],
     {"model": "m", "steps": 3, "engine_arg": ["b=2"], "topk": 1}),  # a list flag replaces the file's list
    (["export"], "run: r\nout: o\nengine: [vllm]\n", ["--engine", "sglang", "--engine", "vllm"],
     {"run": "r", "engine": ["sglang", "vllm"], "model": None}),
    (["check-draft"], "draft: d1\ntrained_layers: 2,15,27\n", ["d2"],  # a positional argument beats the file too
     {"draft": "d2", "trained_layers": "2,15,27", "model": None}),
    (["demo"], "out: x\nquick: true\n", ["--no-quick"], {"out": "x", "quick": False, "device": "auto"}),
    (["features", "verify"], "store: s\nrepair: true\n", ["--no-repair"], {"store": "s", "repair": False}),
    (["features", "info"], "store: s\n", ["s2"], {"store": "s2"}),
    (["features", "stats"], "store: s\njson: true\n", ["--no-json"], {"store": "s", "json": False}),
    (["features", "convert"], "store: s\nstore_dtype: fp8\nout: o\n", ["--store-dtype", "bf16"],
     {"store": "s", "store_dtype": "bf16", "out": "o", "ignore_disk": False}),
    (["features", "merge"], "stores: [a, b]\nout: o\n", ["c", "d"], {"stores": ["c", "d"], "out": "o", "ignore_disk": False}),
]


@pytest.mark.parametrize("command,text,flags,expect", COMMANDS, ids=[" ".join(c[0]) for c in COMMANDS])
def test_every_command_takes_a_config_file_and_flags_win(tmp_path, capsys, command, text, flags, expect):
    import yaml

    y = tmp_path / "run.yaml"
    y.write_text(text)
    assert main([*command, "--config", str(y), *flags, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert {k: printed[k] for k in expect} == expect
    y.write_text(text + "bogus_option: 1\n")  # unknown key: refused, naming file:line
    assert main([*command, "--config", str(y), *flags, "--print-config"]) == 2
    line = text.count("\n") + 1
    assert f"{y}:{line}: bogus_option: unknown option" in capsys.readouterr().err


@pytest.mark.parametrize("argv,text,err", [
    (["capture", "--model", "m", "--out", "o"], "engine: nope\n", "run.yaml:1: engine: 'nope' is not one of"),
    (["prepare", "--model", "m", "--out", "o", "--data", "x"], "max_length: 0\n", "run.yaml:1: max_length: must be at least 1, got 0"),
    (["prepare", "--model", "m", "--out", "o"], "data: a.jsonl\n", "run.yaml:1: data: expected a list, got 'a.jsonl'"),
    (["prepare", "--model", "m", "--out", "o"], "data: [a.jsonl, 3]\n", "run.yaml:1: data: expected str, got 3"),
    (["eval", "--model", "m", "--draft", "d"], "", "missing required option(s) --out"),
    (["features", "merge", "--out", "o"], "", "missing required option(s) STORES"),
])
def test_file_values_go_through_the_flags_checks(tmp_path, capsys, argv, text, err):
    """A choice, a positive-int check and a list's item type apply to the file's values as to the flags';
    a required option given by neither is named."""
    y = tmp_path / "run.yaml"
    y.write_text(text)
    assert main([*argv, "--config", str(y), "--print-config"]) == 2
    assert err in capsys.readouterr().err


def test_list_and_positional_fields(tmp_path):
    @dataclass
    class Toy:
        inputs: list[str] = option(help="files", nargs="+")
        tag: list[str] = option(default_factory=list, help="repeatable")
        where: str | None = option(None, "a positional", positional=True)
        no_check: bool = option(False, "a negative switch")

    p = argparse.ArgumentParser()
    add_arguments(p, Toy)
    assert from_args(p.parse_args(["--inputs", "a", "b", "--tag", "x", "--tag", "y", "here", "--no-check"]), Toy) == \
        Toy(inputs=["a", "b"], tag=["x", "y"], where="here", no_check=True)
    y = tmp_path / "t.yaml"
    y.write_text("inputs: [f]\ntag: [z]\nwhere: there\n")
    assert from_args(p.parse_args(["--config", str(y)]), Toy) == Toy(inputs=["f"], tag=["z"], where="there")
    assert from_args(p.parse_args(["--config", str(y), "--tag", "w"]), Toy).tag == ["w"]
    assert from_args(p.parse_args(["--inputs", "a"]), Toy) == Toy(inputs=["a"])


def test_the_docs_eval_example_config_is_valid(tmp_path, capsys):
    import yaml
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "evaluation.md").read_text()
    block = text.split("# eval.yaml", 1)[1].split("```", 1)[0].split("\n", 1)[1]
    y = tmp_path / "eval.yaml"
    y.write_text(block)
    assert main(["eval", "--config", str(y), "--limit", "5", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert (cfg["model"], cfg["limit"], cfg["max_new_tokens"], cfg["temperature"]) == ("smollm2", 5, 128, 0.0)


def test_auto_dtype_follows_the_cpus_bf16_instructions(monkeypatch):
    """--dtype auto (capture, eval, the demo's training): bf16 on a GPU, for server engines and on CPUs with
    bf16 matrix instructions; fp32 on other CPUs (where torch emulates bf16 matmuls); an explicit choice wins."""
    from eaglenest import utils

    for flags, want, kind in (("flags\t: avx2 amx_bf16 amx_tile", "bf16", "amx"),
                              ("flags\t: avx2 avx512f avx512_bf16", "bf16", "avx512-bf16"),
                              ("flags\t: avx2 fma f16c", "fp32", "avx2"), ("", "fp32", "other")):
        monkeypatch.setattr(utils, "cpu_flags", lambda f=flags: f)
        assert utils.cpu_kind() == kind, flags  # the key of the per-CPU choices (the gemv row limit, bench files)
        got, why = utils.auto_dtype("auto", "cpu")
        assert got == want and why.startswith("auto"), (flags, got, why)
        assert utils.auto_dtype("auto", "cpu", engine="vllm")[0] == "bf16"  # a server runs its own kernels
        assert utils.auto_dtype("fp32", "cpu") == ("fp32", "--dtype fp32")
        assert utils.auto_dtype("bf16", "cpu") == ("bf16", "--dtype bf16")
