"""The soak: ``selfrl serve`` learning from simulated users for ``--minutes``, with faults injected
at random (seeded) times, sampled every ``--sample-s`` seconds, then judged against the targets
of continual learning (``scripts/soak_report.py``).

What runs:

* ``selfrl serve`` as a subprocess (the embedded SmolLM2-135M-Instruct, or ``--tiny``: the tests'
  tiny random model) on ``<out>/disk/run``; where a tmpfs can be mounted (root) ``<out>/disk`` is
  one of ``--disk-mb`` MB, so that the disk can be filled; else the disk fault is left out (said).
* ``selfrl simulate``'s :class:`~selfrl.simulate.Simulator` in a thread, a pool of
  ``--concurrency`` users of arithmetic, function calling and the web's easy tier, in the
  phases of :data:`PHASES` (arithmetic; + function calling; + the web; then the mix shifts),
  on a scaled clock (``--day-s`` real seconds a simulated day); a request during an outage is
  counted (status 0), never a crash.
  The families (``soak_server.FAMILIES``) follow the shipped configs of ``selfrl run``:
  function calling as configs/function_calling.toml (``tool_choice = "required"``: one call
  under the server's grammar, the answer), the web as configs/web_easy.toml (two worked
  episodes, ``page_ids``: each turn's tools narrowed to the page shown; ``tool_choice =
  "required"``). The server holds the same three as ``[[families]]``, so its no-forgetting
  gate is on, and the users never ask one of their ``--val-size`` held-out tasks.
* The faults, one each at a time drawn uniformly inside its own slice of the run:
  ``collapse`` (noise in the weights of one update, or a learning rate x1000, by the seed) and
  ``nan_loss``, both written into ``SELFRL_FAULT_FILE`` for the learner's next update
  (:mod:`selfrl.core.faults`) and armed again when that update made no step; ``kill`` (SIGKILL,
  a few seconds down, then a restart on the same run directory); ``disk`` (the tmpfs filled but
  for 64 KiB for ``--disk-hold-s`` seconds, then freed).
* A sample every ``--sample-s`` seconds into ``timeline.jsonl``: the server's RSS, the run
  directory's size, the completions' latency p95 and each family's served success (the
  simulator's verifier verdicts) in the window, and the learner's status.

At the end, each family's held-out pairs, version 0 against the champion: the server's own
results on the family's held-out tasks (see :meth:`Soak.held_out_pairs`); then
``soak_report.py`` writes ``soak.png``, ``targets.md`` and ``targets.json``.

    python scripts/soak.py --minutes 90 --out runs/soak        # the soak (docs/results/soak.md)
    python scripts/soak.py --minutes 2 --tiny --out /tmp/soak   # a smoke run on the tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_server import (FAMILIES, KEY, LEARNING_RATE, MAX_KL, SERVE_TOML, Server, call, disk_mb, families_toml, free_port,  # noqa: E402
                         rss_mb, val_size_of)

FAULTS = ("collapse", "nan_loss", "kill", "disk")
RSS_WARMUP_MIN = 15.0  # --rss-warmup-min's default: minutes of a server process before its RSS growth is measured
KEEP_PROMOTED = 3  # --keep-promoted's default where --keep-newest keeps some versions (0 keeps every one)
MIN_SAMPLES = 5  # samples of the timeline a run must hold at least (--sample-s against --minutes)


class Help(argparse.RawTextHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring's lines as they are, and each flag's default after its help (a flag
    whose default is None says in its help what it does when not given)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def out_problem(out: Path, empty: bool = True) -> str | None:
    """Why ``out`` cannot be the soak's folder (a file, a folder not empty where ``empty``, no
    folder can be made there, or one not writable), or None."""
    if out.exists():
        if not out.is_dir():
            return "is a file, not a folder; give a new folder"
        if empty and any(out.iterdir()):
            return "is not empty; give a new folder"
        where = out
    else:
        where = next(p for p in out.parents if p.exists())
        if not where.is_dir():
            return f"cannot be made: {where} is a file, not a folder"
    try:  # a folder made and removed: os.access says yes to root, and to a read-only or virtual file system
        os.rmdir(tempfile.mkdtemp(prefix=".soak-probe-", dir=where))
    except OSError as e:
        return f"cannot be written: {where} is not writable here ({e.strerror or e})"
    return None


def parse_args(argv=None) -> argparse.Namespace:
    """The soak's flags, each checked before anything starts: a value out of its range, flags that
    do not fit together, or a config the simulator or the server would refuse exit with a usage
    error (code 2) naming the flag."""
    from selfrl.config import SECONDS_MAX, SEED_MAX
    from selfrl.config.sections import MAX_VAL
    from selfrl.config.simulate import MAX_ARRIVALS_PER_HOUR, MAX_CONCURRENCY
    from soak_rss import RSS_MIN_SPAN_MIN

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=Help)
    p.add_argument("--minutes", type=float, default=90.0, help="real minutes of traffic (the faults fall inside)")
    p.add_argument("--out", default="runs/soak",
                   help="folder of the run, the logs, the timeline, the figure, the table (new or empty)")
    p.add_argument("--tiny", action="store_true", help="serve the tests' tiny random model instead of the embedded one")
    p.add_argument("--model", default="embedded:smollm2-135m-instruct", help="the served model (without --tiny)")
    p.add_argument("--seed", type=int, default=0, help="the users' seed and the faults' times")
    p.add_argument("--concurrency", type=int, default=4, help="users in flight at once")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"which faults to inject, each once, of {', '.join(FAULTS)} (at least one)")
    p.add_argument("--sample-s", type=float, default=10.0,
                   help=f"real seconds between two samples of the timeline (at least {MIN_SAMPLES} in the run)")
    p.add_argument("--day-s", type=float, default=1440.0, help="real seconds one simulated day lasts")
    p.add_argument("--arrivals-per-hour", type=float, default=30.0, help="conversations per simulated hour")
    p.add_argument("--val-size", type=int, default=None,
                   help="held-out tasks of every family (default: each family's own, soak_server.FAMILIES: function "
                        "calling 96, the others 12): the server validates every version on them, no user asks them, "
                        "and champion and base are compared on them at the end")
    p.add_argument("--tolerance", type=float, default=0.1,
                   help="each family's no-forgetting tolerance (the server's gate and the report's check)")
    p.add_argument("--rss-warmup-min", type=float, default=None,
                   help=f"RSS growth is measured after this many minutes of each server process, over at least "
                        f"{RSS_MIN_SPAN_MIN:g} more, so a run "
                        f"measures it only with --minutes >= this + "
                        f"{RSS_MIN_SPAN_MIN:g}; given, it must fit the run (default: {RSS_WARMUP_MIN:g}, and a run "
                        f"shorter than {RSS_WARMUP_MIN + RSS_MIN_SPAN_MIN:g} min "
                        f"reports RSS growth not measured)")
    p.add_argument("--disk-mb", type=int, default=512,
                   help="size of the tmpfs the run directory lives on (with the disk fault: at most half the memory)")
    p.add_argument("--disk-hold-s", type=float, default=30.0, help="seconds the disk stays nearly full")
    p.add_argument("--outage-s", type=float, default=5.0, help="seconds the server stays down after kill -9")
    p.add_argument("--keep-newest", type=int, default=3, help="the server's retention.keep_newest")
    p.add_argument("--keep-promoted", type=int, default=None,
                   help=f"the server's retention.keep_promoted (0: every promoted version's folder stays; default: "
                        f"{KEEP_PROMOTED} with --keep-newest >= 1, else 0)")
    p.add_argument("--keep-pruned", action="store_true",
                   help="move pruned folders to adapters/.pruned (on the same disk) instead of deleting them")
    args = p.parse_args(argv)
    given = args.faults
    args.faults = [f for f in args.faults.split(",") if f]
    if bad := [f for f in args.faults if f not in FAULTS]:
        p.error(f"unknown faults {bad}; valid: {', '.join(FAULTS)}")
    if not args.faults:
        p.error(f"--faults must name at least one fault (a soak is its faults), got {given!r}; valid: {', '.join(FAULTS)}")
    if twice := sorted({f for f in args.faults if args.faults.count(f) > 1}):
        p.error(f"--faults names {', '.join(twice)} more than once, got {given!r}; each fault is injected once")
    if args.tiny and args.model != p.get_default("model"):
        p.error(f"--model applies only without --tiny (which serves the tests' tiny model), got --model {args.model}: "
                "leave out one of them")
    warmup_given = args.rss_warmup_min is not None
    if not warmup_given:
        args.rss_warmup_min = RSS_WARMUP_MIN
    inf = float("inf")
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    ranges = (  # (flag, low, high, whether the low end is excluded, what it is)
        ("--minutes", 0, SECONDS_MAX / 60, True, "real minutes of traffic, a year at most"),
        ("--seed", 0, SEED_MAX, False, "the simulator's seed"),
        ("--concurrency", 1, MAX_CONCURRENCY, False, "users in flight at once"),
        ("--sample-s", 0, inf, True, "seconds between two samples"),
        ("--day-s", 0, SECONDS_MAX, True, "real seconds a simulated day lasts"),
        ("--arrivals-per-hour", 0, MAX_ARRIVALS_PER_HOUR, True, "conversations per simulated hour"),
        ("--val-size", 1, MAX_VAL, False, "held-out tasks of every family"),
        ("--tolerance", 0, 1, False, "a drop in held-out success, a share"),
        ("--rss-warmup-min", 0, inf, False, "minutes"),
        ("--disk-mb", 64, memory_mb // 2 if "disk" in args.faults else inf, False,
         "MB of tmpfs: the run directory, its versions and the store must fit"
         + ("; the disk fault fills it, in memory: at most half of this machine's" if "disk" in args.faults else "")),
        ("--disk-hold-s", 0, inf, False, "seconds"),
        ("--outage-s", 0, inf, False, "seconds"),
        ("--keep-newest", 0, 10**6, False, "versions; 0 keeps every one"),
        ("--keep-promoted", 0, 10**6, False, "promoted versions; 0 keeps every one"),
    )
    for flag, lo, hi, open_low, what in ranges:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:  # --val-size not given: each family's own
            continue
        if not ((lo < value) if open_low else (lo <= value)) or not value < inf or not value <= hi:  # NaN fails too
            hi = int(hi) if hi != inf and hi == int(hi) else hi  # 525600, not 525600.0 or 5.256e+05
            valid = (f"finite and > {lo}" if open_low else f"finite and >= {lo}") if hi == inf else \
                f"in ({lo}, {hi}]" if open_low else f"in [{lo}, {hi}]"
            p.error(f"{flag} must be {valid} ({what}), got {value}")
    seconds = args.minutes * 60
    needs = {"--disk-hold-s": (args.disk_hold_s, args.disk_hold_s < seconds),  # a fault outlasting the run would
             "--outage-s": (args.outage_s, args.outage_s < seconds),  # hold the soak past --minutes
             "--sample-s": (args.sample_s * MIN_SAMPLES, args.sample_s <= seconds / MIN_SAMPLES)}
    for flag in ("--disk-hold-s", "--outage-s"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not needs[flag][1] and value != p.get_default(flag[2:].replace("-", "_")):
            p.error(f"{flag} must be shorter than the run (--minutes {args.minutes:g} = {seconds:g} s), got {value:g}")
    if not needs["--sample-s"][1] and args.sample_s != p.get_default("sample_s"):
        p.error(f"--sample-s {args.sample_s:g} leaves fewer than {MIN_SAMPLES} samples in the run (--minutes "
                f"{args.minutes:g} = {seconds:g} s): lower --sample-s to at most {seconds / MIN_SAMPLES:g} "
                "or lengthen --minutes")
    if short := [flag for flag, (_, fits) in needs.items() if not fits]:  # only flags left at their defaults
        p.error(f"--minutes {args.minutes:g} ({seconds:g} s) is too short for the default "
                + ", ".join(f"{f} {getattr(args, f[2:].replace('-', '_')):g}" for f in short)
                + f" (each fault's hold must end within the run, which holds {MIN_SAMPLES} samples): lengthen --minutes"
                f" to more than {max(needs[f][0] for f in short) / 60:g}, or lower {' and '.join(short)}")
    if warmup_given and args.minutes < args.rss_warmup_min + RSS_MIN_SPAN_MIN:
        p.error(f"--rss-warmup-min {args.rss_warmup_min:g} leaves no RSS growth to measure in the run (--minutes "
                f"{args.minutes:g}): the slope needs {RSS_MIN_SPAN_MIN:g} min after the warm-up; lengthen --minutes to "
                f"at least {args.rss_warmup_min + RSS_MIN_SPAN_MIN:g}, or leave --rss-warmup-min out (a short run then "
                "reports RSS growth not measured)")
    if args.keep_promoted is None:
        args.keep_promoted = KEEP_PROMOTED if args.keep_newest else 0
    elif args.keep_promoted and not args.keep_newest:
        p.error(f"--keep-promoted {args.keep_promoted} applies only with --keep-newest >= 1 (--keep-newest 0 keeps "
                "every version): raise --keep-newest, or leave --keep-promoted out")
    if why := out_problem(Path(args.out).absolute()):
        p.error(f"--out {args.out} {why}")
    check_configs(p, args)
    return args


# The simulator's and the server's settings, and the flags they are made of: a config they refuse names the setting.
FLAGS_OF = (("heldout_size", ("--val-size",)), ("val_size", ("--val-size",)), ("tolerance", ("--tolerance",)),
            ("keep_newest", ("--keep-newest",)), ("keep_promoted", ("--keep-promoted",)),
            ("concurrency", ("--concurrency",)), ("seed", ("--seed",)), ("arrivals_per_hour", ("--arrivals-per-hour",)),
            ("max_seconds", ("--minutes",)), ("window_s", ("--minutes", "--day-s")),
            ("duration_s", ("--minutes", "--day-s")), ("max_delay_s", ("--minutes", "--day-s")), ("day_s", ("--day-s",)))


def check_configs(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The simulator's config and the server's, built from ``args`` and checked as they check
    them (``SimulateConfig.validate``, its families built; ``load_serve_config`` and each
    family's environment and held-out set) before anything starts; a refusal is a usage error
    naming the flags behind the setting."""
    from selfrl.config import ConfigError
    from selfrl.serve.families import check_family_sources
    from selfrl.serve.main import load_serve_config
    from selfrl.simulate.families import build_families

    def refuse(who: str, e: Exception) -> None:
        flags = next((flags for key, flags in FLAGS_OF if key in str(e)), ())
        given = " with ".join(f"{f} {getattr(args, f[2:].replace('-', '_'))}" for f in flags) or "these flags"
        p.error(f"{who} refuses {given}: {e}")

    try:
        build_families(simulate_config(args, "http://127.0.0.1:8000", args.minutes, Path(args.out)))
    except (ConfigError, ValueError) as e:
        refuse("the simulator", e)
    with tempfile.TemporaryDirectory(prefix="soak-flags-") as d:
        toml = Path(d) / "serve.toml"
        toml.write_text(serve_toml(args, Path(d) / "run", 8000, "the-model"))
        try:
            check_family_sources(load_serve_config(str(toml), {}))
        except (ConfigError, ValueError) as e:
            refuse("the server", e)


# The schedule: (share of the run, arrival weights). Arithmetic alone first (learned within minutes),
# then function calling joins, then the web; after that the mix keeps shifting among the three.
# Every family has joined by 15 % of the run (13.5 of 90 minutes), inside the RSS warm-up, so that
# the memory measured after it is that of one steady set of families, and the two slow families
# get most of the run to learn in.
PHASES: tuple[tuple[float, dict[str, float]], ...] = (
    (0.08, {"arithmetic": 1.0}),
    (0.07, {"arithmetic": 0.5, "function_calling": 0.5}),
    (0.40, {"arithmetic": 0.2, "function_calling": 0.55, "web": 0.25}),
    (0.45, {"arithmetic": 0.3, "function_calling": 0.5, "web": 0.2}),
)


def simulate_config(args, url: str, minutes: float, out: Path):
    """The users: three families in the phases of :data:`PHASES`, spread over ``minutes`` real minutes."""
    from selfrl.config.simulate import FamilySettings, PhaseSettings, SimulateConfig

    tokens = 16 if args.tiny else 96
    families = [FamilySettings(f.name, f.source, dict(f.options), users=20, max_turns=f.max_turns,
                               max_tokens=tokens if args.tiny or f.max_tokens is None else f.max_tokens,
                               tool_choice=f.tool_choice, heldout_size=val_size_of(f, args.val_size),
                               heldout_seed=f.val_seed)
                for f in FAMILIES]  # the server's held-out sets (families_toml): never asked
    sim_span = minutes * 60.0 * 86400.0 / args.day_s  # simulated seconds the traffic lasts
    cfg = SimulateConfig(
        base_url=url, seed=args.seed, max_requests=10**7, max_seconds=minutes * 60.0, day_s=args.day_s,
        arrivals_per_hour=args.arrivals_per_hour, window_s=sim_span / 10, concurrency=args.concurrency,
        timeout_s=120.0, out_dir=str(out), group_by="family",  # one learner group per family: its mean is the baseline
        families=families, phases=[PhaseSettings(share * sim_span, dict(w)) for share, w in PHASES])
    cfg.users.max_delay_s = min(8 * 3600.0, sim_span / 4)  # judgements reach the server within the run
    return cfg.validate()


def serve_toml(a: argparse.Namespace, run_dir: Path, port: int, model: str) -> str:
    """The server's config for the soak's flags ``a`` (``--tiny``: the tiny model's smaller settings)."""
    tiny = a.tiny
    return SERVE_TOML.format(
        run_dir=run_dir, port=port, model=model, tokens=16 if tiny else 96, lora_r=4 if tiny else 8,
        gate_batch=12 if tiny else 24, families=families_toml(a.val_size, a.tolerance),
        min_batch=8 if tiny else 16, max_batch=16 if tiny else 64,
        micro_batch_tokens=512 if tiny else 2048, checkpointing="true",
        feedback_wait_s=5.0 if tiny else 60.0, max_kl=0.1 if tiny else MAX_KL, keep_newest=a.keep_newest,
        keep_promoted=a.keep_promoted, delete=str(not a.keep_pruned).lower(),
        lr=1e-3 if tiny else LEARNING_RATE)


def fault_times(faults: list[str], seconds: float, seed: int) -> list[tuple[float, str]]:
    """One time per fault, each drawn uniformly in its own slice of the middle 80 % of the run
    (in a seeded random order), so that no two overlap and each has traffic before and after."""
    rng = random.Random(f"soak:{seed}")
    order = list(faults)
    rng.shuffle(order)
    lo, span = 0.1 * seconds, 0.8 * seconds / max(len(order), 1)
    return sorted((lo + span * (i + rng.uniform(0.1, 0.7)), f) for i, f in enumerate(order))


class Soak:
    """The run's state: the server, the simulator, the fault log and the timeline."""

    def __init__(self, args):
        self.args, self.out = args, Path(args.out).absolute()
        self.disk = self.out / "disk"
        self.run_dir = self.disk / "run"
        self.fault_file = self.out / "fault_trigger"
        self.faults: list[dict] = []  # every injection: kind, time, and what became of it
        self.pending: list[dict] = []  # the learner fault armed (one at a time), waiting for its update
        self.waiting: list[dict] = []  # learner faults injected while another was armed
        self.t0 = time.time()  # the start as a date (soak.json's "started"); elapsed times are monotonic
        self.mono0 = time.monotonic()
        self.mounted = False
        self.rng = random.Random(f"soak:{args.seed}:kinds")

    def elapsed(self) -> float:
        """Seconds since the start on the monotonic clock, the simulator's own (its events' ``t_real``):
        the wall clock can be stepped by seconds mid-run (a time sync), which must not move the samples."""
        return time.monotonic() - self.mono0

    def sim_offset(self, sim) -> float:
        """Seconds from the start to the simulator's start (its ``t_real`` 0); 0 before it started."""
        real0 = getattr(sim, "real0", None)
        return 0.0 if real0 is None else real0 - self.mono0

    def log_fault(self, **row) -> dict:
        row = {"t": round(self.elapsed(), 2), **row}
        self.faults.append(row)
        with open(self.out / "faults.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"soak: {row['t']:7.1f} s  fault {row}", flush=True)
        return row

    # -- the learner's faults ---------------------------------------------------------------

    def arm(self, row: dict) -> bool:
        """Write ``row``'s fault for the learner's next update; False while the server is down."""
        status, st = call(self.server.url, "/admin/status")
        learner = st.get("learner") or {}
        if status != 200 or "updates" not in learner:
            return False
        target = learner["updates"] + (1 if learner.get("busy") else 0)
        row["update"] = target
        row.setdefault("armed", []).append(target)
        self.fault_file.write_text(f"{row['spec']}@{target}\n")
        return True

    def check_pending(self) -> None:
        """A learner fault whose update has run: applied (it made a version, or a NaN loss was
        skipped as such), or armed again for the next update (the update made no step)."""
        from selfrl.record.store import Store

        status, st = call(self.server.url, "/admin/status")
        learner = st.get("learner") or {}
        for row in list(self.pending):
            if status == 200 and row.get("update") is None:  # the server was down when it was injected
                self.arm(row)
                continue
            if status != 200 or learner.get("updates", 0) <= row["update"] or learner.get("busy"):
                continue
            with Store(self.run_dir / "selfrl.db", readonly=True) as store:
                events = [e for e in store.events() if e["data"].get("iteration") == row["update"]]
                made = [m for m in store.metrics() if m["step"] == row["update"] and m["name"] == "version"]
            skip = next((e for e in events if e["kind"] == "skip"), None)
            applied = bool(made) if row["kind"] == "collapse" else (
                skip is not None and skip["data"].get("reason") == "not_finite")
            if applied or len(row["armed"]) >= 8:
                row["applied"] = applied
                self.pending.remove(row)
                self.fault_file.write_text("")
                with open(self.out / "faults.jsonl", "a") as f:
                    f.write(json.dumps({**row, "event": "applied" if applied else "gave_up"}) + "\n")
                if self.waiting:
                    self.pending.append(self.waiting.pop(0))
            else:
                self.arm(row)

    # -- the faults -------------------------------------------------------------------------

    def inject(self, kind: str) -> None:
        if kind in ("collapse", "nan_loss"):
            spec = self.rng.choice(["noise", "lr_x1000"]) if kind == "collapse" else "nan_loss"
            row = self.log_fault(kind=kind, spec=spec)
            if self.pending:  # one learner fault at a time: this one waits for the one armed
                row["update"], row["armed"] = None, []
                self.waiting.append(row)
            else:
                self.pending.append(row)
                if not self.arm(row):
                    row["update"], row["armed"] = None, []
        elif kind == "kill":
            row = self.log_fault(kind="kill", pid=self.server.proc.pid)
            self.server.kill9()
            time.sleep(self.args.outage_s)
            t = time.monotonic()
            self.server.start(self.port)
            row["down_s"] = round(time.monotonic() - t + self.args.outage_s, 1)
            self.log_fault(kind="restart", pid=self.server.proc.pid, down_s=row["down_s"])
        elif kind == "disk":
            if not self.mounted:
                self.log_fault(kind="disk", skipped="no tmpfs: mounting one needs root")
                return
            from fault_serve_disk import fill_disk

            filler = fill_disk(self.disk)
            with open(filler, "r+b") as f:  # nearly full: 64 KiB left
                f.truncate(max(0, filler.stat().st_size - 65536))
            self.log_fault(kind="disk", free_kb=shutil.disk_usage(self.disk).free // 1024)
            time.sleep(self.args.disk_hold_s)
            filler.unlink()
            self.log_fault(kind="disk_freed")

    # -- the timeline -----------------------------------------------------------------------

    def sample(self, sim, last: float) -> tuple[dict, float]:
        """One row of ``timeline.jsonl``: the simulator's events in (``last``, now] (seconds since the
        start, monotonic), the server's RSS and status, the run directory's size. Returns the row and
        now (unrounded: the next sample's ``last``, so that no event falls between two windows)."""
        from selfrl.simulate.summary import percentile

        now = self.elapsed()
        with sim._lock:
            events = list(sim.events)
        lo, hi, shift = last, now, self.sim_offset(sim)
        window = [e for e in events if lo < e["t_real"] + shift <= hi]
        lat = [e["latency_s"] for e in window if e["event"] == "request" and e["route"] == "chat" and e["status"] == 200]
        fam: dict[str, list[bool]] = {}
        for e in window:
            if e["event"] == "outcome" and e["served"]:
                fam.setdefault(e["family"], []).append(bool(e["correct"]))
        status, st = call(self.server.url, "/admin/status", timeout=5)
        pid = self.server.proc.pid if self.server.proc is not None else None
        row = {"t": round(now, 1), "rss_mb": rss_mb(pid) if pid else None, "pid": pid,
               "disk_mb": round(disk_mb(self.run_dir), 3), "latency_p95_s": percentile(lat, 0.95),
               "completions": len(lat), "failed": sum(1 for e in window if e["event"] == "request" and e["status"] != 200),
               "success": {f: {"n": len(v), "correct": sum(v)} for f, v in fam.items()},
               "up": status == 200, "learner": (st.get("learner") or {}) if status == 200 else None}
        with open(self.out / "timeline.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        return row, now

    # -- the run ----------------------------------------------------------------------------

    def setup(self) -> None:
        """The folders, the tmpfs (where it can be mounted), the model, the key and the server's config."""
        from fault_serve_disk import tmpfs_unavailable

        a = self.args
        if self.out.exists() and any(self.out.iterdir()):  # parse_args refused it; made meanwhile
            raise SystemExit(f"soak: {self.out} is not empty; give a new --out")
        self.disk.mkdir(parents=True)
        why = tmpfs_unavailable(self.out) if "disk" in a.faults else "no disk fault asked"
        if why is None:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={a.disk_mb}m", "tmpfs", str(self.disk)], check=True)
            self.mounted = True
        elif "disk" in a.faults:
            print(f"soak: the disk fault is left out: {why}", file=sys.stderr)
        model = a.model
        if a.tiny:
            from fault_runs import save_tiny_model

            model = str(save_tiny_model(self.out / "tiny-model", eos_bias=3.0))
        (self.out / "key").write_text(KEY + "\n")
        self.port = free_port()
        (self.out / "serve.toml").write_text(serve_toml(a, self.run_dir, self.port, model))
        self.fault_file.write_text("")
        self.server = Server(self.out, self.out / "serve.toml", self.fault_file)

    def run(self) -> dict:
        """Start the server, drive it, inject, sample; returns the run's record (``soak.json``)."""
        from selfrl.simulate import Simulator
        from selfrl.simulate.simulator import default_client

        a = self.args
        self.server.start(self.port)
        self.t0, self.mono0 = time.time(), time.monotonic()
        seconds = a.minutes * 60.0
        plan = fault_times(a.faults, seconds, a.seed)
        cfg = simulate_config(a, self.server.url, a.minutes, self.out)
        client = default_client(cfg, KEY)
        sim = Simulator(cfg, client, log=self.out / "events.jsonl")
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(summary=sim.run()), daemon=True)
        thread.start()
        last, busy = 0.0, None
        while thread.is_alive():
            now = self.elapsed()
            while plan and plan[0][0] <= now and not (busy and busy.is_alive()):
                kind = plan.pop(0)[1]
                if kind in ("kill", "disk"):  # these take a while: the samples go on meanwhile
                    busy = threading.Thread(target=self.inject, args=(kind,), daemon=True)
                    busy.start()
                else:
                    self.inject(kind)
            self.check_pending()
            if self.elapsed() - last >= a.sample_s:
                _, last = self.sample(sim, last)
            thread.join(timeout=1.0)
        if busy is not None:
            busy.join()
        for _ in range(60):  # the learner faults still armed get a last chance to be applied
            if not self.pending:
                break
            self.check_pending()
            time.sleep(2.0)
        _, last = self.sample(sim, last)
        client.close()
        (self.out / "summary.json").write_text(json.dumps(result.get("summary", {}), indent=2) + "\n")
        _, st = call(self.server.url, "/admin/status")
        champion = (st.get("learner") or {}).get("best_version", 0)
        self.sample(sim, last)
        self.server.stop()
        pairs = self.held_out_pairs(champion)
        return {"args": vars(a), "started": self.t0, "seconds": self.elapsed(), "sim_offset_s": self.sim_offset(sim),
                "faults": self.faults,
                "not_injected": [k for _, k in plan], "pending": self.pending + self.waiting, "pairs": pairs,
                "server_starts": self.server.starts, "tmpfs": self.mounted}

    def held_out_pairs(self, champion: int) -> dict:
        """Each family's held-out results of version 0 and of ``champion`` on the same tasks:
        ``{"champion": N, family: {"base": [bool], "champion": [bool], "tasks": [id]}}`` (tasks
        sorted; a family without stored results on both sides has empty lists).

        Read from the server's store (``evaluations``, task ids ``<family>/<id>``), not asked
        again: these are exactly the family's held-out tasks (``--val-size`` from its
        ``val_seed``), which no simulated user ever asks, so the pair is disjoint from the
        training traffic; both sides were decoded as the server's gate decodes (greedy, the
        family's decoding), and the no-forgetting gate judged the champion on these very
        results. Asking them again through the API would cost minutes per family and could
        only differ by the decoding of a client's request."""
        from selfrl.record.store import Store

        with Store(self.run_dir / "selfrl.db", readonly=True) as store:
            base, best = store.evaluation(0), store.evaluation(champion)
        out: dict = {"champion": champion}
        for fam in FAMILIES:
            both = sorted(t for t in set(base) & set(best) if t.startswith(f"{fam.name}/"))
            out[fam.name] = {"base": [base[t] for t in both], "champion": [best[t] for t in both], "tasks": both}
        return out

    def close(self) -> None:
        """The end of every soak, however it ends (a normal end, an error, Ctrl-C, SIGTERM): stop
        the server, copy the run directory out of the tmpfs to ``<out>/run`` and unmount it
        (without a tmpfs, ``<out>/run`` links to the run directory, once a server ran). Safe after
        a setup that failed midway or refused ``--out`` (then nothing in it is touched), and
        twice. A restart still under way in a fault's thread is refused from here on, and the
        server is stopped once more at the end in case one began meanwhile."""
        server = getattr(self, "server", None)
        try:
            if server is not None:
                def refuse(*_args, **_kwargs):
                    raise RuntimeError("the soak is closing: no server is started any more")

                server.start = refuse  # a kill fault's restart must not outlive the soak
                server.stop()
        finally:
            try:
                if self.mounted:
                    if self.run_dir.exists():
                        shutil.copytree(self.run_dir, self.out / "run", symlinks=True, dirs_exist_ok=True)
                elif server is not None and server.starts and self.run_dir.exists() and not (self.out / "run").exists():
                    (self.out / "run").symlink_to(self.run_dir)
            finally:
                if self.mounted:
                    subprocess.run(["umount", "-l", str(self.disk)], check=False)
                    self.mounted = False
                if server is not None:
                    server.stop()


def main(argv=None) -> int:
    """Parse, set up, run, close, then write ``soak.json`` and the report; 0. SIGTERM and Ctrl-C
    end the soak through the same :meth:`Soak.close` (then exit with 143, or raise
    KeyboardInterrupt), with no ``soak.json`` or report; a second SIGTERM during the close is ignored."""
    import signal

    from soak_report import report

    args = parse_args(argv)
    soak = Soak(args)

    def on_sigterm(signum, _frame):
        print("soak: SIGTERM: stopping the server, copying the run directory out, unmounting the tmpfs",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    in_main = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    try:
        soak.setup()
        record = soak.run()
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the close is not cut short
        try:
            soak.close()
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)
    (soak.out / "soak.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    table = report(soak.out)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
