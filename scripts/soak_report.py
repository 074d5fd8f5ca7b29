"""The soak's verdict (``scripts/soak.py``): the targets measured, and the figure.

    python scripts/soak_report.py runs/soak   # the folder scripts/soak.py --out wrote

Reads ``<out>``: ``soak.json`` (the faults and the held-out pairs), ``timeline.jsonl`` (the
samples), ``events.jsonl`` (every request and verdict of the simulator) and ``run/selfrl.db``
(the server's store: versions, events, metrics, served turns). Writes ``targets.md``,
``targets.json`` and ``soak.png``; returns the markdown table.

How each target is measured:

* **above base**: per family, the paired difference champion - base on the same held-out tasks
  (``selfrl.core.stats.paired_difference_ci``, 95 %); met when the interval is above 0 for
  arithmetic and at least one more family.
* **no forgetting at promoted versions**: each family's held-out success at each promoted
  version (the server's stored results on that family's held-out tasks, the ones its gate
  judged: ``evaluations``, ``<family>/<id>``), against the best the base or an earlier promoted
  version had on the same tasks: a version fails a family when its success is below that best
  minus ``--tolerance`` (the gate's own rule, :func:`selfrl.safety.families.judge_families`,
  here on every family, learned or not). A promoted version without stored results on a family
  is listed as unchecked. Secondary, labelled as such: the simulator's served success of each
  family under each promoted version (its verifier's verdicts on the answers that version
  gave), which compares different tasks from version to version.
* **collapses caught**: each injected collapse that was applied (its update made a version) is
  caught when a ``collapse`` event of that update rolled its version back, or the gate rejected
  it; it was never served in either case. A NaN loss is caught when its update was skipped as
  ``not_finite``.
* **trajectories lost**: every completion the simulator got with a 200 has its stored turn.
* **unpromoted versions served**: every version a 200 named is 0, promoted at some point, or pinned.
* **learner never stopped**: no ``collapse_stop`` or ``learner_error`` event, and the last sample
  shows the learner alive.
* **RSS growth** (``scripts/soak_rss.py``): per server process, the least-squares slope of RSS over the samples after
  ``--rss-warmup-min`` minutes of that process, in % of its RSS then, per hour, where those samples
  span at least ``RSS_MIN_SPAN_MIN`` (20) minutes; the target is these slopes weighted by their
  spans. Each process's segment is reported; a shorter one (a process restarted late) is reported
  as too short, not failed; with none long enough the target is not measured.
* **RSS floor growth** (reported beside the RSS target, not a target of its own): per server
  process, the lowest RSS of each learner cycle (from the end of one learner update to the end of
  the next: a version's ``created_at`` in its store, a chained candidate's too, or a ``skip`` event;
  a skip within a minute of an update's end or of a ``promote``, ``reject`` or ``collapse`` is no
  end of its own) whose trim comes after the process's warm-up, the least-squares slope of those
  floors in % of the first per hour where they are 3 or more over at least ``RSS_MIN_SPAN_MIN``
  minutes, weighted by span across processes (``soak_rss.rss_floor_growth``). A served learner's
  RSS is a sawtooth (it climbs through an update and its gate, and falls when the learner gives
  the update's memory back before the next), so the slope over every sample rises when later
  updates run longer; the floor rises only when something is kept from update to update.
* **the figure** (``soak.png``): each family's served success and the completions' latency p95
  per sample window come from ``events.jsonl`` (the simulator's own log), each event placed at
  its ``t_real`` plus ``soak.json``'s ``sim_offset_s`` (the simulator's start, in seconds after
  the soak's) and counted in the window (previous sample's ``t``, this sample's ``t``] of
  ``timeline.jsonl`` (:func:`windows`); the RSS and the run directory's size are the samples'
  own. A ``soak.json`` without ``sim_offset_s`` (an older soak) is read with 0 (the simulator
  starts within a second of the soak), and ``targets.md`` says so.
* **disk within retention**: at the end, every adapter folder is one of the newest
  ``keep_newest``, a base, promoted, pinned or served version (with ``--keep-promoted`` the server
  keeps fewer promoted ones: the check allows every promoted version, so it is an upper bound; the
  server also keeps the served versions whose turns a late judgement may still train on, at most
  ``learner.max_feedback_age_versions`` weight changes back). Retention runs after each learner
  update, its gate included; the versions made by an update still under way at the end (newer
  than the last sample's last finished update) have had no pass, so the newest ``keep_newest``
  are counted among the versions before them, and those versions are allowed too (named).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # soak_rss, beside this script

from soak_rss import (  # noqa: E402,F401  (the RSS measures; the tests import them from here too)
    RSS_MIN_SPAN_MIN, rss_floor_growth, rss_floor_text, rss_growth, rss_segments, rss_text,
)


PASS_THE_FOLDER = "pass the folder written by scripts/soak.py --out"
SOAK_KEYS = ("started", "args", "faults", "pairs")  # what the report reads of soak.json
SAMPLE_KEYS = ("t", "disk_mb")  # what it reads of every sample of timeline.jsonl


class NotASoak(ValueError):
    """A file of the soak's folder is missing or unreadable; the message names it and says what to pass."""


def _read_json(path: Path) -> dict:
    """``soak.json`` as a dict with :data:`SOAK_KEYS`. Raises NotASoak: not JSON, not an object, a key missing."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotASoak(f"{path} cannot be read as JSON ({e}): {PASS_THE_FOLDER}") from None
    if not isinstance(record, dict):
        raise NotASoak(f"{path} holds a {type(record).__name__}, not the soak's record (a JSON object): {PASS_THE_FOLDER}")
    missing = [k for k in SOAK_KEYS if k not in record]
    if missing:
        raise NotASoak(f"{path} is not the soak's record (no {', '.join(missing)}): {PASS_THE_FOLDER}")
    return record


def _read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of ``path``, one a line (blank lines skipped). Raises NotASoak: ``path``
    missing or unreadable, or a line that is not a JSON object."""
    if not path.exists():
        raise NotASoak(f"{path} is missing: {PASS_THE_FOLDER}")
    rows = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise NotASoak(f"{path} cannot be read ({e}): {PASS_THE_FOLDER}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise NotASoak(f"{path}, line {n}, is not JSON ({e}): {PASS_THE_FOLDER}") from None
        if not isinstance(row, dict):
            raise NotASoak(f"{path}, line {n}, is not a JSON object: {PASS_THE_FOLDER}")
        rows.append(row)
    return rows


def load(out: Path) -> dict:
    """Everything the report reads of the soak's folder ``out`` (see the module docstring).

    Raises:
        NotASoak: ``soak.json`` unreadable or not the soak's record; ``timeline.jsonl`` or
            ``events.jsonl`` (the simulator's log, written from its start) missing or not JSON
            lines, or a timeline without a sample or with a sample lacking one of :data:`SAMPLE_KEYS`;
            ``run/selfrl.db`` not a server's store (not
            SQLite, empty, or without the server's tables).
    """
    import sqlite3

    from selfrl.record.store import NotAStore, Store

    soak, timeline = _read_json(out / "soak.json"), _read_jsonl(out / "timeline.jsonl")
    if not timeline:
        raise NotASoak(f"{out / 'timeline.jsonl'} holds no samples: {PASS_THE_FOLDER}")
    for n, sample in enumerate(timeline, 1):
        missing = [k for k in SAMPLE_KEYS if k not in sample]
        if missing:
            raise NotASoak(f"{out / 'timeline.jsonl'}: sample {n} is not a soak's sample (no {', '.join(missing)}): "
                           f"{PASS_THE_FOLDER}")
    sim = _read_jsonl(out / "events.jsonl")
    run = out / "run"
    try:
        with Store(run / "selfrl.db", readonly=True) as store:
            versions = {v["version"]: v for v in store.versions()}
            events = store.events()
            metrics = store.metrics()
            served = {r[0]: r[1] for r in store.conn.execute("SELECT response_id, trajectory_id FROM served")}
            evaluations = {int(r[0]): store.evaluation(int(r[0]))
                           for r in store.conn.execute("SELECT DISTINCT version FROM evaluations")}
    except (sqlite3.DatabaseError, NotAStore) as e:
        raise NotASoak(f"{run / 'selfrl.db'} cannot be read as the server's store ({e}): {PASS_THE_FOLDER}") from None
    return {"evaluations": evaluations, "soak": soak, "timeline": timeline,
            "sim": sim, "versions": versions, "events": events, "metrics": metrics,
            "served": served, "run": run}


def above_base(d: dict) -> dict:
    from selfrl.core.stats import paired_difference_ci

    rows = {}
    for fam, p in d["soak"]["pairs"].items():
        if fam == "champion":
            continue
        mean, lo, hi = paired_difference_ci(p["base"], p["champion"])
        rows[fam] = {"n": len(p["base"]), "base": sum(p["base"]), "champion": sum(p["champion"]),
                     "diff": mean, "low": lo, "high": hi, "above": lo > 0}
    met = rows.get("arithmetic", {}).get("above", False) and sum(r["above"] for f, r in rows.items()
                                                                  if f != "arithmetic") >= 1
    return {"met": met, "champion": d["soak"]["pairs"].get("champion"), "families": rows}


def no_forgetting(d: dict, tolerance: float) -> dict:
    """Held-out success per family at each promoted version against the best earlier one (see
    the module docstring): ``{met, checked, fails, unchecked, held_out, served_success}``; ``met`` is
    None when nothing was checked (no version promoted over the base)."""
    from selfrl.envs.agents import agent_results
    from selfrl.safety.families import judge_families

    promoted = sorted(v for v in _promoted(d) if v is not None)
    by_version = {v: agent_results(d["evaluations"].get(v, {})) for v in promoted}
    fails, checked, unchecked = [], 0, []
    best: dict[str, tuple[int, dict[str, bool]]] = {}  # family -> (version, results) of the best so far
    for v in promoted:
        results = by_version[v]
        families = sorted(set(results) | set(best))
        for fam in families:
            got = results.get(fam)
            if not got:
                unchecked.append({"family": fam, "version": v})
                continue
            if fam in best and v != 0:
                ref_v, ref = best[fam]
                if set(ref) == set(got):
                    checked += 1
                    verdict = judge_families({fam: ref}, {fam: got}, {fam: tolerance}, reference_version={fam: ref_v})
                    fails += [{**c.to_dict(), "version": v} for c in verdict.dropped]
                else:
                    unchecked.append({"family": fam, "version": v, "why": "other held-out tasks than its reference"})
            if fam not in best or sum(got.values()) / len(got) > sum(best[fam][1].values()) / len(best[fam][1]):
                best[fam] = (v, got)
    held_out = {f"{f}@v{v}": {"n": len(r), "correct": sum(r.values())} for v, rs in by_version.items()
                for f, r in sorted(rs.items())}
    # no check (no version promoted over the base): nothing measured, neither met nor failed
    return {"met": None if checked == 0 else not fails, "checked": checked, "fails": fails, "unchecked": unchecked,
            "held_out": held_out, "served_success": served_success(d, tolerance)}


def served_success(d: dict, tolerance: float) -> dict:
    """Secondary: the simulator's served success per family under each promoted version, each
    against the best earlier one (a version is below when the upper end of its Wilson interval
    is below that best minus ``tolerance``). Different tasks at each version: coarse."""
    from selfrl.core.stats import wilson_interval

    promoted = sorted(v for v in _promoted(d) if v is not None and v != 0)
    per: dict[tuple[str, int], list[bool]] = {}
    for e in d["sim"]:
        if e["event"] == "outcome" and e.get("served") and e.get("version") is not None:
            per.setdefault((e["family"], int(e["version"])), []).append(bool(e["correct"]))
    below, checked = [], 0
    for fam in sorted({f for f, _ in per}):
        best = None
        for v in [0, *promoted]:
            got = per.get((fam, v))
            if not got:
                continue
            rate = sum(got) / len(got)
            if best is not None and v != 0:
                checked += 1
                if wilson_interval(sum(got), len(got))[1] < best - tolerance:
                    below.append({"family": fam, "version": v, "success": rate, "n": len(got), "best": best})
            best = rate if best is None else max(best, rate)
    table = {f"{f}@v{v}": {"n": len(x), "correct": sum(x)} for (f, v), x in sorted(per.items())}
    return {"checked": checked, "below": below, "table": table}


def _promoted(d: dict) -> set[int]:
    return {0} | {e["data"].get("version") for e in d["events"] if e["kind"] == "promote"} | {
        v for v, r in d["versions"].items() if r["status"] in ("base", "promoted")}


def collapses_caught(d: dict) -> dict:
    rows = []
    by_step = {int(m["step"]): int(m["value"]) for m in d["metrics"] if m["name"] == "version"}
    for f in d["soak"]["faults"]:
        if f["kind"] not in ("collapse", "nan_loss"):
            continue
        step = f.get("update")
        row = {"kind": f["kind"], "spec": f.get("spec"), "update": step, "applied": f.get("applied", False)}
        at = [e for e in d["events"] if e["data"].get("iteration") == step]
        if f["kind"] == "nan_loss":
            row["caught"] = any(e["kind"] == "skip" and e["data"].get("reason") == "not_finite" for e in at)
            row["how"] = "skipped (not_finite)" if row["caught"] else "not skipped"
        else:
            v = by_step.get(step)
            row["version"] = v
            rolled = any(e["kind"] == "collapse" and v in e["data"].get("rolled_back", []) for e in d["events"])
            status = d["versions"].get(v, {}).get("status")
            row["caught"] = v is not None and (rolled or status == "rejected")
            row["how"] = "collapse event, rolled back" if rolled else f"version status {status}"
            row["served"] = any(e.get("version") == v for e in d["sim"] if e["event"] == "request")
            row["caught"] = row["caught"] and not row["served"]
        rows.append(row)
    applied = [r for r in rows if r["applied"]]
    met = None if not rows else bool(applied) and all(r["caught"] for r in applied)  # None: none injected
    return {"met": met, "faults": rows,
            "caught": sum(r["caught"] for r in applied), "applied": len(applied), "injected": len(rows)}


def trajectories(d: dict) -> dict:
    ok = [e["response_id"] for e in d["sim"] if e["event"] == "request" and e["route"] == "chat"
          and e["status"] == 200]
    lost = [r for r in ok if r not in d["served"]]
    outage = sum(1 for e in d["sim"] if e["event"] == "request" and e["status"] == 0)
    return {"met": not lost, "acknowledged": len(ok), "lost": len(lost), "unanswered_during_outages": outage}


def versions_served(d: dict) -> dict:
    allowed = _promoted(d) | {e["data"].get("version") for e in d["events"] if e["kind"] == "pin"}
    named = [e.get("version") for e in d["sim"] if e["event"] == "request" and e["route"] == "chat"
             and e["status"] == 200]
    bad = sorted({v for v in named if v not in allowed})
    return {"met": not bad and None not in named, "responses": len(named), "versions": sorted(set(named) - {None}),
            "bad": bad}


def learner_alive(d: dict) -> dict:
    stops = [e["kind"] for e in d["events"] if e["kind"] in ("collapse_stop", "learner_error")]
    last = next((t for t in reversed(d["timeline"]) if t.get("learner")), {})
    alive = bool((last.get("learner") or {}).get("alive"))
    backoffs = sum(1 for e in d["events"] if e["kind"] == "collapse")
    return {"met": not stops and alive, "stops": stops, "alive_at_end": alive, "collapse_events": backoffs,
            "updates": (last.get("learner") or {}).get("updates")}


def disk_retention(d: dict, keep: int) -> dict:
    folders = sorted(int(p.name[1:]) for p in (d["run"] / "adapters").glob("v*") if p.name[1:].isdigit()) \
        if (d["run"] / "adapters").exists() else []
    # Retention runs after each learner update (its gate included); a version made by an update still
    # under way at the end (newer than the last sample's last finished update) has had no pass yet.
    done = max((((t.get("learner") or {}).get("last_update") or {}).get("version") or 0 for t in d["timeline"]),
               default=0)
    in_flight = sorted(v for v in d["versions"] if v > done)
    passed = sorted(v for v in d["versions"] if v <= done)
    newest = (set(passed[-keep:]) if keep else set(passed)) | set(in_flight)
    kept_ok = _promoted(d) | newest | {e["data"].get("version") for e in d["events"] if e["kind"] in ("pin", "swap")}
    extra = [v for v in folders if v not in kept_ok]
    return {"met": not extra, "folders": len(folders), "versions": len(d["versions"]), "outside_policy": extra,
            "in_flight": in_flight, "max_disk_mb": max((t["disk_mb"] for t in d["timeline"]), default=None)}


NO_OFFSET_NOTE = ("soak.json has no sim_offset_s (an older soak): the simulator's events are placed on the "
                  "samples' clock with an offset of 0 s (the simulator starts within a second of the soak); that "
                  "soak's sample times are wall-clock seconds, which a step of the system clock moves against "
                  "the events' monotonic ones")


def sim_offset(d: dict) -> tuple[float, str | None]:
    """Seconds from the soak's start to the simulator's (``soak.json``'s ``sim_offset_s``), and a
    note when the record lacks it (0 then: :data:`NO_OFFSET_NOTE`)."""
    offset = d["soak"].get("sim_offset_s")
    return (0.0, NO_OFFSET_NOTE) if offset is None else (float(offset), None)


def windows(d: dict) -> list[dict]:
    """One row per sample of the timeline, from the simulator's log ``events.jsonl``: its events
    whose ``t_real`` + :func:`sim_offset` (seconds since the soak's start) falls in (previous
    sample's ``t``, this sample's ``t``] (the first from 0).

    Returns ``[{"t": s, "completions": int, "latency_p95_s": float | None, "success": {family:
    {"n", "correct"}}}]``: the chat requests answered with a 200, their latency p95 (None without
    one), and each family's served outcomes (the verifier's verdicts on what the server answered)."""
    from bisect import bisect_left

    from selfrl.simulate.summary import percentile

    offset, _ = sim_offset(d)
    ends = [t["t"] for t in d["timeline"]]
    lat: list[list[float]] = [[] for _ in ends]
    fam: list[dict[str, dict[str, int]]] = [{} for _ in ends]
    for e in d["sim"]:
        i = bisect_left(ends, e["t_real"] + offset)  # the first sample at or after the event
        if i == len(ends):  # after the last sample
            continue
        if e["event"] == "request" and e.get("route") == "chat" and e.get("status") == 200:
            lat[i].append(e["latency_s"])
        elif e["event"] == "outcome" and e.get("served"):
            row = fam[i].setdefault(e["family"], {"n": 0, "correct": 0})
            row["n"] += 1
            row["correct"] += bool(e["correct"])
    return [{"t": t, "completions": len(x), "latency_p95_s": percentile(x, 0.95), "success": f}
            for t, x, f in zip(ends, lat, fam)]


def measure(out: Path) -> dict:
    d = load(out)
    args = d["soak"]["args"]
    offset, note = sim_offset(d)
    d["windows"] = windows(d)
    return {"figure": {"sim_offset_s": offset, "note": note, "samples": len(d["windows"]),
                       "completions": sum(w["completions"] for w in d["windows"])},
            "above_base": above_base(d), "no_forgetting": no_forgetting(d, args["tolerance"]),
            "collapses_caught": collapses_caught(d), "trajectories_lost": trajectories(d),
            "unpromoted_served": versions_served(d), "learner_never_stopped": learner_alive(d),
            "rss_growth": rss_growth(d, args["rss_warmup_min"]),
            "rss_floor_growth": rss_floor_growth(d, args["rss_warmup_min"]),
            "disk_within_retention": disk_retention(d, args["keep_newest"])}, d


def markdown(t: dict, d: dict) -> str:
    def yes(ok):
        return "met" if ok else "**not met**"

    ab, nf, cc = t["above_base"], t["no_forgetting"], t["collapses_caught"]
    dropped = ", ".join(sorted({f"{x['family']}@v{x['version']}" for x in nf["fails"]}))
    fams = "; ".join(f"{f} {r['base']}/{r['n']} -> {r['champion']}/{r['n']}, diff {r['diff']:+.2f} "
                     f"[{r['low']:+.2f}, {r['high']:+.2f}]" for f, r in ab["families"].items())
    faults = "; ".join(f"{r['spec']} at update {r['update']}: " + (r["how"] if r["applied"] else "never applied")
                       for r in cc["faults"])
    tl, us, la = t["trajectories_lost"], t["unpromoted_served"], t["learner_never_stopped"]
    rss, disk = t["rss_growth"], t["disk_within_retention"]
    rows = [
        ("each learned family above its base (paired 95 % CI > 0: arithmetic and one more)",
         f"champion v{ab['champion']}: {fams}", yes(ab["met"])),
        ("no family below its best minus tolerance at a promoted version (held-out success)",
         f"{nf['checked']} version x family checks on the server's held-out tasks, {len(nf['fails'])} below"
         + (f" ({dropped})" if dropped else "")
         + f"; {len(nf['unchecked'])} unchecked. Secondary, served success (different tasks per version, "
         f"Wilson): {nf['served_success']['checked']} checks, {len(nf['served_success']['below'])} below",
         "not measured (no version promoted over the base)" if nf["met"] is None else yes(nf["met"])),
        ("100 % of injected collapses caught", "no collapse or NaN loss injected (--faults)" if cc["met"] is None else
         f"{cc['caught']}/{cc['applied']} applied ({cc['injected']} injected): {faults}",
         "not applicable" if cc["met"] is None else yes(cc["met"])),
        ("0 trajectories lost", f"{tl['lost']} of {tl['acknowledged']} acknowledged turns missing; "
         f"{tl['unanswered_during_outages']} requests unanswered during outages", yes(tl["met"])),
        ("0 versions served that were neither promoted nor pinned", f"{len(us['bad'])} bad of versions "
         f"{us['versions']} over {us['responses']} responses", yes(us["met"])),
        ("the learner never stopped for good", f"alive at the end, {la['updates']} updates, {la['collapse_events']} "
         f"collapse events, stops: {la['stops'] or 'none'}", yes(la["met"])),
        ("RSS growth after the warm-up < 10 %/h", rss_text(rss), "not measured" if rss["met"] is None else
         yes(rss["met"])),
        ("RSS floor growth after the warm-up (beside the target above: its leak detector)",
         rss_floor_text(t["rss_floor_growth"]), "reported, no target"),
        ("disk within the retention policy", f"{disk['folders']} adapter folders for {disk['versions']} versions, "
         f"{len(disk['outside_policy'])} outside the policy"
         + (f" (versions {disk['in_flight']} made by an update still under way at the end, before its retention pass)"
            if disk["in_flight"] else "") + f"; max run dir {disk['max_disk_mb']:.1f} MB",
         yes(disk["met"])),
    ]
    lines = ["| target | measured | |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    note = t.get("figure", {}).get("note")
    return "\n".join(lines) + "\n" + (f"\nNote on soak.png: {note}.\n" if note else "")


def figure(d: dict, path: Path, smooth: int = 3) -> None:
    """Per-family served success (over ``smooth`` sample windows, :func:`windows`: from the
    simulator's log) against minutes since the start, faults (red) and promotions (green) marked;
    below it the latency p95 per window (also from the log), the RSS and the run dir's size (the
    samples'). ``d`` is :func:`load`'s, with ``windows`` added by :func:`measure` (computed here
    when absent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl, t0 = d["timeline"], d["soak"]["started"]
    win = d.get("windows") or windows(d)
    minutes = [t["t"] / 60 for t in tl]
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True, height_ratios=[3, 1, 1, 1])
    ax = axes[0]
    for fam in sorted({f for w in win for f in w["success"]}):
        xs, ys = [], []
        for i in range(len(win)):
            span = win[max(0, i - smooth + 1):i + 1]
            n = sum(t["success"].get(fam, {}).get("n", 0) for t in span)
            if n:
                xs.append(minutes[i])
                ys.append(sum(t["success"].get(fam, {}).get("correct", 0) for t in span) / n)
        ax.plot(xs, ys, marker=".", label=fam)
    for f in d["soak"]["faults"]:
        if f["kind"] in ("restart", "disk_freed"):
            continue
        ax.axvline(f["t"] / 60, color="tab:red", ls="--", lw=1)
        ax.text(f["t"] / 60, 1.02, f.get("spec") or f["kind"], color="tab:red", rotation=90, va="bottom", fontsize=8)
    for e in d["events"]:
        if e["kind"] == "promote" and e["time"] >= t0:
            for a in axes:
                a.axvline((e["time"] - t0) / 60, color="tab:green", lw=0.8, alpha=0.6)
    ax.set_ylim(-0.02, 1.0)
    ax.set_ylabel(f"served success\n(last {smooth} samples)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("soak: served success per family; faults red, promotions green", fontsize=10, pad=40)
    for a, rows, key, label in ((axes[1], win, "latency_p95_s", "latency p95 (s)"),
                                (axes[2], tl, "rss_mb", "server RSS (MB)"), (axes[3], tl, "disk_mb", "run dir (MB)")):
        pts = [(m, t[key]) for m, t in zip(minutes, rows) if t.get(key) is not None]
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color="tab:gray")
        a.set_ylabel(label)
    axes[3].set_xlabel("minutes since the start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path) -> str:
    """Measure the targets of the soak in ``out``, write ``targets.md``, ``targets.json`` and
    ``soak.png``; returns the markdown table."""
    out = Path(out)
    targets, d = measure(out)
    table = markdown(targets, d)
    (out / "targets.md").write_text(table)
    (out / "targets.json").write_text(json.dumps(targets, indent=2, default=str) + "\n")
    figure(d, out / "soak.png")
    return table


def main(argv: list[str] | None = None) -> int:
    """Print :func:`report` of the folder named on the command line; 0. A missing argument, a
    folder without ``soak.json`` or ``run/selfrl.db``, or one whose files are damaged
    (:class:`NotASoak`), is a usage error (exit code 2, argparse's) that names the file."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the soak's folder (scripts/soak.py --out, e.g. runs/soak): "
                                          "soak.json, timeline.jsonl, events.jsonl and run/selfrl.db")
    a = p.parse_args(argv)
    missing = [name for name in ("soak.json", "run/selfrl.db") if not (a.out / name).exists()]
    if missing:
        p.error(f"{a.out} holds no finished soak (no {' and no '.join(missing)}): pass the folder given to "
                "scripts/soak.py --out, after the soak ended (a soak stopped early writes no soak.json)")
    try:
        print(report(a.out))
    except NotASoak as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
