"""Every held-out set is the environment's own split (``source.split``): a fixed benchmark such
as BFCL splits its items its own way, and a caller that drew tasks with the generic
``split_tasks`` held out other tasks than ``selfrl run`` and ``selfrl simulate`` do, so its
"held-out" tasks could be ones they train on."""

from __future__ import annotations

import re
from pathlib import Path

from selfrl.config.serve import ServeConfig
from selfrl.envs import get_env
from selfrl.serve.families import held_out_sets

ROOT = Path(__file__).resolve().parents[1]
GENERIC = {"selfrl/core/tasks.py", "selfrl/envs/base.py"}  # its definition, and Env.split's default


def test_serve_holds_out_the_tasks_the_run_and_the_simulator_hold_out(tmp_path):
    cfg = ServeConfig(run_dir=str(tmp_path))
    cfg.task.source, cfg.task.options = "function_calling", {"categories": ["simple"], "max_params": 3}
    cfg.gate.val_size = 16
    source, val, gate = held_out_sets(cfg, store=None, ledger=None)
    env = get_env("function_calling", categories=["simple"], max_params=3)
    assert gate is None
    assert [t.id for t in val] == [t.id for t in env.split(0, 16, cfg.task.train_seed, cfg.task.val_seed)[1]]


def test_nothing_but_the_environments_default_draws_a_split_of_its_own():
    callers = [str(p.relative_to(ROOT)) for d in ("selfrl", "scripts", "benchmarks")
               for p in (ROOT / d).rglob("*.py") if re.search(r"\bsplit_tasks\(", p.read_text())]
    assert sorted(set(callers) - GENERIC) == []
