"""Abuse suite: attack a real ``selfrl serve`` on loopback as an attacker or a careless
operator would, then check that it still serves and that its store is whole.

    .venv/bin/python scripts/abuse_suite.py [--out runs/abuse_suite.json] [--keep DIR] [--attacks NAME ...]

The server is ``selfrl serve`` in a subprocess (``python -m selfrl.cli serve``) on a free
loopback port, with the tests' tiny random Phi saved to a temporary folder, an API key,
and the learner off. Each entry of :data:`ATTACKS` runs with bounded loops; after it the
suite checks:

* still serving: ``GET /health`` and a one-token completion answer 200;
* 5xx count: responses with a status >= 500 during the attack (must be 0);
* rows lost: trajectories stored before the attack that are gone or changed after it;
* inconsistent states: ``PRAGMA integrity_check`` not ``ok``, orphan rows (a ``served``
  row without its trajectory, a trajectory without its ``served`` row, a parent that does
  not exist, feedback on an unknown response), rows added by refused requests (the
  number of new turns and feedback rows must equal what the accepted requests add),
  and the attack's own check (e.g. the victim's turn still has no feedback).

It prints a table (attacks tried, still serving, 5xx count, rows lost, inconsistent
states) and writes the rows as JSON. ``tests/test_serve_abuse.py`` runs the hostile-value
corpus and the attacks of issue 12 cases 4-6 in-process.

The suite is four modules in ``scripts/``, each importing only those named before it:
``abuse_corpus.py`` (the hostile values, :func:`~abuse_corpus.hostile_requests`),
``abuse_client.py`` (raw HTTP), ``abuse_attacks.py`` (each attack, and
:data:`~abuse_attacks.ATTACKS`, whose entries may be ``pending``: listed, not run;
``--include-pending`` runs the written ones anyway) and this file (the server, the store
checks after each attack, the table and the command line).
The version-ledger races of issue 12 (cases 1-3) are such entries until the ledger
refactor lands: ``concurrent_pins`` is written; ``rollback_during_update`` (needs the
learner on) and ``stray_adapter_folder`` (needs a restart) are to be written with it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the suite's modules, beside this file
from abuse_attacks import API_KEY, ATTACKS, Attack, Target  # noqa: E402
from abuse_client import chat, request  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ store checks


def store_counts(db: Path) -> dict[str, int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                for t in ("trajectories", "served", "feedback", "adapter_versions")}


def snapshot(db: Path) -> dict[str, str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return dict(conn.execute("SELECT id, data_json FROM trajectories"))


def store_problems(db: Path) -> list[str]:
    """Integrity check and orphan rows (see the module docstring)."""
    out = []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        check = conn.execute("PRAGMA integrity_check").fetchone()[0]
        if check != "ok":
            out.append(f"integrity_check: {check}")
        queries = {
            "served rows without a trajectory": "SELECT COUNT(*) FROM served s LEFT JOIN trajectories t"
                                                " ON t.id = s.trajectory_id WHERE t.id IS NULL",
            "trajectories without a served row": "SELECT COUNT(*) FROM trajectories t LEFT JOIN served s"
                                                 " ON s.trajectory_id = t.id WHERE s.trajectory_id IS NULL",
            "parents that do not exist": "SELECT COUNT(*) FROM served s WHERE s.parent_id IS NOT NULL AND NOT EXISTS"
                                         " (SELECT 1 FROM trajectories t WHERE t.id = s.parent_id)",
            "feedback on unknown responses": "SELECT COUNT(*) FROM feedback f WHERE NOT EXISTS"
                                             " (SELECT 1 FROM served s WHERE s.response_id = f.response_id)",
        }
        for what, q in queries.items():
            n = conn.execute(q).fetchone()[0]
            if n:
                out.append(f"{n} {what}")
    return out


@dataclass
class Outcome:
    """One attack and what became of the server."""

    attack: str
    case: str
    tried: bool
    requests: int = 0
    still_serving: bool = True
    server_errors: int = 0
    rows_lost: int = 0
    inconsistent: int = 0
    seconds: float = 0.0
    detail: str = ""
    problems: list[str] = field(default_factory=list)


def serving(base: str) -> bool:
    ok = request(base, "GET", "/health")[0] == 200
    return ok and chat(base, [{"role": "user", "content": "still there?"}], None, max_tokens=1, record=False)[0] == 200


def run_attack(attack: Attack, t: Target) -> Outcome:
    """Run one attack against ``t`` and check the server and its store after it."""
    if attack.run is None or attack.pending:
        return Outcome(attack.name, attack.case, False, detail=f"pending: {attack.pending}")
    before_rows, before = snapshot(t.db), store_counts(t.db)
    t0 = time.perf_counter()
    tally = attack.run(t)
    seconds = time.perf_counter() - t0
    alive = serving(t.base)
    after_rows, after = snapshot(t.db), store_counts(t.db)
    problems = list(tally.problems) + store_problems(t.db)
    if after["served"] - before["served"] != tally.added_turns:
        problems.append(f"{after['served'] - before['served']} turns added, {tally.added_turns} accepted")
    if after["feedback"] - before["feedback"] != tally.added_feedback:
        problems.append(f"{after['feedback'] - before['feedback']} feedback rows added, {tally.added_feedback} accepted")
    if after["adapter_versions"] != before["adapter_versions"]:
        problems.append(f"versions {before['adapter_versions']} -> {after['adapter_versions']}")
    lost = sum(1 for k, v in before_rows.items() if after_rows.get(k) != v)
    return Outcome(attack.name, attack.case, True, len(tally.statuses), alive,
                   sum(s >= 500 for s in tally.statuses), lost, len(problems), seconds, tally.detail, problems)


# ------------------------------------------------------------------ the server


CONFIG = """\
run_dir = "{run_dir}"
port = {port}
max_tokens_default = 8
[model]
name = "{model}"
[lora]
r = 4
[learner]
enabled = false
[gate]
val_size = 4
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(work: Path) -> tuple[subprocess.Popen, Target]:
    """``selfrl serve`` on a tiny model in a subprocess; returns it once /health answers."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_tokenizer, save_tiny_phi

    model_dir = save_tiny_phi(work / "tiny-model", build_tiny_tokenizer(), 0, 2.0)
    port, run_dir = free_port(), work / "serve"
    cfg = work / "serve.toml"
    cfg.write_text(CONFIG.format(run_dir=run_dir, port=port, model=model_dir))
    key_file = work / "key"
    key_file.write_text(API_KEY + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("SELFRL_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "selfrl.cli", "serve", "--config", str(cfg), "--api-key-file",
                             str(key_file), "--no-learn"], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(work / "server.log", "w"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while request(base, "GET", "/health", timeout=2)[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start: {(work / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    return proc, Target(base, run_dir / "selfrl.db", proc.pid)


def table(outcomes: list[Outcome]) -> str:
    lines = ["| attack | from | tried | requests | still serving | 5xx | rows lost | inconsistent | seconds | detail |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.attack} | {o.case} | {'yes' if o.tried else 'pending'} | {o.requests} | "
                     f"{'yes' if o.still_serving else 'NO'} | {o.server_errors} | {o.rows_lost} | {o.inconsistent} | "
                     f"{o.seconds:.1f} | {o.detail}{'; ' + '; '.join(o.problems) if o.problems else ''} |")
    tried = [o for o in outcomes if o.tried]
    lines += ["", "| attacks tried | still serving | 5xx count | rows lost | inconsistent states | pending |",
              "|---|---|---|---|---|---|",
              f"| {len(tried)} | {'yes' if all(o.still_serving for o in tried) else 'NO'} | "
              f"{sum(o.server_errors for o in tried)} | {sum(o.rows_lost for o in tried)} | "
              f"{sum(o.inconsistent for o in tried)} | {len(outcomes) - len(tried)} |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/abuse_suite.json", help="where the JSON rows go")
    p.add_argument("--keep", help="keep the run folder here (default: a temporary folder, removed)")
    p.add_argument("--attacks", nargs="*", help="only these attacks (default: all)")
    p.add_argument("--include-pending", action="store_true", help="also run the pending attacks already written")
    args = p.parse_args(argv)
    chosen = [a for a in ATTACKS if not args.attacks or a.name in args.attacks]
    if args.include_pending:
        chosen = [Attack(a.name, a.case, a.run, None if a.run else a.pending) for a in chosen]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        proc, target = start_server(work)
        outcomes = []
        try:
            for a in chosen:
                outcomes.append(run_attack(a, target))
                o = outcomes[-1]
                print(f"{a.name}: " + ("pending" if not o.tried else
                                       f"{o.requests} requests, {o.server_errors} 5xx, {o.inconsistent} inconsistent "
                                       f"({o.seconds:.1f} s) {o.detail}"), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(table(outcomes))
    tried = [o for o in outcomes if o.tried]
    summary = {"attacks_tried": len(tried), "still_serving": all(o.still_serving for o in tried),
               "server_errors": sum(o.server_errors for o in tried), "rows_lost": sum(o.rows_lost for o in tried),
               "inconsistent_states": sum(o.inconsistent for o in tried),
               "pending": [o.attack for o in outcomes if not o.tried]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "attacks": [asdict(o) for o in outcomes]}, indent=2))
    print(f"written: {out}")
    ok = summary["still_serving"] and not summary["server_errors"] and not summary["rows_lost"] \
        and not summary["inconsistent_states"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
