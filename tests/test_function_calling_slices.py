"""The shipped function-calling configs: each slice gives its held-out set and its full training
set, disjoint; the second slice (``live_simple``) differs from the warm-start config it tests
only in its tasks, so a result there says how the chosen settings carry to unseen data."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from selfrl.config.run import load_config
from selfrl.run.setup import make_source

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, categories", [("function_calling", ["simple"]), ("function_calling_warm", ["simple"]),
                                              ("function_calling_live", ["live_simple"])])
def test_each_slice_has_its_held_out_and_training_tasks(name, categories):
    cfg = load_config(ROOT / "configs" / f"{name}.toml")
    assert cfg.task.options["categories"] == categories
    source = make_source(cfg)
    train, val = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    assert (len(train), len(val)) == (cfg.task.num_train, 64)
    assert not {t.id for t in train} & {t.id for t in val}
    assert all(len(f.get("parameters", {}).get("properties", {})) <= 3 for t in val for f in t.metadata["functions"])


def test_the_second_slice_changes_only_the_tasks():
    warm, live = (tomllib.loads((ROOT / "configs" / f"{n}.toml").read_text())
                  for n in ("function_calling_warm", "function_calling_live"))
    assert live.pop("task") != warm.pop("task")
    assert live == warm
