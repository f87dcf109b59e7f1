"""Small units, kept small, by a ratchet: no function over 50 lines, no class over 200, no module
over 500 in the three packages, except the units recorded in ``tests/code_size.json`` with the
size they had when recorded. A recorded unit fails when it grows past its record, and its record
fails once the unit has shrunk below it (lower it: ``python -m tests.test_code_size --lower``,
which only lowers records and drops those a unit no longer needs). A new unit over its limit is
split where it grew, not recorded. And no class body declares one field twice (Python keeps the
second silently: a dataclass's setting would lose its default and meaning without an error)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
RECORD = Path(__file__).with_name("code_size.json")
LIMITS = {"function": 50, "class": 200, "module": 500}


def sizes(root: Path = SRC) -> dict[str, int]:
    """``kind:where`` -> lines of every unit over its limit under ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(root))
        if len(text.splitlines()) > LIMITS["module"]:
            found[f"module:{where}"] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            kind = (
                "function"
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else "class"
                if isinstance(node, ast.ClassDef)
                else None
            )
            lines = node.end_lineno - node.lineno + 1 if kind else 0
            if kind and lines > LIMITS[kind]:
                found[f"{kind}:{where}:{node.name}"] = max(lines, found.get(f"{kind}:{where}:{node.name}", 0))
    return found


def ratchet(found: dict[str, int], recorded: dict[str, int]) -> list[str]:
    """What is wrong with ``found`` against ``recorded``: a unit over its limit and unrecorded, a
    recorded unit grown past its record, a record above its unit's size (to lower)."""
    wrong = []
    for unit, lines in found.items():
        if unit not in recorded:
            wrong.append(
                f"{unit} has {lines} lines, over the limit of {LIMITS[unit.split(':')[0]]}: split it"
            )
        elif lines > recorded[unit]:
            wrong.append(f"{unit} grew to {lines} lines past its record of {recorded[unit]}: shrink it")
    for unit, lines in recorded.items():
        if found.get(unit, 0) < lines:
            wrong.append(f"{unit} is down to {found.get(unit, 0)} lines from its record of {lines}: "
                         "lower the record (python -m tests.test_code_size --lower)")  # fmt: skip
    return wrong


def lowered(found: dict[str, int], recorded: dict[str, int]) -> dict[str, int]:
    """``recorded`` lowered to what ``found`` holds: never raised, never a new unit."""
    return {unit: min(lines, found[unit]) for unit, lines in recorded.items() if unit in found}


def test_no_unit_grows_past_its_limit_or_record():
    assert {p.name for p in SRC.iterdir() if p.is_dir() and not p.name.endswith("egg-info")} >= {
        "hydra_ensembles",
        "hydra_experiments",
        "hydra_cli",
    }
    assert ratchet(sizes(), json.loads(RECORD.read_text(encoding="utf-8"))) == []


def test_the_ratchet_sees_a_new_unit_a_grown_one_and_a_record_to_lower(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(51))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n", encoding="utf-8")
    found = sizes(tmp_path)
    assert found == {"function:long.py:long": 52}
    assert "over the limit of 50" in ratchet(found, {})[0]
    assert "past its record of 51" in ratchet(found, {"function:long.py:long": 51})[0]
    assert "lower the record" in ratchet(found, {"function:long.py:long": 60})[0]
    assert ratchet(found, {"function:long.py:long": 52}) == []
    assert lowered(found, {"function:long.py:long": 60, "function:gone.py:f": 70}) == found


def fields_declared_twice(root: Path = SRC) -> list[str]:
    """``file:Class.name`` for every annotated name a class body declares more than once."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            names = [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
            twice = sorted({n for n in names if names.count(n) > 1})
            found += [f"{path.relative_to(root)}:{node.name}.{n}" for n in twice]
    return found


def test_no_class_declares_a_field_twice(tmp_path):
    assert fields_declared_twice() == []
    (tmp_path / "twice.py").write_text("class C:\n    a: int = 1\n    b: str = ''\n    a: bool = False\n")
    assert fields_declared_twice(tmp_path) == ["twice.py:C.a"]


if __name__ == "__main__":  # python -m tests.test_code_size --lower: lower the records, never raise
    if sys.argv[1:] != ["--lower"]:
        raise SystemExit("usage: python -m tests.test_code_size --lower")
    records = lowered(sizes(), json.loads(RECORD.read_text(encoding="utf-8")))
    RECORD.write_text(json.dumps(dict(sorted(records.items())), indent=1) + "\n", encoding="utf-8")
    print(f"{len(records)} records in {RECORD.name}")
