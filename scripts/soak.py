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
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_args import (FAULTS, KEEP_PROMOTED, MIN_SAMPLES, PHASES, RSS_WARMUP_MIN, out_problem,  # noqa: E402,F401
                       serve_toml, simulate_config)
from soak_args import parse_args as _parse_args  # noqa: E402
from soak_server import FAMILIES, KEY, Server, call, disk_mb, free_port, rss_mb  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """The soak's flags (:func:`soak_args.parse_args`), under this module's summary."""
    return _parse_args(argv, __doc__.split("\n\n")[0])


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
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Soak.close has run: one line, no traceback
        print("soak: interrupted (Ctrl-C): closed as at the end (the server stopped, a run directory on the tmpfs "
              "copied out to <out>/run); no soak.json or report", file=sys.stderr)
        sys.exit(130)
