"""Bad paths and refusals of the ``selfrl`` commands: one line that says what to do, the right
exit code, no traceback, nothing left behind, and nothing loaded first (a model load that would
happen fails the test)."""

import sqlite3
from pathlib import Path

import pytest

import selfrl.model.load
import selfrl.run.setup
from selfrl.cli import main
from selfrl.record.store import NotAStore, Store

NOT_A_STORE = ("is not a selfrl store (not SQLite, or damaged / no runs table): give a run directory made by "
               "selfrl run/serve, or restore it from a backup")


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    """Every refusal here comes before a model loads: loading one fails the test at once."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(selfrl.model.load, "build_policy", refuse)
    monkeypatch.setattr(selfrl.run.setup, "build_policy", refuse)


def bad_store(tmp_path: Path, kind: str) -> Path:
    """A run directory whose selfrl.db is text ("text"), empty ("empty") or SQLite without a runs table."""
    run_dir = tmp_path / kind
    run_dir.mkdir()
    db = run_dir / "selfrl.db"
    if kind == "text":
        db.write_text("hello, not a database\n" * 10)
    elif kind == "empty":
        db.touch()
    else:
        with sqlite3.connect(db) as conn:
            conn.execute("CREATE TABLE other (x)")
    return run_dir


@pytest.mark.parametrize("kind", ["text", "empty", "other_sqlite"])
def test_a_store_that_is_not_one_is_said_by_every_command(kind, tmp_path, capsys):
    run_dir = bad_store(tmp_path, kind)
    before = (run_dir / "selfrl.db").read_bytes()
    said = f"selfrl: error: {run_dir / 'selfrl.db'} {NOT_A_STORE}\n"
    for argv in (["report", str(run_dir)], ["compare", str(run_dir), str(run_dir), "--out", str(tmp_path / "c")],
                 ["run", "--resume", str(run_dir)], ["serve", "--run-dir", str(run_dir)]):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert err == said, argv
    assert (run_dir / "selfrl.db").read_bytes() == before  # never turned into a store
    assert sorted(p.name for p in run_dir.iterdir()) == ["selfrl.db"]


def test_the_store_raises_not_a_store_writable_and_read_only(tmp_path):
    run_dir = bad_store(tmp_path, "text")
    for readonly in (True, False):
        with pytest.raises(NotAStore) as e:
            Store(run_dir / "selfrl.db", readonly=readonly)
        assert str(e.value) == f"{run_dir / 'selfrl.db'} {NOT_A_STORE}"
    with Store(tmp_path / "new" / "selfrl.db") as store:  # a new store is still made
        assert store.runs() == []


def test_a_file_given_for_a_folder_is_said_by_every_command(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    run_dir = tmp_path / "run"
    Store(run_dir / "selfrl.db").close()  # a store with no run yet: the report would be written
    for argv, path, under in (
            (["run", "--run-dir", str(afile)], afile, ""),
            (["serve", "--run-dir", str(afile)], afile, ""),
            (["serve", "--run-dir", str(afile / "sub")], afile, f" ({afile / 'sub'} lies under it)"),
            (["report", str(run_dir), "--out", str(afile)], afile, ""),
            (["compare", str(run_dir), str(run_dir), "--out", str(afile)], afile, ""),
            (["simulate", "--out", str(afile)], afile, "")):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert err == f"selfrl: error: {path} is a file, not a folder{under}: give a folder path\n", argv
    assert afile.read_text() == "keep me\n"


def test_serve_refusals_come_before_the_model_and_leave_nothing(tmp_path, capsys):
    toml = tmp_path / "keep.toml"
    toml.write_text("[retention]\ntrajectories_max_age_s = 700000\n")
    cases = (
        (["--no-learn", "--config", str(toml)], "retention.trajectories_max_age_s needs the background learner (it "
         "prunes after each update), but this server does not learn (--no-learn): drop --no-learn, or set "
         "retention.trajectories_max_age_s = 0"),
        (["--replica"], "{run_dir} has no servable version to follow: start its owner (selfrl serve without "
         "--replica) on it first"),
        (["--model", str(tmp_path / "nonexistent")], f"cannot load model '{tmp_path / 'nonexistent'}': no such "
         "directory (a model is a local directory or a hub id org/name)"),
    )
    for i, (flags, said) in enumerate(cases):
        run_dir = tmp_path / f"run{i}"
        assert main(["serve", "--run-dir", str(run_dir), *flags]) == 2, flags
        out, err = capsys.readouterr()
        assert err == f"selfrl: error: {said.format(run_dir=run_dir)}\n", flags
        assert not run_dir.exists(), flags  # no run directory, no empty serve.log


def test_run_with_a_model_path_that_does_not_exist_leaves_no_run_directory(tmp_path, capsys):
    run_dir, missing = tmp_path / "run", tmp_path / "nonexistent"
    assert main(["run", "--run-dir", str(run_dir), "--model", str(missing)]) == 2
    assert capsys.readouterr().err == (f"selfrl: error: cannot load model '{missing}': no such directory (a model "
                                       "is a local directory or a hub id org/name)\n")
    assert not run_dir.exists()


@pytest.mark.parametrize("command", ["run", "simulate", "serve", "report"])
def test_an_unknown_flag_is_said_with_the_subcommand_s_usage(command, capsys):
    with pytest.raises(SystemExit) as stop:
        main([command, "--bogus", "x"] if command != "report" else [command, "RUN", "--bogus", "x"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: selfrl {command} [-h]")
    assert err.endswith(f"selfrl {command}: error: unrecognized arguments: --bogus x\n"), err


def test_run_help_gives_the_run_dir_default(capsys):
    from selfrl.config import RunConfig

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    assert f"--run-dir RUN_DIR output folder (default: {RunConfig().run_dir}; with --resume: RUN_DIR)" in help_


def test_resume_with_a_damaged_config_json_is_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    Store(run_dir / "selfrl.db").close()
    (run_dir / "config.json").write_text("{not json")
    assert main(["run", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"selfrl: error: {run_dir / 'config.json'} cannot be read as the run's settings (")
    assert err.endswith("): restore it from a backup, or pass --config with the run's settings\n")
