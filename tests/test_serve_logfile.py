"""selfrl serve's log file: run_dir/serve.log, rotated by size (selfrl.serve.logfile)."""

import copy
import io
import logging
import re
import time

import pytest

from selfrl.config import ConfigError
from selfrl.config.serve import ServeConfig
from selfrl.core.trajectory import Trajectory
from selfrl.record import served as records
from selfrl.safety.gate import EvalResult
from selfrl.serve.logfile import close_log, open_log
from serving import tiny_serve_config


def test_the_log_rotates_and_keeps_its_backups(tmp_path):
    handler = open_log(tmp_path, 2000, 2, stream=io.StringIO())
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
    assert not {handler.file, handler.console} & set(logging.getLogger("selfrl").handlers)  # detached


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
    nofile = open_log(tmp_path / "b", 0, 1)
    try:
        logging.getLogger("selfrl.serve").warning("still on the console")
    finally:
        close_log(nofile)
    assert nofile.file is None and not (tmp_path / "b").exists()
    assert "selfrl: still on the console" in capsys.readouterr().err


def test_a_log_file_that_cannot_be_written_is_one_line_not_a_traceback_per_record(tmp_path, capsys):
    # on a full disk the standard handler printed "--- Logging error ---" and a traceback for every
    # record (199 of them in a 90-minute soak)
    import errno

    class FullDisk(io.StringIO):
        full = True

        def write(self, text):
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(text)

    console = io.StringIO()
    handler = open_log(tmp_path, 10_000, 1, stream=console)
    good, handler.file.stream = handler.file.stream, FullDisk()
    log = logging.getLogger("selfrl.serve")
    try:
        for i in range(5):
            log.info("lost %d", i)
        err = capsys.readouterr().err
        assert err == (f"selfrl: {tmp_path / 'serve.log'} cannot be written ([Errno 28] No space left on device); "
                       "its lines are lost until it can\n")
        assert handler.file.lost == 5
        handler.file.stream = good  # space again
        log.info("written again")
    finally:
        close_log(handler)
    lines = (tmp_path / "serve.log").read_text().splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == [
        "5 lines of this log were lost while it could not be written", "written again"]
    assert "Logging error" not in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("log_max_bytes", -1), ("log_backups", 0)])
def test_log_settings_are_validated(field, value):
    cfg = ServeConfig()
    setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=field):
        cfg.validate()


# held-out tasks each version solves, of 4: the base 2, version 1 all (promoted), version 2 three
# (rejected: 0.75 < 1.0 - 0.02, within the collapse rule's 0.5), version 3 none (a collapse)
SOLVED = {0: 2, 1: 4, 2: 3, 3: 0}


def scripted_validate(engine, tasks, *args, **kwargs) -> EvalResult:
    """Stands in for ``selfrl.safety.gate.validate``: the first ``SOLVED[version]`` tasks solved."""
    return EvalResult(engine.version, [(t.id, i < SOLVED[engine.version], None) for i, t in enumerate(tasks)],
                      0.01, 0.0)


def rated_batch(service, k: int):
    """Four served turns of one group, rated +-1, stored as the server stores them; the learner's batch."""
    batch = []
    for i, feedback in enumerate((1.0, -1.0, 1.0, -1.0)):
        t = Trajectory(f"g{k}", f"g{k}", service.engine.version, prompt_len=3, token_ids=[5, 6, 7, 8 + i],
                       completion_mask=[0, 0, 0, 1], logprobs=[0.0] * 4)
        with service.store.lock:
            records.add_turns(service.store, service.run_id, [records.ServedTurn(t, t.id, 0, t.id, t.task_id, t.id)])
        batch.append((t, {"feedback": feedback, "created_at": time.time(), "group_key": t.task_id}))
    return batch


def test_promotions_rejections_and_collapses_are_lines_in_serve_log_and_on_the_console(
        tiny_tokenizer, tiny_model_factory, tmp_path, monkeypatch):
    from selfrl.serve.service import Service

    monkeypatch.setattr("selfrl.serve.background.validate", scripted_validate)
    cfg = tiny_serve_config(tmp_path / "run", min_batch=4)
    cfg.train.learning_rate, cfg.train.beta, cfg.collapse.beta_min, cfg.train.micro_batch_size = 1e-2, 0.0, 0.0, 4
    cfg.collapse.heldout_drop, cfg.collapse.max_kl, cfg.collapse.reward_rise = 0.5, 1e9, 1e9
    console = io.StringIO()
    handlers = open_log(cfg.run_dir, 100_000, 1, stream=console)
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    try:
        service.learner.ensure_champion_validated()
        results = [service.learner.update(rated_batch(service, k))["result"] for k in range(3)]
    finally:
        service.close()
        close_log(handlers)
    assert results == ["promoted", "rejected", "rolled back (collapse)"]
    log = (tmp_path / "run" / "serve.log").read_text().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO "
    promoted = [line for line in log if "selfrl.events.promote:" in line]
    assert len(promoted) == 1 and re.match(stamp + r"selfrl\.events\.promote: version 1 promoted: held-out 1\.000 "
                                           r"\(best was 0\.500\)$", promoted[0]), log
    rejected = [line for line in log if "selfrl.events.reject:" in line]
    assert len(rejected) == 1 and rejected[0].endswith(
        "version 2 rejected: held-out 0.750 < best 1.000 - 0.02; serving version 1 again"), log
    [collapse] = [line for line in log if "selfrl.events.collapse:" in line]
    assert "held-out success 0.000 < best 1.000 - 0.5" in collapse and "Versions [3] rolled back" in collapse
    assert "serving version 1; backing off to level 1: learning rate 0.005, beta 0" in collapse
    # the console shows the same three with their time; the routine events (a swap) only the file
    shown = console.getvalue().splitlines()
    assert [line[20:40] for line in shown] == ["selfrl: version 1 pr", "selfrl: version 2 re", "selfrl: iteration 2:"]
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d selfrl: ", line) for line in shown), shown
    assert any("selfrl.events.swap: serving version 1" in line for line in log)


def test_a_stop_during_the_start_up_validation_ends_it_after_the_batch_under_way(tiny_tokenizer, tiny_model_factory,
                                                                                tmp_path):
    """Ctrl-C or SIGTERM while the base is validated (minutes on a large held-out set): the
    validation ends between two generation batches, says so in serve.log and records nothing."""
    from selfrl.serve.service import Service

    cfg = tiny_serve_config(tmp_path / "run", min_batch=4)
    cfg.gate.batch_size = 1  # four batches of one held-out task
    handlers = open_log(cfg.run_dir, 100_000, 1, stream=io.StringIO())
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    learner = service.learner
    try:
        learner._halt.set()  # what stop() sets, from the thread that handles the signal
        learner.ensure_champion_validated()
        champ = learner.ledger.champion
        assert champ.success is None and service.store.evaluation(champ.version) == {}
        assert learner.busy is False
    finally:
        service.close()
        close_log(handlers)
    log = (tmp_path / "run" / "serve.log").read_text()
    assert (f"WARNING selfrl.serve: the start-up validation of version {champ.version} stopped after 1 of 4 held-out tasks: the "
            "server stops; the next start validates it again") in log


def test_repeated_late_feedback_is_one_line_a_minute_per_response_and_no_count_is_lost(tmp_path, monkeypatch):
    """200 ratings of one already-trained turn were 200 lines of serve.log: now its first line, then one
    line per minute with the count of those not written; another response has its own lines; the
    store keeps every event, and the report has one row with the count."""
    from selfrl.record.store import Store
    from selfrl.record.versions import EventKind, Ledger
    from selfrl.report.serve import write_serve_report

    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])  # LogRecord.created and the close's count
    monkeypatch.setattr(time, "time_ns", lambda: int(clock[0] * 1e9))
    store = Store(tmp_path / "selfrl.db")
    records.init(store)
    ledger = Ledger(store, store.start_run({"serve": {}}), tmp_path)
    handler = open_log(tmp_path, 1_000_000, 1, stream=io.StringIO())
    late = "came too late for 1 turn(s): already trained on or skipped; recorded, but it changes no update"
    try:
        for i in range(200):  # 200 in 100 s
            clock[0] = 1000.0 + i * 0.5
            ledger.event(EventKind.LATE_FEEDBACK, f"feedback on r1: {late}", {"response_id": "r1", "too_late": 1})
            if i == 10:
                ledger.event(EventKind.LATE_FEEDBACK, f"feedback on r2: {late}", {"response_id": "r2", "too_late": 1})
        clock[0] = 1200.0
        logging.getLogger("selfrl.serve").info("an unrelated line")  # r1's second window has passed: its count
        for _ in range(3):
            ledger.event(EventKind.LATE_FEEDBACK, f"feedback on r1: {late}", {"response_id": "r1", "too_late": 1})
        clock[0] = 1210.0
    finally:
        close_log(handler)
    lines = (tmp_path / "serve.log").read_text().splitlines()
    ours = [ln.split("selfrl.events.late_feedback: ")[1] for ln in lines if "late_feedback" in ln]
    assert ours == [
        f"feedback on r1: {late}",
        f"feedback on r2: {late}",
        f"119 more late_feedback events on response_id r1 in the 60 s since the line above for it, not written one "
        "by one (the store's events table holds each)",
        f"feedback on r1: {late}",  # at 1060 s, a new window
        "79 more late_feedback events on response_id r1 in the 140 s since the line above for it, not written one "
        "by one (the store's events table holds each)",
        f"feedback on r1: {late}",
        "2 more late_feedback events on response_id r1 in the 10 s since the line above for it, not written one by "
        "one (the store's events table holds each)",
    ]
    assert 1 + 119 + 1 + 79 + 1 + 2 == 203
    assert len([e for e in store.events() if e["kind"] == "late_feedback"]) == 204  # every one stored
    text = write_serve_report(tmp_path / "report", store, "serve").read_text()
    store.close()
    rows = [r for r in text.splitlines() if "| late_feedback |" in r]
    assert len(rows) == 2
    assert rows[0].startswith("| 0 s | late_feedback | feedback on r1: ") and "(203 such events, the last at " in rows[0]
    assert rows[1].startswith("| 5 s | late_feedback | feedback on r2: ") and "such events" not in rows[1]
