"""No pickle loads anywhere; servers bind to loopback; trust_remote_code only when asked."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = [p for d in ("eaglenest", "bench", "scripts") for p in (ROOT / d).rglob("*.py")]


def test_no_pickle_loads():
    bad = []
    for p in CODE:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            s = line.split("#", 1)[0]
            if re.search(r"\bpickle\.loads?\(|\bcloudpickle\b|\bdill\.load", s):
                bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
            if "torch.load(" in s and "weights_only=True" not in s:
                bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
            if re.search(r"allow_pickle\s*=\s*True", s):
                bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_servers_bind_loopback_only():
    bad = []
    for p in CODE:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"""["']0\.0\.0\.0["']|host\s*=\s*["']["']""", line.split("#", 1)[0]):
                bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_trust_remote_code_is_never_hardcoded_true():
    bad = []
    for p in CODE:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"trust_remote_code\s*=\s*True", line.split("#", 1)[0]):
                bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)
