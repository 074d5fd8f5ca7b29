"""``scripts/soak.py`` without a soak: its flags' ranges, and that every way a soak ends (SIGTERM,
Ctrl-C, a setup failing after the mount) goes through the same close: the server stopped, the run
directory kept, the tmpfs unmounted; and ``scripts/soak_report.py``'s one argument, the soak's folder, whole or damaged.
Nothing here mounts or starts a server."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import soak  # noqa: E402


@pytest.mark.parametrize("flags, message", [
    (["--minutes", "-1"], "--minutes must be in (0, 525600] (real minutes of traffic, a year at most), got -1.0"),
    (["--minutes", "0"], "--minutes must be in (0, 525600] (real minutes of traffic, a year at most), got 0.0"),
    (["--minutes", "nan"], "--minutes must be in (0, 525600] (real minutes of traffic, a year at most), got nan"),
    (["--concurrency", "0"], "--concurrency must be in [1, 1024] (users in flight at once), got 0"),
    (["--sample-s", "0"], "--sample-s must be finite and > 0 (seconds between two samples), got 0.0"),
    (["--day-s", "-5"], "--day-s must be in (0, 31536000] (real seconds a simulated day lasts), got -5.0"),
    (["--arrivals-per-hour", "0"], "--arrivals-per-hour must be in (0, 10000000] (conversations per simulated hour), "
                                          "got 0.0"),
    (["--tolerance", "1.5"], "--tolerance must be in [0, 1] (a drop in held-out success, a share), got 1.5"),
    (["--tolerance", "-0.1"], "--tolerance must be in [0, 1] (a drop in held-out success, a share), got -0.1"),
    (["--rss-warmup-min", "-1"], "--rss-warmup-min must be finite and >= 0 (minutes), got -1.0"),
    (["--faults", "kill", "--disk-mb", "8"], "--disk-mb must be finite and >= 64 (MB of tmpfs: the run directory, its versions and the store "
                         "must fit), got 8"),
    (["--disk-hold-s", "-1"], "--disk-hold-s must be finite and >= 0 (seconds), got -1.0"),
    (["--outage-s", "-2"], "--outage-s must be finite and >= 0 (seconds), got -2.0"),
    (["--minutes", "inf"], "--minutes must be in (0, 525600] (real minutes of traffic, a year at most), got inf"),
    (["--disk-hold-s", "1e308"], "--disk-hold-s must be shorter than the run (--minutes 90 = 5400 s), got 1e+308"),
    (["--minutes", "2", "--outage-s", "120"], "--outage-s must be shorter than the run (--minutes 2 = 120 s), got 120"),
    (["--minutes", "1", "--disk-hold-s", "90"], "--disk-hold-s must be shorter than the run (--minutes 1 = 60 s), got 90"),
    (["--keep-newest", "-1"], "--keep-newest must be in [0, 1000000] (versions; 0 keeps every one), got -1"),
    (["--keep-promoted", "-1"], "--keep-promoted must be in [0, 1000000] (promoted versions; 0 keeps every one), "
                                "got -1"),
    (["--keep-newest", "0", "--keep-promoted", "2"], "--keep-promoted 2 applies only with --keep-newest >= 1 "
     "(--keep-newest 0 keeps every version): raise --keep-newest, or leave --keep-promoted out"),
    (["--minutes", "1e-9"], "--minutes 1e-09 (6e-08 s) is too short for the default --disk-hold-s 30, --outage-s 5, "
     "--sample-s 10 (each fault's hold must end within the run, which holds 5 samples): lengthen --minutes to more "
     "than 0.833333, or lower --disk-hold-s and --outage-s and --sample-s"),
    (["--minutes", "0.7"], "--minutes 0.7 (42 s) is too short for the default --sample-s 10 (each fault's hold must "
     "end within the run, which holds 5 samples): lengthen --minutes to more than 0.833333, or lower --sample-s"),
    (["--seed", "-1"], "--seed must be in [0, 9223372036854775807] (the simulator's seed), got -1"),
    (["--concurrency", "100000"], "--concurrency must be in [1, 1024] (users in flight at once), got 100000"),
    (["--minutes", "1e9"], "--minutes must be in (0, 525600] (real minutes of traffic, a year at most), got 1000000000.0"),
    (["--day-s", "1e9"], "--day-s must be in (0, 31536000] (real seconds a simulated day lasts), got 1000000000.0"),
    (["--arrivals-per-hour", "1e8"], "--arrivals-per-hour must be in (0, 10000000] (conversations per simulated hour), "
                                     "got 100000000.0"),
    (["--val-size", "0"], "--val-size must be in [1, 100000] (held-out tasks of every family), got 0"),
    (["--val-size", "100000000"], "--val-size must be in [1, 100000] (held-out tasks of every family), got 100000000"),
    # a flag of a fault not injected does nothing: refused, not ignored
    (["--faults", "kill", "--disk-mb", "128"], "--disk-mb applies only with the disk fault (--faults kill): add disk to "
     "--faults, or leave --disk-mb out"),
    (["--faults", "kill", "--disk-hold-s", "60"], "--disk-hold-s applies only with the disk fault (--faults kill)"),
    (["--faults", "collapse", "--outage-s", "30"], "--outage-s applies only with the kill fault (--faults collapse)"),
    (["--keep-newest", "0", "--keep-pruned"], "--keep-pruned applies only with --keep-newest >= 1 (--keep-newest 0 "
     "keeps every version, so none is pruned): raise --keep-newest, or leave --keep-pruned out"),
    (["--minutes", "0.05", "--faults", "kill"], "--minutes 0.05 (3 s) is too short for the default --outage-s 5, "
     "--sample-s 10 (each fault's hold must end within the run, which holds 5 samples): lengthen --minutes to more "
     "than 0.833333, or lower --outage-s and --sample-s"),  # no disk fault: --disk-hold-s not named
])
def test_a_flag_out_of_its_range_is_a_usage_error_naming_it(flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        soak.parse_args(flags)
    assert stop.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_the_ends_of_each_range_are_accepted(tmp_path):
    a = soak.parse_args(["--out", str(tmp_path / "out"), "--tolerance", "0", "--outage-s", "0", "--disk-hold-s", "0", "--disk-mb", "64",
                         "--concurrency", "1", "--rss-warmup-min", "0", "--keep-newest", "0", "--keep-promoted", "0"])
    assert (a.tolerance, a.outage_s, a.disk_mb, a.concurrency, a.keep_newest, a.keep_promoted) == (0, 0, 64, 1, 0, 0)
    assert soak.parse_args(["--out", str(tmp_path / "out"), "--tolerance", "1"]).tolerance == 1.0
    assert not (tmp_path / "out").exists()


def test_keep_newest_0_alone_keeps_every_version(tmp_path):
    a = soak.parse_args(["--out", str(tmp_path / "out"), "--tiny", "--keep-newest", "0"])
    assert (a.keep_newest, a.keep_promoted) == (0, 0)
    a = soak.parse_args(["--out", str(tmp_path / "out"), "--tiny"])
    assert (a.keep_newest, a.keep_promoted) == (3, soak.KEEP_PROMOTED)
    a = soak.parse_args(["--out", str(tmp_path / "out"), "--tiny", "--keep-newest", "1", "--keep-promoted", "0"])
    assert (a.keep_newest, a.keep_promoted) == (1, 0)


@pytest.mark.parametrize("where", ["file", "proc"])
def test_an_out_that_cannot_be_written_is_a_usage_error(tmp_path, where, capsys):
    if where == "file":
        (tmp_path / "f").write_text("")
        out, says = tmp_path / "f" / "x", f"cannot be made: {tmp_path / 'f'} is a file, not a folder"
    else:
        if not Path("/proc").is_dir():
            pytest.skip("no /proc here")
        out, says = Path("/proc/x"), "cannot be written: /proc is not writable here ("  # even as root
    with pytest.raises(SystemExit) as stop:
        soak.parse_args(["--tiny", "--out", str(out)])
    assert stop.value.code == 2
    assert f"error: --out {out} {says}" in capsys.readouterr().err
    assert not out.exists()


def test_the_disk_fault_s_tmpfs_is_at_most_half_the_memory(capsys):
    half = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
    with pytest.raises(SystemExit) as stop:
        soak.parse_args(["--disk-mb", str(half + 1)])
    assert stop.value.code == 2
    assert (f"error: --disk-mb must be in [64, {half}] (MB of tmpfs: the run directory, its versions and the store "
            f"must fit; the disk fault fills it, in memory: at most half of this machine's), got {half + 1}"
            in capsys.readouterr().err)


class FakeServer:
    """What :meth:`soak.Soak.close` uses of ``soak_server.Server``: ``stop``, ``start``, ``starts``."""

    def __init__(self):
        self.stops, self.starts = 0, 1

    def stop(self):
        self.stops += 1

    def start(self, port):
        raise AssertionError("not started in these tests")


@pytest.fixture
def fake_soak(tmp_path, monkeypatch):
    """``soak.main`` on a Soak whose setup gives it a fake server and a run directory (no mount),
    and whose close is recorded; ``umount`` calls are recorded, not run."""
    calls: dict = {"close": 0, "umount": [], "sigterm_before": []}
    setup = {"mounted": False, "fail": None}

    def fake_setup(self):
        self.disk.mkdir(parents=True)
        self.run_dir.mkdir()
        self.server = FakeServer()
        self.mounted = setup["mounted"]
        if setup["fail"]:
            raise setup["fail"]

    real_close = soak.Soak.close

    def counted_close(self):
        calls["close"] += 1
        calls["sigterm_during_close"] = signal.getsignal(signal.SIGTERM)
        real_close(self)
        calls["server"] = self.server

    def fake_run(argv, **kw):
        calls["umount"].append(argv)

    monkeypatch.setattr(soak.Soak, "setup", fake_setup)
    monkeypatch.setattr(soak.Soak, "close", counted_close)
    monkeypatch.setattr(soak.subprocess, "run", fake_run)
    return tmp_path / "out", calls, setup


def test_sigterm_during_the_run_ends_it_through_close(fake_soak, monkeypatch):
    out, calls, _ = fake_soak
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *a: seen.append("outer handler"))  # never the default: it kills pytest
    try:
        def run(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # the handler runs here (or the run ends without it: the test fails below)
            return {}

        monkeypatch.setattr(soak.Soak, "run", run)
        with pytest.raises(SystemExit) as stop:
            soak.main(["--out", str(out), "--tiny"])
        assert stop.value.code == 128 + signal.SIGTERM
        assert calls["close"] == 1 and seen == []
        assert calls["sigterm_during_close"] == signal.SIG_IGN  # a second SIGTERM cannot cut the close short
        assert calls["server"].stops == 2  # stopped, and once more at the end of the close
        with pytest.raises(RuntimeError, match="the soak is closing"):
            calls["server"].start(1234)
        assert (out / "run").resolve() == (out / "disk" / "run").resolve()
        assert not (out / "soak.json").exists()  # an interrupted soak has no record
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # the handler before main is back
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == ["outer handler"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_ctrl_c_during_the_run_ends_it_through_close(fake_soak, monkeypatch):
    out, calls, setup = fake_soak
    setup["mounted"] = True

    def run(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(soak.Soak, "run", run)
    with pytest.raises(KeyboardInterrupt):
        soak.main(["--out", str(out), "--tiny"])
    assert calls["close"] == 1 and calls["umount"] == [["umount", "-l", str(out.absolute() / "disk")]]
    assert (out / "run").is_dir() and not (out / "run").is_symlink()  # copied out of the tmpfs


def test_a_setup_that_fails_after_the_mount_still_unmounts(fake_soak):
    out, calls, setup = fake_soak
    setup["mounted"], setup["fail"] = True, RuntimeError("selfrl serve did not start")
    with pytest.raises(RuntimeError, match="did not start"):
        soak.main(["--out", str(out), "--tiny"])
    assert calls["close"] == 1 and calls["umount"] == [["umount", "-l", str(out.absolute() / "disk")]]


def test_close_after_a_refused_out_touches_nothing(tmp_path):
    """``--out`` not empty: setup refuses before making a server; close then leaves the folder alone."""
    out = tmp_path / "out"
    args = soak.parse_args(["--out", str(out)])  # (parse_args refuses a folder not empty: made after it)
    (out / "disk" / "run").mkdir(parents=True)
    s = soak.Soak(args)
    with pytest.raises(SystemExit, match="is not empty; give a new --out"):
        s.setup()
    s.close()
    s.close()
    assert sorted(p.name for p in out.iterdir()) == ["disk"]


@pytest.mark.parametrize("flags, message", [
    (["--conversations", "0"], "--conversations must be >= 1, got 0"),
    (["--concurrency", "-1"], "--concurrency must be >= 1, got -1"),
    (["--families", "arithmetic,nope"], "unknown families ['nope'] in --families; valid: arithmetic, "
                                        "function_calling, web"),
    (["--settings", "new,older"], "unknown settings ['older'] in --settings; valid: new, old"),
    (["--concurrency", "2000"], "--concurrency must be <= 1024 (the simulator's bound), got 2000"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--out", "{tmp}/file"], "--out {tmp}/file is a file, not a folder; give a new folder"),
])
def test_soak_baseline_refuses_flags_out_of_range_before_it_starts_a_server(flags, message, tmp_path, capsys):
    import soak_baseline

    (tmp_path / "file").write_text("")
    flags, message = [f.format(tmp=tmp_path) for f in flags], message.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as stop:
        soak_baseline.main(["--out", str(tmp_path / "out"), *flags])
    assert stop.value.code == 2 and f"error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: out"),
    (["{tmp}/gone"], "{tmp}/gone holds no finished soak (no soak.json and no run/selfrl.db): pass the folder "
                     "given to scripts/soak.py --out, after the soak ended (a soak stopped early writes no soak.json)"),
    (["{tmp}"], "{tmp} holds no finished soak (no soak.json): pass the folder given to scripts/soak.py --out, "
                "after the soak ended (a soak stopped early writes no soak.json)"),
])
def test_soak_report_without_a_soak_folder_is_a_usage_error(argv, message, tmp_path):
    """It was a traceback (IndexError on sys.argv[1], or the store failing to open). ``{tmp}`` holds
    ``run/selfrl.db`` but no ``soak.json``: a soak stopped early."""
    import subprocess

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "selfrl.db").write_bytes(b"")
    argv = [a.format(tmp=tmp_path) for a in argv]
    script = Path(__file__).resolve().parents[1] / "scripts" / "soak_report.py"
    done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"usage: soak_report.py [-h] out\nsoak_report.py: error: {message.format(tmp=tmp_path)}\n"


def _a_soak_folder(out: Path) -> None:
    """The smallest folder ``scripts/soak_report.py`` reports on: a server's empty store, a
    ``soak.json`` with the keys it reads, one sample, an empty simulator log."""
    import json

    from selfrl.record import served
    from selfrl.record.store import Store

    (out / "run").mkdir(parents=True)
    with Store(out / "run" / "selfrl.db") as store:
        served.init(store)
    (out / "soak.json").write_text(json.dumps({"started": 0.0, "pairs": {}, "faults": [], "args": {
        "tolerance": 0.05, "rss_warmup_min": 10.0, "keep_newest": 0, "keep_promoted": 0}}))
    (out / "timeline.jsonl").write_text(json.dumps({"t": 10.0, "disk_mb": 1.5, "success": {}, "rss_mb": None,
                                                    "pid": None}) + "\n")
    (out / "events.jsonl").write_text("")


def _soak_report(out: Path):
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "soak_report.py"
    return subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120)


PASS = "pass the folder written by scripts/soak.py --out"


def test_soak_report_reports_on_the_smallest_soak_folder(tmp_path):
    """The folder the damaged cases below start from is whole: the report runs and writes its table."""
    _a_soak_folder(tmp_path)
    done = _soak_report(tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr  # (matplotlib may warn: no legend)
    assert "max run dir 1.5 MB" in done.stdout and (tmp_path / "targets.md").read_text() in done.stdout


@pytest.mark.parametrize("damage, message", [
    (lambda o: (o / "timeline.jsonl").unlink(), "{tmp}/timeline.jsonl is missing: " + PASS),
    (lambda o: (o / "timeline.jsonl").write_text(""), "{tmp}/timeline.jsonl holds no samples: " + PASS),
    (lambda o: (o / "timeline.jsonl").write_text('{"t": 1}\n'),
     "{tmp}/timeline.jsonl: sample 1 is not a soak's sample (no disk_mb): " + PASS),
    (lambda o: (o / "timeline.jsonl").write_text('{"t": 1, "disk_mb": 1, "success": {}}\n{"t": 2, "disk'),
     "{tmp}/timeline.jsonl, line 2, is not JSON (Unterminated string starting at: line 1 column 10 (char 9)): " + PASS),
    (lambda o: (o / "events.jsonl").unlink(), "{tmp}/events.jsonl is missing: " + PASS),
    (lambda o: (o / "soak.json").write_text("soak: not json"),
     "{tmp}/soak.json cannot be read as JSON (Expecting value: line 1 column 1 (char 0)): " + PASS),
    (lambda o: (o / "soak.json").write_text("[1, 2]"),
     "{tmp}/soak.json holds a list, not the soak's record (a JSON object): " + PASS),
    (lambda o: (o / "soak.json").write_text('{"started": 0}'),
     "{tmp}/soak.json is not the soak's record (no args, faults, pairs): " + PASS),
    (lambda o: (o / "run" / "selfrl.db").write_bytes(b"garbage, not SQLite " * 100),
     "{tmp}/run/selfrl.db cannot be read as the server's store "
     "({tmp}/run/selfrl.db is not a selfrl store (not SQLite, or damaged / no runs table): give a run directory made by selfrl run/serve, or restore it from a backup): " + PASS),
    (lambda o: (o / "run" / "selfrl.db").write_bytes(b""),
     "{tmp}/run/selfrl.db cannot be read as the server's store "
     "({tmp}/run/selfrl.db is not a selfrl store (not SQLite, or damaged / no runs table): give a run directory made by selfrl run/serve, or restore it from a backup): " + PASS),
], ids=["timeline-missing", "timeline-empty", "sample-incomplete", "timeline-garbage", "events-missing",
        "soak-json-garbage", "soak-json-list", "soak-json-keys", "db-garbage", "db-empty"])
def test_soak_report_on_a_damaged_soak_folder_is_a_usage_error_naming_the_file(damage, message, tmp_path):
    """It was a traceback: a TypeError formatting None (no timeline), a JSONDecodeError (soak.json),
    a sqlite3 error (the store). Nothing is written."""
    _a_soak_folder(tmp_path)
    damage(tmp_path)
    done = _soak_report(tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"usage: soak_report.py [-h] out\nsoak_report.py: error: {message.format(tmp=tmp_path)}\n"
    assert not (tmp_path / "targets.md").exists()


@pytest.mark.parametrize("flags", [[], ["--tiny"]])
def test_the_soak_s_server_validates_every_second_candidate_within_the_age_rule(flags, tmp_path):
    from selfrl.serve.main import load_serve_config

    path = tmp_path / "serve.toml"
    path.write_text(soak.serve_toml(soak.parse_args(["--out", str(tmp_path / "out"), *flags]), tmp_path / "run", 8123, "a-model"))
    cfg = load_serve_config(str(path), {})  # serve's own checks: eval_every - 1 <= max_feedback_age_versions
    assert (cfg.gate.eval_every, cfg.learner.max_feedback_age_versions, cfg.learner.order) == (2, 4, "newest")
    assert [f.name for f in cfg.families] == ["arithmetic", "function_calling", "web"]
