"""Every command-line script in scripts/ and benchmarks/ opens its ``--help`` with a description
of whole sentences: the first paragraph of its docstring, never a line cut mid-sentence."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for folder in ("scripts", "benchmarks") for p in (ROOT / folder).glob("*.py")
                 if re.search(r"ArgumentParser\(|base_parser\(", p.read_text()) and p.name != "common.py"
                 and '__name__ == "__main__"' in p.read_text())  # a program, not a module of one (soak_args.py)


def help_text(path: Path, monkeypatch) -> str:
    """What ``python PATH --help`` prints (run in this process: the imports are shared)."""
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    monkeypatch.syspath_prepend(str(path.parent))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        runpy.run_path(str(path), run_name="__main__")
    assert stop.value.code == 0, path.name
    return out.getvalue()


def test_the_scan_finds_the_scripts():
    names = {p.name for p in SCRIPTS}
    assert len(SCRIPTS) > 30
    assert {"judge_agreement.py", "judge_detector_table.py", "judge_vs_verifier.py", "bench_serve.py",
            "probe_env.py"} <= names
    assert "gen_reference.py" not in names  # it writes the docs' pages and takes no flags


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_help_description_is_whole_sentences(path, monkeypatch):
    blocks = help_text(path, monkeypatch).split("\n\n")
    assert blocks[0].startswith("usage:"), path.name
    description = " ".join(blocks[1].split())
    assert not description.endswith(":") and not description.startswith(("options", "positional")), \
        f"{path.name}: no description"
    assert description.endswith("."), f"{path.name}: the description stops mid-sentence: ...{description[-60:]!r}"
