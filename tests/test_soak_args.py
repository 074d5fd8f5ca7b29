"""``scripts/soak.py`` and ``scripts/soak_baseline.py`` without a soak: their flags' ranges."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import soak  # noqa: E402


@pytest.mark.parametrize("flags, message", [
    (["--minutes", "-1"], "--minutes must be > 0 (real minutes of traffic), got -1.0"),
    (["--minutes", "0"], "--minutes must be > 0 (real minutes of traffic), got 0.0"),
    (["--minutes", "nan"], "--minutes must be > 0 (real minutes of traffic), got nan"),
    (["--concurrency", "0"], "--concurrency must be >= 1 (users in flight at once), got 0"),
    (["--sample-s", "0"], "--sample-s must be > 0 (seconds between two samples), got 0.0"),
    (["--day-s", "-5"], "--day-s must be > 0 (real seconds a simulated day lasts), got -5.0"),
    (["--arrivals-per-hour", "0"], "--arrivals-per-hour must be > 0 (conversations per simulated hour), got 0.0"),
    (["--tolerance", "1.5"], "--tolerance must be in [0, 1] (a drop in held-out success, a share), got 1.5"),
    (["--tolerance", "-0.1"], "--tolerance must be in [0, 1] (a drop in held-out success, a share), got -0.1"),
    (["--rss-warmup-min", "-1"], "--rss-warmup-min must be >= 0 (minutes), got -1.0"),
    (["--disk-mb", "8"], "--disk-mb must be >= 64 (MB of tmpfs: the run directory, its versions and the store "
                         "must fit), got 8"),
    (["--disk-hold-s", "-1"], "--disk-hold-s must be >= 0 (seconds), got -1.0"),
    (["--outage-s", "-2"], "--outage-s must be >= 0 (seconds), got -2.0"),
    (["--keep-newest", "-1"], "--keep-newest must be in [0, 1000000] (versions; 0 keeps every one), got -1"),
    (["--keep-promoted", "-1"], "--keep-promoted must be in [0, 1000000] (promoted versions; 0 keeps every one), "
                                "got -1"),
    (["--keep-newest", "0"], "--keep-promoted applies only with --keep-newest >= 1 (0 keeps every version)"),
])
def test_a_flag_out_of_its_range_is_a_usage_error_naming_it(flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        soak.parse_args(flags)
    assert stop.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_the_ends_of_each_range_are_accepted():
    a = soak.parse_args(["--tolerance", "0", "--outage-s", "0", "--disk-hold-s", "0", "--disk-mb", "64",
                         "--concurrency", "1", "--rss-warmup-min", "0", "--keep-newest", "0", "--keep-promoted", "0"])
    assert (a.tolerance, a.outage_s, a.disk_mb, a.concurrency, a.keep_newest, a.keep_promoted) == (0, 0, 64, 1, 0, 0)
    assert soak.parse_args(["--tolerance", "1"]).tolerance == 1.0


@pytest.mark.parametrize("flags, message", [
    (["--conversations", "0"], "--conversations must be >= 1, got 0"),
    (["--concurrency", "-1"], "--concurrency must be >= 1, got -1"),
    (["--families", "arithmetic,nope"], "unknown families ['nope'] in --families; valid: arithmetic, "
                                        "function_calling, web"),
    (["--settings", "new,older"], "unknown settings ['older'] in --settings; valid: new, old"),
])
def test_soak_baseline_refuses_flags_out_of_range_before_it_starts_a_server(flags, message, tmp_path, capsys):
    import soak_baseline

    with pytest.raises(SystemExit) as stop:
        soak_baseline.main(["--out", str(tmp_path / "out"), *flags])
    assert stop.value.code == 2 and f"error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
