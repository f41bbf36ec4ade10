"""Draft kinds are found through one registry (eaglenest/kinds/registry.py): a toy kind registered
here, and nowhere else, trains, exports, is checked and loads through the same commands as the
built-in ones; no module outside eaglenest/kinds/ tests a kind's name; no import circle anywhere
in the package (function-level imports included)."""

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_train import cfg, tiny_store  # noqa: F401 -- the shared tiny store fixture

from eaglenest.draft.model import Eagle3Config
from eaglenest.kinds import registry
from eaglenest.kinds.common import judge_tensors
from eaglenest.kinds.eagle3 import Eagle3Kind

PKG = Path(__file__).resolve().parents[1] / "eaglenest"


@dataclass
class ToyConfig(Eagle3Config):
    """The toy kind's config: EAGLE-3's fields and one of its own."""

    toy_rounds: int = 5
    kind: str = "toy"


class ToyKind(Eagle3Kind):
    """An EAGLE-3 head under another name, with its own config class, architecture, export block and
    judge: what a new kind's module would hold (it may reuse another kind's pieces)."""

    name = "toy"
    title = "a toy draft"
    default_engines = ("vllm",)
    config_class = ToyConfig
    calls: list[str] = []

    def hf_config(self, cfg, extra, engines):
        return {**super().hf_config(cfg, extra, engines), "architectures": ["ToyDraft"]}

    def export_extra(self, train: dict) -> dict:
        return {"toy_steps": train["ttt_steps"]}

    def claims(self, raw: dict) -> bool:
        return raw.get("architectures") == ["ToyDraft"]

    def judge(self, r, raw, cfg, tensors, model=None, trained=None) -> None:
        self.calls.append("judge")
        if tensors is not None:
            judge_tensors(r, cfg, tensors)


@pytest.fixture
def toy():
    kind = registry.register(ToyKind())
    kind.calls.clear()
    yield kind
    registry.unregister("toy")


def test_a_toy_kind_trains_exports_checks_and_loads_through_the_registry(toy, tiny_llama_dir, tiny_store, tmp_path):  # noqa: F811
    from eaglenest.cli import main
    from eaglenest.export.format import load_draft, read_draft
    from eaglenest.train.trainer import Trainer

    assert "toy" in registry.names()
    run = tmp_path / "run"
    t = Trainer(cfg(tiny_llama_dir, tiny_store, run, draft_kind="toy", max_steps=2))
    t.fit()
    assert t.model.cfg.kind == "toy" and json.loads((run / "config.json").read_text())["draft"]["kind"] == "toy"
    out = tmp_path / "draft"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    assert "judge" in toy.calls  # export's check went to the kind's judge
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["ToyDraft"] and c["eaglenest"]["toy_steps"] == 3
    d = read_draft(out)
    assert d.kind is toy and type(d.cfg) is ToyConfig and d.cfg.toy_rounds == 5 and d.layer_ids == t.model.cfg.aux_layer_ids
    assert type(t.model.cfg) is ToyConfig and json.loads((run / "config.json").read_text())["draft"]["toy_rounds"] == 5
    assert set(d.tensor_names) == set(toy.expected_tensors(d.cfg))
    back = load_draft(d, embed_weight=t.model.embed_tokens)
    assert type(back) is type(t.model)
    for k, v in back.exported_state_dict().items():
        assert torch.equal(v.float(), t.model.exported_state_dict()[k].bfloat16().float()), k
    # another trainer's config of this kind (no eaglenest block) is recognized by the kind's own claim
    del c["eaglenest"]
    (out / "config.json").write_text(json.dumps(c))
    assert read_draft(out).kind is toy


def test_unknown_kind_is_refused_with_the_registered_ones():
    from eaglenest import EaglenestError

    with pytest.raises(EaglenestError, match="eagle3, dflash"):
        registry.get("pspark")


# a kind's name compared anywhere outside eaglenest/kinds/ is a branch the next kind would have to add to
KIND_TEST = re.compile(r"""\.kind\s*[!=]=|\bdraft_kind\s*[!=]=|\bis_dflash\b|[!=]=\s*["'](eagle3|dflash)["']|["'](eagle3|dflash)["']\s*[!=]=""")
# `--layers dflash` names a layer preset of capture (any kind may use it), not a draft kind
ALLOWED = {("capture/layers.py", 'if spec == "dflash":')}


def test_no_kind_test_outside_the_kinds_package():
    found = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if rel.startswith("kinds/"):
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if KIND_TEST.search(line) and (rel, line.strip()) not in ALLOWED:
                found.append(f"{rel}:{n}: {line.strip()}")
    assert found == []


def _module_imports() -> dict[str, set[str]]:
    mods = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    graph = {}
    for name, p in mods.items():
        tree = ast.parse(p.read_text())
        skip = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                for b in n.body for x in ast.walk(b)}  # never run
        out = set()
        for n in ast.walk(tree):
            if id(n) in skip:
                continue
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("eaglenest"):
                out |= {f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in mods else n.module for a in n.names}
            elif isinstance(n, ast.Import):
                out |= {a.name for a in n.names if a.name.startswith("eaglenest")}
        deps = set()
        for d in out:  # importing a.b.c runs a.b's __init__ first
            parts = d.split(".")
            deps |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
        graph[name] = {d for d in deps if d in mods and d != name and not name.startswith(d + ".")}
    return graph


def test_no_import_circle():
    graph = _module_imports()
    cycles, state = [], {}

    def visit(v, path):
        state[v] = "open"
        for w in sorted(graph[v]):
            if state.get(w) == "open":
                cycles.append(path[path.index(w):] + [w])
            elif w not in state:
                visit(w, path + [w])
        state[v] = "done"

    for v in sorted(graph):
        if v not in state:
            visit(v, [v])
    assert cycles == []
