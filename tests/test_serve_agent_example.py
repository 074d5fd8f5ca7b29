"""``examples/serve_agent.py`` (``make serve-demo``): per-task held-out outcomes, Wilson intervals and
paired differences from the base, checked on a tiny model behind a real loopback server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from selfrl.core.stats import paired_difference_ci, wilson_interval
from tests.serving import API_KEY, running_server, tiny_serve_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def serve_agent(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import examples.serve_agent as module

    return module


def test_scored_gives_the_interval_and_the_paired_difference(serve_agent):
    row = serve_agent.scored([True, True, False, False], [False, False, False, True])
    assert row["held_out"] == 0.5
    assert row["held_out_correct"] == [True, True, False, False]
    assert row["held_out_ci"] == pytest.approx([0.1500, 0.8500], abs=1e-4)
    # differences 1, 1, 0, -1: mean 0.25, sample sd 0.9574, half width 1.96 * 0.9574 / 2 = 0.9383
    assert row["minus_base"] == pytest.approx([0.25, -0.6883, 1.0], abs=1e-4)
    assert "minus_base" not in serve_agent.scored([True], None)  # the base row has nothing to pair with


def test_demo_against_a_running_server_writes_per_task_outcomes(serve_agent, tiny_model_factory, tiny_tokenizer,
                                                                 tmp_path, monkeypatch, capsys):
    out = tmp_path / "demo.json"
    model = tiny_model_factory(lora=True)
    with running_server(model, tiny_tokenizer, tiny_serve_config(tmp_path / "run")) as (url, _):
        monkeypatch.setenv("SELFRL_API_KEY", API_KEY)
        monkeypatch.setattr(sys, "argv", ["serve_agent.py", "--url", url + "/v1", "--rounds", "1",
                                          "--tasks-per-round", "2", "--held-out", "3", "--workers", "2",
                                          "--out", str(out)])
        assert serve_agent.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["round"] for r in rows] == [0, 1]
    before, after = rows[0]["held_out_correct"], rows[1]["held_out_correct"]
    assert len(before) == len(after) == 3
    for row in rows:
        k = sum(row["held_out_correct"])
        assert row["held_out"] == k / 3
        assert row["held_out_ci"] == pytest.approx(list(wilson_interval(k, 3)))
    assert "minus_base" not in rows[0]
    assert rows[1]["minus_base"] == pytest.approx(list(paired_difference_ci(before, after)))
    printed = capsys.readouterr().out
    assert f"| 0 |  | 0 | {sum(before)}/3 = " in printed
    assert rows[1]["traffic_correct"] == rows[1]["traffic_right"] / 2
    assert f"| 1 | {rows[1]['traffic_right']}/2 | " in printed
