"""selfrl serve's log file: run_dir/serve.log, rotated by size (selfrl.serve.logfile)."""

import logging

import pytest

from selfrl.config import ConfigError
from selfrl.config.serve import ServeConfig
from selfrl.serve.logfile import close_log, open_log


def test_the_log_rotates_and_keeps_its_backups(tmp_path):
    handler = open_log(tmp_path, 2000, 2)
    try:
        log = logging.getLogger("selfrl.serve")
        for i in range(200):  # about 20 kB of lines: ten rotations
            log.info("line %03d %s", i, "x" * 60)
    finally:
        close_log(handler)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["serve.log", "serve.log.1", "serve.log.2"]  # the oldest rotated away
    assert all((tmp_path / f).stat().st_size <= 2000 for f in files)
    last = (tmp_path / "serve.log").read_text().splitlines()[-1]
    assert last.endswith("line 199 " + "x" * 60) and " INFO selfrl.serve: " in last
    assert handler not in logging.getLogger("selfrl").handlers  # detached


def test_warnings_still_reach_the_console_and_zero_means_no_file(tmp_path, capsys):
    handler = open_log(tmp_path / "a", 10_000, 1)
    try:
        logging.getLogger("selfrl.serve").warning("the background learner paused")
        logging.getLogger("selfrl.serve").info("an info line")
    finally:
        close_log(handler)
    err = capsys.readouterr().err
    assert "the background learner paused" in err and "an info line" not in err
    assert "an info line" in (tmp_path / "a" / "serve.log").read_text()
    assert open_log(tmp_path / "b", 0, 1) is None and not (tmp_path / "b").exists()


@pytest.mark.parametrize("field, value", [("log_max_bytes", -1), ("log_backups", 0)])
def test_log_settings_are_validated(field, value):
    cfg = ServeConfig()
    setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=field):
        cfg.validate()
