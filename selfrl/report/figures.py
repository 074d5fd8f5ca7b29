"""The overview figure: one run, or several side by side, readable at a glance.

Six panels (:data:`PANELS`), top left to bottom right:

1. held-out success against wall-clock time, 2. held-out success against updates
(or rollouts), both with the 95 % Wilson interval as a band and the base model's
level as a dashed line; 3. training reward and correctness; 4. KL to the reference;
5. tool use and the share of zero-signal groups; 6. time spent in rollouts,
updates and validation (stacked bars per iteration for one run; cumulative lines
when runs are compared).

Promotions, rejections, rollbacks and collapse events (:class:`selfrl.report.timeline.Mark`)
are vertical dotted lines with a symbol on the top edge, on every panel. One run:
each series has its own colour and each event kind too. Several runs: one colour
per run; series differ by line style and event kinds by symbol.

Every artist that a test looks for carries a ``gid``: ``heldout-band``,
``base-level``, ``event-line:<mark>`` and ``event-symbol:<mark>``.

Figures are drawn on a ``FigureCanvasAgg``, so neither a display nor the
process-wide matplotlib backend is touched.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from selfrl.report.timeline import Axis, Mark, Timeline

PANELS = (
    "held-out success vs wall-clock",
    "held-out success vs {x}",
    "training reward and correctness",
    "KL to the reference",
    "tool use and zero-signal groups",
    "time: rollouts, updates, validation",
)
AXIS_LABELS = {"update": "updates applied", "rollouts": "rollouts generated", "elapsed": "wall-clock"}
# mark -> (symbol, colour of a single run's marks, legend label)
MARK_STYLE = {
    Mark.PROMOTE: ("^", "#2ca02c", "promoted"),
    Mark.REJECT: ("X", "#ff7f0e", "rejected"),
    Mark.ROLLBACK: ("v", "#9467bd", "rolled back"),
    Mark.COLLAPSE: ("D", "#d62728", "collapse"),
}
RUN_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
# panel -> [(metric, legend label, colour of a single run, line style when runs are compared)]
SERIES = {
    "reward": [("reward/mean", "reward", "#1f77b4", "-"), ("train/correct", "correct", "#ff7f0e", "--")],
    "kl": [("kl", "KL", "#9467bd", "-")],
    "tools": [("train/tool_use", "tool use", "#17becf", "-"),
              ("frac_reward_zero_std", "zero-signal groups", "#7f7f7f", "--")],
}
PHASES = [("time/rollout_s", "rollouts", "#1f77b4", "-"), ("time/update_s", "updates", "#ff7f0e", "--"),
          ("time/validation_s", "validation", "#2ca02c", ":")]


class TimeUnit:
    """Seconds or minutes for the wall-clock axis, whichever reads better for ``longest_s``."""

    def __init__(self, longest_s: float):
        self.divisor, self.name = (60.0, "min") if longest_s > 180 else (1.0, "s")

    def __call__(self, seconds: float) -> float:
        return seconds / self.divisor


def overview_figure(timelines: list[Timeline], x: Axis = "update", title: str | None = None) -> Figure:
    """The six panels of :data:`PANELS` for one run or several.

    Args:
        timelines: one run (its own colours) or several (one colour each).
        x: the x axis of panels 3-6 and of panel 2 (``update``, ``rollouts`` or
            ``elapsed``; with ``elapsed`` panel 2 is against updates, since panel 1
            already shows wall-clock time).
        title: figure title (default: the run labels).

    Returns:
        The figure; save it with ``fig.savefig(path)``.

    Raises:
        ValueError: no timeline, or an unknown axis.
    """
    if not timelines:
        raise ValueError("overview_figure needs at least one timeline")
    if x not in AXIS_LABELS:
        raise ValueError(f"unknown axis {x!r}; valid: {', '.join(AXIS_LABELS)}")
    single = len(timelines) == 1
    unit = TimeUnit(max(t.elapsed_s for t in timelines))
    fig = Figure(figsize=(13, 11), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 2).ravel()
    second = "update" if x == "elapsed" else x
    plan: list[tuple[Axis, Callable]] = [("elapsed", draw_heldout), (second, draw_heldout), (x, draw_reward),
                                         (x, draw_kl), (x, draw_tools), (x, draw_time)]
    highest = 0  # most event symbols stacked at one place: the titles make room for them
    for ax, (axis, draw) in zip(axes, plan):
        stacks: dict[float, int] = {}  # symbols already on the top edge at a place
        for j, tl in enumerate(timelines):
            colour = None if single else RUN_COLOURS[j % len(RUN_COLOURS)]
            draw(ax, tl, axis, unit, colour, single)
            draw_events(ax, tl, axis, unit, colour, stacks)
        highest = max(highest, *stacks.values(), 0)
    for i, (ax, (axis, _)) in enumerate(zip(axes, plan)):
        ax.set_title(PANELS[i].format(x=AXIS_LABELS[second]), fontsize=11, pad=6 + 9 * highest)
        ax.set_xlabel(axis_label(axis, unit))
        ax.set_xlim(*x_limits(timelines, axis, unit))
        if axis != "elapsed":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best", framealpha=0.85)
    fig.suptitle(title or ", ".join(t.label for t in timelines), fontsize=13)
    add_figure_legend(fig, timelines, single)
    return fig


def x_limits(timelines: list[Timeline], axis: Axis, unit: TimeUnit) -> tuple[float, float]:
    """From 0 to the last value or event on ``axis`` (at least 1), with a margin: the same
    range on every panel of that axis, readable also when a run has one point so far."""
    points = [p for t in timelines for series in t.series.values() for p in series]
    points += [e.at for t in timelines for e in t.events]
    hi = max([coord(p, axis, unit) for p in points] + [unit(t.elapsed_s) if axis == "elapsed" else 0.0
                                                       for t in timelines] + [1.0])
    if axis == "update":
        return -0.5, hi + 0.5  # room for the bars of iteration 0 and of the last one
    return -0.02 * hi, 1.02 * hi


def axis_label(axis: Axis, unit: TimeUnit) -> str:
    return f"wall-clock ({unit.name})" if axis == "elapsed" else AXIS_LABELS[axis]


def coord(point, axis: Axis, unit: TimeUnit) -> float:
    return unit(point.elapsed_s) if axis == "elapsed" else point.x(axis)


def draw_heldout(ax: Axes, tl: Timeline, axis: Axis, unit: TimeUnit, colour: str | None, single: bool) -> None:
    """Held-out success with its interval band and the base model's level."""
    c = colour or "#1f77b4"
    if tl.heldout:
        xs = [coord(h.at, axis, unit) for h in tl.heldout]
        ys = [h.at.value for h in tl.heldout]
        ax.plot(xs, ys, marker="o", color=c, label="held-out success" if single else None)
        if all(h.n for h in tl.heldout):
            lows, highs = [h.low for h in tl.heldout], [h.high for h in tl.heldout]
            ax.fill_between(xs, lows, highs, color=c, alpha=0.18, linewidth=0, gid="heldout-band",
                            label="95 % Wilson interval" if single else None)
            ax.vlines(xs, lows, highs, color=c, alpha=0.5, linewidth=1)
    if tl.base is not None:
        b = tl.base
        text = f"base {b.k}/{b.n}" if b.n else f"base {b.at.value:.2f}"
        ax.axhline(b.at.value, color=c if not single else "#555555", ls="--", lw=1, gid="base-level",
                   label=text if single else None)
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("success (share of held-out tasks)")


def draw_lines(ax: Axes, tl: Timeline, axis: Axis, unit: TimeUnit, colour: str | None, single: bool,
               series: list[tuple[str, str, str, str]]) -> None:
    for name, label, own, style in series:
        pts = tl.series.get(name, [])
        if not pts:
            continue
        xs = [coord(p, axis, unit) for p in pts]
        ax.plot(xs, [p.value for p in pts], color=own if single else colour, ls="-" if single else style,
                marker="o" if len(pts) <= 40 else None, markersize=3, label=label if single else None)


def draw_reward(ax, tl, axis, unit, colour, single) -> None:
    draw_lines(ax, tl, axis, unit, colour, single, SERIES["reward"])
    ax.set_ylabel("mean reward / share correct")


def draw_kl(ax, tl, axis, unit, colour, single) -> None:
    draw_lines(ax, tl, axis, unit, colour, single, SERIES["kl"])
    ax.set_ylabel("KL (per token)")


def draw_tools(ax, tl, axis, unit, colour, single) -> None:
    draw_lines(ax, tl, axis, unit, colour, single, SERIES["tools"])
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("share of rollouts / groups")


def draw_time(ax: Axes, tl: Timeline, axis: Axis, unit: TimeUnit, colour: str | None, single: bool) -> None:
    """One run against updates: stacked bars per iteration. Otherwise: cumulative time per phase."""
    ax.set_ylabel(f"time ({unit.name})")
    if single and axis == "update":
        bottom: dict[float, float] = {}
        for name, label, own, _ in PHASES:
            per_step: dict[float, float] = {}
            for p in tl.series.get(name, []):
                per_step[p.update] = per_step.get(p.update, 0.0) + unit(p.value)
            if not per_step:
                continue
            xs = sorted(per_step)
            ax.bar(xs, [per_step[s] for s in xs], bottom=[bottom.get(s, 0.0) for s in xs], width=0.7,
                   color=own, label=label)
            for s in xs:
                bottom[s] = bottom.get(s, 0.0) + per_step[s]
        return
    for name, label, own, style in PHASES:
        pts = sorted(tl.series.get(name, []), key=lambda p: p.elapsed_s)
        if not pts:
            continue
        total, ys = 0.0, []
        for p in pts:
            total += unit(p.value)
            ys.append(total)
        ax.step([coord(p, axis, unit) for p in pts], ys, where="post", color=own if single else colour,
                ls=style, label=f"{label} (cumulative)" if single else None)


def draw_events(ax: Axes, tl: Timeline, axis: Axis, unit: TimeUnit, colour: str | None,
                stacks: dict[float, int]) -> None:
    """A dotted vertical line and a symbol on the top edge per marked event; symbols at
    the same place (``stacks``: rounded x -> symbols there) are stacked upwards."""
    for ev in tl.events:
        symbol, own, _ = MARK_STYLE[ev.mark]
        c = colour or own
        x = coord(ev.at, axis, unit)
        key = round(x, 1)
        level = stacks.get(key, 0)
        stacks[key] = level + 1
        ax.axvline(x, color=c, ls=":", lw=1.2, alpha=0.9, gid=f"event-line:{ev.mark.value}")
        ax.plot([x], [1.0 + 0.055 * level], marker=symbol, color=c, markersize=8, transform=ax.get_xaxis_transform(),
                clip_on=False, linestyle="none", gid=f"event-symbol:{ev.mark.value}")


def add_figure_legend(fig: Figure, timelines: list[Timeline], single: bool) -> None:
    """Event kinds present (and, for several runs, the run colours and line styles)."""
    marks = [m for m in Mark if any(ev.mark is m for t in timelines for ev in t.events)]
    handles = [Line2D([], [], marker=MARK_STYLE[m][0], color=MARK_STYLE[m][1] if single else "black",
                      ls=":", label=MARK_STYLE[m][2]) for m in marks]
    if not single:
        handles = [Line2D([], [], color=RUN_COLOURS[j % len(RUN_COLOURS)], lw=3, label=t.label)
                   for j, t in enumerate(timelines)] + handles
        handles += [Line2D([], [], color="black", ls="--", label="dashed: correct / zero-signal / updates / base"),
                    Line2D([], [], color="black", ls=":", label="dotted: validation time")]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6), fontsize=9, frameon=False)


def save(fig: Figure, path: Path, dpi: int = 90) -> Path:
    """Write ``fig`` as a PNG (creating the folder); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
