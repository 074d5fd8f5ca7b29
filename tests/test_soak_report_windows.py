"""The soak's figure (``scripts/soak_report.py``): served success and latency per sample window come
from the simulator's log ``events.jsonl``, not from the samples of ``timeline.jsonl``, which can miss
them; the two clocks are aligned by ``soak.json``'s ``sim_offset_s`` (0, with a note, when absent).
And ``scripts/soak.py`` measures its samples on the monotonic clock, the simulator's own."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from soak_report import NO_OFFSET_NOTE, markdown, sim_offset, windows  # noqa: E402


def request(t: float, latency: float, status: int = 200) -> dict:
    return {"event": "request", "route": "chat", "t_real": t, "status": status, "latency_s": latency,
            "response_id": f"r{t}", "version": 0}


def outcome(t: float, family: str, correct: bool, served: bool = True) -> dict:
    return {"event": "outcome", "t_real": t, "family": family, "served": served, "correct": correct}


def soak(offset: float | None = None, samples: int = 6) -> dict:
    """Samples each 10 s whose own ``success`` stops after 20 s (as a soak whose sampling lost the
    simulator's events did), and a log with requests and outcomes all along."""
    timeline = [{"t": 10.0 * (i + 1), "disk_mb": 1.0, "success": {"web": {"n": 1, "correct": 1}} if i < 2 else {},
                 "latency_p95_s": 1.0 if i < 2 else None} for i in range(samples)]
    sim = []
    for i in range(samples):
        t = 10.0 * i + 5.0
        sim += [request(t, 1.0 + i), request(t + 1, 2.0 + i), request(t + 2, 9.0, status=0),
                outcome(t + 3, "web", i % 2 == 0), outcome(t + 4, "arithmetic", True),
                outcome(t + 4.5, "arithmetic", False, served=False)]
    record = {} if offset is None else {"sim_offset_s": offset}
    return {"timeline": timeline, "sim": sim, "soak": record}


def test_each_window_counts_the_logged_events_after_the_samples_stopped_seeing_them():
    w = windows(soak())
    assert [x["t"] for x in w] == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert [x["completions"] for x in w] == [2] * 6  # the 200s only
    assert [x["latency_p95_s"] for x in w] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert [x["success"] for x in w][4] == {"web": {"n": 1, "correct": 1}, "arithmetic": {"n": 1, "correct": 1}}
    assert [x["success"]["web"]["correct"] for x in w] == [1, 0, 1, 0, 1, 0]  # beyond 20 s too


def test_the_offset_moves_the_events_between_windows():
    d = soak(offset=4.5)  # every event 4.5 s later on the samples' clock
    w = windows(d)
    assert sim_offset(d) == (4.5, None)
    assert [x["completions"] for x in w] == [1, 2, 2, 2, 2, 2]  # each lot's 2nd request (t + 1 + 4.5) in the next window
    assert [sorted(x["success"]) for x in w] == [[]] + [["arithmetic", "web"]] * 5  # the last lot's after 60 s


def a_soak_folder(out: Path, offset: float | None) -> None:
    """A soak's folder of :func:`soak`'s samples and log, an empty store, no faults."""
    import json

    from selfrl.record import served
    from selfrl.record.store import Store

    d = soak(offset)
    (out / "run").mkdir(parents=True)
    with Store(out / "run" / "selfrl.db") as store:
        served.init(store)
    (out / "soak.json").write_text(json.dumps({**d["soak"], "started": 0.0, "pairs": {}, "faults": [], "args": {
        "tolerance": 0.1, "rss_warmup_min": 15.0, "keep_newest": 3, "keep_promoted": 3}}))
    (out / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in d["timeline"]))
    (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in d["sim"]))


def test_the_report_reads_served_success_from_the_log_and_says_when_the_offset_is_missing(tmp_path):
    from soak_report import measure, report

    a_soak_folder(tmp_path / "old", offset=None)
    targets, d = measure(tmp_path / "old")
    assert targets["figure"] == {"sim_offset_s": 0.0, "note": NO_OFFSET_NOTE, "samples": 6, "completions": 12}
    assert [w["success"].get("web") for w in d["windows"]][2:] == [{"n": 1, "correct": c} for c in (1, 0, 1, 0)]
    assert markdown(targets, d).endswith(f"\nNote on soak.png: {NO_OFFSET_NOTE}.\n")

    a_soak_folder(tmp_path / "new", offset=0.5)
    table = report(tmp_path / "new")
    assert "Note on soak.png" not in table and (tmp_path / "new" / "soak.png").stat().st_size > 0
    assert measure(tmp_path / "new")[0]["figure"]["sim_offset_s"] == 0.5


def test_the_soak_measures_its_samples_on_the_monotonic_clock(tmp_path, monkeypatch):
    from soak import Soak, parse_args

    s = Soak(parse_args(["--out", str(tmp_path / "soak"), "--tiny"]))
    before = s.elapsed()
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 17.4)  # the wall clock stepped forward, as in a 90-min soak
    assert 0 <= s.elapsed() - before < 1.0

    class Sim:  # the simulator's start on the same clock, 0.25 s after the soak's
        real0 = s.mono0 + 0.25

    assert abs(s.sim_offset(Sim()) - 0.25) < 1e-9 and s.sim_offset(object()) == 0.0
