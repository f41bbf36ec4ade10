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
    assert (cfg.model, cfg.ttt_steps, cfg.lr, cfg.report_to, cfg.epochs) == ("smollm2", 3, 1e-3, "tensorboard", 1.0)
