"""A short soak (``scripts/soak.py``): ``selfrl serve`` on the tiny random model as a subprocess,
a pool of simulated users driving it for 45 s, one injected collapse (noise in the weights of one
update) and one ``kill -9`` with a restart on the same run directory. The invariants that must
hold however short the run: no acknowledged turn lost, the collapse caught and rolled back (never
served), no version served that was never promoted, and the learner still running at the end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import soak  # noqa: E402
from soak_report import report  # noqa: E402


@pytest.fixture(scope="module")
def short_soak(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak") / "out"
    args = ["--minutes", "0.75", "--tiny", "--out", str(out), "--faults", "collapse,kill", "--sample-s", "5",
            "--val-size", "3", "--outage-s", "2", "--day-s", "60", "--seed", "1"]
    assert soak.main(args) == 0
    return out, json.loads((out / "targets.json").read_text()), json.loads((out / "soak.json").read_text())


def test_the_help_shows_each_default(capsys):
    with pytest.raises(SystemExit):
        soak.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    for shown in ("(default: 90.0)", "(default: runs/soak)", "(default: collapse,nan_loss,kill,disk)",
                  "(default: 1440.0)", "(default: 3)"):
        assert shown in out, shown


def test_the_help_says_how_long_a_run_must_be_for_the_rss_target(capsys):
    with pytest.raises(SystemExit):
        soak.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "measures it only with --minutes >= this + 20" in out and "(default: 15, and a run shorter than 35 min" in out


@pytest.mark.parametrize("flags, message", [
    (["--out", "{tmp}/file"], "--out {tmp}/file is a file, not a folder; give a new folder"),
    (["--out", "{tmp}/file/out"], "--out {tmp}/file/out cannot be made: {tmp}/file is a file, not a folder"),
    (["--out", "{tmp}/full"], "--out {tmp}/full is not empty; give a new folder"),
    (["--concurrency", "100000"], "--concurrency must be in [1, 1024] (users in flight at once), got 100000"),
    (["--val-size", "100000000"], "--val-size must be in [1, 100000] (held-out tasks of every family), got 100000000"),
    (["--val-size", "400"], "the simulator refuses --val-size 400: families[1] (function_calling).heldout_size: source "
                            "'function_calling' gave only 339 distinct tasks of the 400 asked for"),
    (["--day-s", "0.0001"], "the simulator refuses --minutes 90.0 with --day-s 0.0001: window_s must be > 0 and "
                            "<= 315360000, got 466560000000.0"),
    (["--sample-s", "1000", "--minutes", "3"], "--sample-s 1000 leaves fewer than 5 samples in the run (--minutes 3 = "
                                               "180 s): lower --sample-s to at most 36 or lengthen --minutes"),
    (["--rss-warmup-min", "10", "--minutes", "3"],
     "--rss-warmup-min 10 leaves no RSS growth to measure in the run (--minutes 3): the slope needs 20 min after the "
     "warm-up; lengthen --minutes to at least 30, or leave --rss-warmup-min out (a short run then reports RSS growth "
     "not measured)"),
    (["--rss-warmup-min", "15", "--minutes", "34"], "--rss-warmup-min 15 leaves no RSS growth to measure in the run "
                                                    "(--minutes 34): the slope needs 20 min after the warm-up; "
                                                    "lengthen --minutes to at least 35"),
    (["--faults", ""], "--faults must name at least one fault (a soak is its faults), got ''; valid: collapse, "
                       "nan_loss, kill, disk"),
    (["--faults", ","], "--faults must name at least one fault (a soak is its faults), got ','"),
    (["--faults", "kill,collapse,kill"], "--faults names kill more than once, got 'kill,collapse,kill'; each fault is "
                                         "injected once"),
    (["--tiny", "--model", "some/model"], "--model applies only without --tiny (which serves the tests' tiny model), "
                                          "got --model some/model: leave out one of them"),
], ids=["out-file", "out-under-file", "out-full", "concurrency", "val-size-range", "val-size-tasks", "day-s-window",
        "sample-s", "rss-warmup", "rss-warmup-edge", "faults-empty", "faults-commas", "faults-twice", "model-tiny"])
def test_flags_that_cannot_make_a_soak_are_refused_before_anything_starts(flags, message, tmp_path, capsys,
                                                                            monkeypatch):
    """Each was a traceback, a server that failed after the mount, or a soak that ran and could
    not measure what it was asked to (no faults, RSS growth): now a usage error, nothing made."""
    (tmp_path / "file").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    started = []
    monkeypatch.setattr(soak.Soak, "setup", lambda self: started.append("setup"))
    monkeypatch.setattr(soak.subprocess, "run", lambda *a, **k: started.append(a))
    flags = [f.format(tmp=tmp_path) for f in flags]
    out = [] if "--out" in flags else ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as stop:
        soak.main([*out, *flags])
    assert stop.value.code == 2 and f"error: {message.format(tmp=tmp_path)}" in capsys.readouterr().err
    assert started == [] and not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]


def test_a_run_long_enough_for_its_rss_warm_up_and_samples_is_accepted(tmp_path):
    a = soak.parse_args(["--out", str(tmp_path / "out"), "--rss-warmup-min", "10", "--minutes", "30",
                         "--sample-s", "360", "--faults", "kill"])
    assert (a.rss_warmup_min, a.sample_s, a.faults) == (10.0, 360.0, ["kill"])
    assert soak.parse_args(["--out", str(tmp_path / "out"), "--minutes", "2", "--tiny"]).rss_warmup_min == 15.0
    assert not (tmp_path / "out").exists()


def test_the_faults_were_injected_and_the_server_rode_through(short_soak):
    out, targets, record = short_soak
    kinds = [f["kind"] for f in record["faults"]]
    assert kinds.count("collapse") == 1 and kinds.count("kill") == 1 and kinds.count("restart") == 1
    assert record["server_starts"] == 2 and not record["not_injected"]
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    assert len(timeline) >= 5 and timeline[-1]["up"]
    assert len({t["pid"] for t in timeline}) == 2  # one server process, then the one restarted
    assert (out / "soak.png").stat().st_size > 10_000 and (out / "targets.md").read_text().startswith("| target")


def test_no_acknowledged_turn_is_lost_and_outage_requests_are_counted(short_soak):
    _, targets, _ = short_soak
    t = targets["trajectories_lost"]
    assert t["met"] and t["lost"] == 0 and t["acknowledged"] > 50
    assert t["unanswered_during_outages"] > 0  # users kept sending while the server was down


def test_the_injected_collapse_is_caught_and_rolled_back(short_soak):
    _, targets, _ = short_soak
    c = targets["collapses_caught"]
    assert c["injected"] == c["applied"] == c["caught"] == 1 and c["met"]
    row = c["faults"][0]
    assert row["how"] == "collapse event, rolled back" and row["version"] is not None and not row["served"]


def test_only_promoted_versions_were_served_and_the_learner_runs(short_soak):
    _, targets, _ = short_soak
    u, learner = targets["unpromoted_served"], targets["learner_never_stopped"]
    assert u["met"] and u["bad"] == [] and len(u["versions"]) >= 2  # it learned: more than the base was served
    assert learner["met"] and learner["alive_at_end"] and learner["stops"] == []


def test_the_server_gates_the_users_families_on_held_out_tasks_no_user_asked(short_soak):
    import tomllib

    from selfrl.simulate.families import Family

    out, targets, record = short_soak
    served = tomllib.loads((out / "serve.toml").read_text())["families"]
    assert [f["name"] for f in served] == ["arithmetic", "function_calling", "web"]
    cfg = soak.simulate_config(soak.parse_args(["--tiny", "--val-size", "3", "--out", str(out / "new")]), "http://x",
                               1.0, out)
    for users, server in zip(cfg.families, served):
        assert (users.name, users.env, users.options) == (server["name"], server["source"], server["options"])
        assert (users.heldout_size, users.heldout_seed) == (server["val_size"], server["val_seed"]) == (3, 2000)
    assert [f.tool_choice for f in cfg.families] == ["auto", "required", "required"]
    pairs = record["pairs"]
    for fam in cfg.families:
        held = {f"{fam.name}/{t}" for t in Family(fam).held_out}
        p = pairs[fam.name]
        assert len(p["tasks"]) == 3 and set(p["tasks"]) <= held and len(p["base"]) == len(p["champion"]) == 3
    nf = targets["no_forgetting"]
    assert nf["checked"] >= 3 and set(nf["held_out"]) >= {"arithmetic@v0", "function_calling@v0", "web@v0"}
    assert "served_success" in nf and all(v["n"] == 3 for v in nf["held_out"].values())


def test_the_report_reads_the_same_from_the_folder_alone(short_soak):
    out, targets, _ = short_soak
    table = report(out)
    assert json.loads((out / "targets.json").read_text()) == targets and "| 0 trajectories lost |" in table
