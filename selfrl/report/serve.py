"""The report of a ``selfrl serve`` run directory (``selfrl report RUN_DIR``).

``report.md`` with one figure, ``plots/serve_overview.png``, of four panels against
wall-clock time (sessions joined as in :mod:`selfrl.report.timeline`):

1. the version each recorded turn was served by (one dot per turn);
2. turns served, feedback messages received and turns trained, cumulative; the gap
   between served and trained is what still waits for a reward or was skipped;
3. each candidate's held-out success at the time it was saved, with its 95 % Wilson
   interval, coloured by the gate's result; the base model's level dashed;
4. the mean reward of the turns each learner update trained on.

Promotions (swaps), rejections and rollbacks are marked on every panel, as in the
run overview (:func:`selfrl.report.figures.draw_events`). Below the figure: the turn counts
(pending, with feedback, trained, skipped), what each family learned and why not
(:mod:`selfrl.report.serve_families`), the turns retention exported and deleted (the
counts and the figure show only the turns still stored), each version's gate result, and the events.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from selfrl.report.figures import TimeUnit, add_figure_legend, draw_events, save
from selfrl.record import served as records
from selfrl.core.stats import wilson_interval
from selfrl.core.wording import plural
from selfrl.record.store import Store
from selfrl.report.serve_families import families_section
from selfrl.report.timeline import duration, load_timeline, session_clock

STATUS_COLOURS = {"base": "#555555", "promoted": "#2ca02c", "rejected": "#ff7f0e", "rolled_back": "#9467bd",
                  "candidate": "#7f7f7f"}
STATUS_LABELS = {  # the figure's legend: true of every version of the status (the table says more)
    "base": "base model",
    "promoted": "passed the gate; served",
    "rejected": "not promoted; never served",
    "rolled_back": "rolled back (the table says by what)",
    "candidate": "saved; not validated",
}


def admin_rollbacks(events: list[dict]) -> dict[int, int]:
    """``{version: the version an admin rolled back to}`` for each promoted version an admin's rollback
    (``rollback`` events, :meth:`selfrl.record.versions.Ledger.roll_back_to`) marked ``rolled_back``; the last
    rollback that named it wins (a version rolled back to is promoted again, and may be rolled back again)."""
    out: dict[int, int] = {}
    for e in events:
        if e["kind"] == "rollback":
            for v in (e["data"] or {}).get("rolled_back") or []:
                out[int(v)] = (e["data"] or {}).get("version")
    return out


def gate_result(v: dict, versions: list[dict], admin: dict[int, int]) -> str:
    """What the gate (or something before or after it) made of version ``v``, in words true of it:
    its status read with the reason the ledger recorded in its metrics (:mod:`selfrl.record.versions`,
    :mod:`selfrl.serve.chain`) and ``admin`` (:func:`admin_rollbacks`)."""
    m, status, number = v["metrics"], v["status"], v["version"]
    if m.get("corrupt") and status == "rolled_back":  # found damaged at a restart (Ledger.latest_servable)
        was = "base model" if v["parent"] is None else "passed the gate; served"
        return f"{was}; its folder was found damaged at a restart ({m['corrupt']}) and it is not served again"
    if status == "base":
        return "base model"
    if status == "promoted":
        again = ", rolled back by an admin, then served again (an admin rolled back to it)" if number in admin else ""
        return f"passed the gate; served{again}"
    if status == "rolled_back":
        if m.get("collapse"):
            return f"rolled back by the collapse rules ({m['collapse']}) before the gate decided; never served"
        if number in admin:
            return f"passed the gate; served, then rolled back by an admin (to version {admin[number]})"
        return "rolled back"
    if status == "rejected":
        if m.get("unvalidated"):
            return f"never validated (a gate.eval_every chain); rejected with its chain: {m['unvalidated']}"
        if m.get("swap_check"):
            return f"rejected: its swap check failed ({m['swap_check']}); never served"
        if m.get("corrupt"):
            return f"not promoted: its folder is damaged ({m['corrupt']}); never served"
        if m.get("parent_rolled_back") is not None:
            return (f"rejected: trained from version {m['parent_rolled_back']}, which was rolled back meanwhile; "
                    "never served")
        if m.get("veto"):
            return f"failed the gate ({m['veto']}); never served"
        return "failed the gate; never served"
    if status == "candidate":
        later = [w for w in versions if w["parent"] == number]
        if later:  # a chain went on from it: gate.eval_every validates only the chain's last candidate
            return "never validated (a gate.eval_every chain went on from it); never served"
        if any(w["version"] > number for w in versions):
            return "never validated (its validation did not finish); never served"
        return "saved; not yet decided"
    return status


def has_serve_tables(store: Store) -> bool:
    """Whether ``store`` holds the server's tables (``served`` and ``feedback``)."""
    names = {r[0] for r in store.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return {"served", "feedback"} <= names


def write_serve_report(out: Path, store: Store, label: str) -> Path:
    """Write ``out/report.md`` and ``out/plots/serve_overview.png`` for a serve run.

    Args:
        out: output folder (created if missing).
        store: the serve run's store (read-only is enough).
        label: the run's name in the title.

    Returns:
        The path of ``report.md``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    served = has_serve_tables(store)
    turns = records.turn_history(store) if served else []
    feedback = records.feedback_history(store) if served else []
    clock = session_clock(store)
    timeline = load_timeline(store, label)
    versions = store.versions()
    fig = serve_figure(store, label, turns, feedback, versions, clock, timeline)
    save(fig, out / "plots" / "serve_overview.png")
    lines = [f"# selfrl serve report: {label}", "", "![serving overview](plots/serve_overview.png)", ""]
    lines += counts_section(store if served else None, len(turns))
    lines += families_section(store) if served else []
    lines += retention_section(store)
    lines += backoff_section(store)
    lines += versions_section(store, versions, clock)
    lines += events_section(store, clock)
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def serve_figure(store: Store, label: str, turns: list[dict], feedback: list[dict], versions: list[dict],
                 clock, timeline) -> Figure:
    """The four panels described in the module docstring."""
    unit = TimeUnit(clock.total_s)
    fig = Figure(figsize=(13, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    (a, b), (c, d) = fig.subplots(2, 2, sharex=True)
    ts = [unit(clock.elapsed(t["run_id"], t["created_at"])) for t in turns]

    a.scatter(ts, [t["adapter_version"] for t in turns], s=10, color="#1f77b4", label="served turn")
    a.yaxis.set_major_locator(MaxNLocator(integer=True))
    a.set(title="version serving each turn", ylabel="adapter version")

    created = {v["version"]: clock.elapsed(None, v["created_at"]) for v in versions}
    trained = sorted(unit(created[t["trained_in"]]) for t in turns if t["trained_in"] in created)
    fb = [unit(clock.elapsed(None, f["created_at"])) for f in feedback]
    for xs, name, colour in ((ts, "turns served", "#1f77b4"), (fb, "feedback messages", "#ff7f0e"),
                             (trained, "turns trained", "#2ca02c")):
        if xs:
            b.step([0.0, *sorted(xs)], range(len(xs) + 1), where="post", color=colour, label=f"{name} ({len(xs)})")
    pending = sum(t["status"] == "pending" for t in turns)
    b.yaxis.set_major_locator(MaxNLocator(integer=True))
    b.set(title=f"turns and feedback (pending a reward now: {pending})", ylabel="count (cumulative)")

    for v in versions:
        success = v["metrics"].get("val/success")
        if not isinstance(success, (int, float)):
            continue
        res = store.evaluation(v["version"])
        colour = STATUS_COLOURS.get(v["status"], "#7f7f7f")
        if v["version"] == 0:
            c.axhline(success, ls="--", color=colour, lw=1, label=f"base {success:.2f}", gid="base-level")
            continue
        x = unit(created[v["version"]])
        if res:
            low, high = wilson_interval(sum(res.values()), len(res))
            c.errorbar([x], [success], yerr=[[success - low], [high - success]], fmt="o", color=colour, capsize=3)
        else:
            c.plot([x], [success], "o", color=colour)
        c.annotate(f"v{v['version']}", (x, success), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for status in ("promoted", "rejected", "rolled_back"):
        if any(v["status"] == status and v["version"] for v in versions):
            c.plot([], [], "o", color=STATUS_COLOURS[status], label=STATUS_LABELS[status])
    c.set(title="gate: held-out success of each candidate (95 % Wilson)", ylabel="held-out success", ylim=(-0.03, 1.03))

    xs, ys = timeline.xy("reward/mean", "elapsed")
    if xs:
        d.plot([unit(x) for x in xs], ys, marker="o", color="#1f77b4", label="mean reward of the trained turns")
    else:
        d.text(0.5, 0.5, "no learner update yet", transform=d.transAxes, ha="center", color="#555555")
    d.set(title="learner updates", ylabel="reward", xlim=(0, unit(clock.total_s) * 1.02 or 1.0))

    for ax in (a, b, c, d):
        draw_events(ax, timeline, "elapsed", unit, None, {})
        ax.set_xlabel(f"wall-clock ({unit.name})")
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best", framealpha=0.85)
    fig.suptitle(f"{label}: {plural(len(turns), 'turn')} served, {plural(len(versions) - 1, 'candidate version')}, "
                 f"{duration(clock.total_s)}", fontsize=13)
    add_figure_legend(fig, [timeline], True)
    return fig


def counts_section(store: Store | None, n_turns: int) -> list[str]:
    """Turn counts by training status (``records.counts``)."""
    lines = ["## Turns", ""]
    if store is None or not n_turns:
        return lines + ["No turn was recorded.", ""]
    counts = records.counts(store)
    lines += ["| served | pending a reward | pending, feedback arrived | trained | skipped | feedback messages |",
              "|---|---|---|---|---|---|",
              f"| {n_turns} | {counts['pending']} | {counts['pending_with_feedback']} | {counts['trained']} "
              f"| {counts['skipped']} | {counts['feedback_messages']} |"]
    return lines + [""]


def retention_section(store: Store) -> list[str]:
    """The served turns that retention exported and deleted (``prune_turns`` events), where they
    went, and the passes that failed (``retention_failed``); nothing when retention never ran."""
    events = store.events()
    done = [e for e in events if e["kind"] == "prune_turns"]
    failed = [e for e in events if e["kind"] == "retention_failed"]
    if not done and not failed:
        return []
    rows = sum(int(e["data"].get("rows", 0)) for e in done)
    folders = sorted({str(Path(e["data"]["path"]).parent) for e in done if e["data"].get("path")})
    lines = ["## Retention", "", f"{rows} served turns were exported and then deleted from the store, in "
             f"{len(done)} file(s) (JSONL, each with a `.sha256` sidecar: `sha256sum -c` checks it) under "
             f"{', '.join(f'`{d}`' for d in folders) or 'no folder'}; the turn counts and the figure above show "
             "only the turns still stored."]
    if done:
        lines += ["", f"Newest export: `{done[-1]['data']['path']}` ({done[-1]['data']['rows']} turns)."]
    if failed:
        lines += ["", f"{len(failed)} pass(es) failed and deleted nothing; the last: {failed[-1]['message']}"]
    return lines + [""]


def versions_section(store: Store, versions: list[dict], clock) -> list[str]:
    """Each version: when it was saved, its parent, held-out success and the gate's result."""
    lines = ["## Versions and gate results", "", "| version | parent | saved at | held-out success, 95% Wilson CI "
             "| gate result |", "|---|---|---|---|---|"]
    admin = admin_rollbacks(store.events())
    for v in versions:
        res = store.evaluation(v["version"])
        if res:
            k, n = sum(res.values()), len(res)
            low, high = wilson_interval(k, n)
            success = f"{k}/{n} = {k / n:.3f} [{low:.3f}, {high:.3f}]"
        elif isinstance(v["metrics"].get("val/success"), (int, float)):
            success = f"{v['metrics']['val/success']:.3f}"
        else:
            success = "not evaluated"
        parent = "" if v["parent"] is None else v["parent"]
        when = duration(clock.elapsed(None, v["created_at"]))
        lines.append(f"| {v['version']} | {parent} | {when} | {success} | {gate_result(v, versions, admin)} |")
    return lines + [""]


PER_RESPONSE_EVENTS = ("late_feedback",)  # one client can send these as often as it likes: one row per response


def grouped_events(events: list[dict]) -> list[tuple[dict, int, dict]]:
    """``(first event, count, last event)`` rows of ``events``: the events of a kind in
    :data:`PER_RESPONSE_EVENTS` on one response (``data.response_id``) in one row at the first of them,
    and a run of events with the same kind and message one after another in one row. No event is
    dropped: ``count`` says how many a row holds (the store keeps each)."""
    rows: list[list] = []
    by_response: dict[tuple[str, str], list] = {}
    for e in events:
        rid = (e["data"] or {}).get("response_id") if e["kind"] in PER_RESPONSE_EVENTS else None
        row = by_response.get((e["kind"], rid)) if rid is not None else None
        if row is None and rid is None and rows and (rows[-1][0]["kind"], rows[-1][0]["message"]) == (
                e["kind"], e["message"]):
            row = rows[-1]
        if row is None:
            rows.append(row := [e, 0, e])
            if rid is not None:
                by_response[(e["kind"], rid)] = row
        row[1] += 1
        row[2] = e
    return [tuple(r) for r in rows]


def events_section(store: Store, clock) -> list[str]:
    """The events in time order; repeated ones in one row with their count (:func:`grouped_events`)."""
    events = store.events()
    if not events:
        return []
    lines = ["## Events", "", "| at | kind | message |", "|---|---|---|"]
    for first, n, last in grouped_events(events):
        at = duration(clock.elapsed(first["run_id"], first["time"]))
        more = "" if n == 1 else (f" ({n} such events, the last at {duration(clock.elapsed(last['run_id'], last['time']))}"
                                  + (f"; the last: {last['message']}" if last["message"] != first["message"] else "")
                                  + ")")
        lines.append(f"| {at} | {first['kind']} | {first['message']}{more} |")
    return lines + [""]



def backoff_section(store: Store) -> list[str]:
    """The collapse budget's last word (the last ``collapse`` or ``step_back`` event): backing off
    at level N with its learning rate and ``beta``, paused, stopped, or at the configured setting."""
    last = [e for e in store.events() if e["kind"] in ("collapse", "step_back", "collapse_stop")]
    if not last:
        return []
    e, n = last[-1], sum(1 for x in last if x["kind"] == "collapse")
    d = e["data"]
    if e["kind"] == "collapse_stop":
        now = "stopped for good (collapse.max_rollbacks is set and spent)"
    elif d.get("level", 0) > 0:
        now = (f"backing off: level {d['level']}, learning rate {d['learning_rate']:.3g}, beta {d['beta']:.3g}"
               + (" (a cool-down followed the last collapse)" if d.get("action") == "pause" else ""))
    else:
        now = f"at the configured setting again (learning rate {d['learning_rate']:.3g}, beta {d['beta']:.3g})"
    return ["## Collapse budget", "", f"{n} collapse(s) rolled back; at the last of them or its step back: {now}.", ""]
