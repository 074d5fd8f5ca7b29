"""Served success of the soak's families at version 0: ``selfrl serve --no-learn`` on the
soak's server config (``scripts/soak_server.py``), asked by ``--conversations`` simulated users'
conversations per family (temperature 1.0, as the soak's users; no ratings, corrections or
hostile acts), under the soak's family settings (``new``: ``soak_server.FAMILIES``) and the
settings of the soak before them (``old``: function calling and the web with
``tool_choice`` auto, no worked episodes beyond the environment's fixed one, 96 tokens).
Prints one line per family and setting, and writes ``<out>/baseline.json``.

    python scripts/soak_baseline.py --out /tmp/soak-baseline --conversations 24
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import out_problem, simulate_config  # noqa: E402
from soak_server import FAMILIES, KEY, SERVE_TOML, Server, families_toml, free_port  # noqa: E402

OLD = {"function_calling": {"options": {"categories": ["simple"]}, "max_turns": 2, "max_tokens": 96,
                            "tool_choice": "auto"},
       "web": {"options": {"tier": "easy"}, "max_turns": 3, "max_tokens": 96, "tool_choice": "auto"}}


def served_success(url: str, fam, n: int, seed: int, concurrency: int) -> dict:
    """``n`` conversations of family ``fam`` (a ``FamilySettings``) against version 0; returns
    ``{n, correct, failed, latency_s}`` (``failed``: conversations with no answer served)."""
    from selfrl.config.simulate import PhaseSettings, SimulateConfig
    from selfrl.simulate import FakeClock, Simulator
    from selfrl.simulate.simulator import default_client

    cfg = SimulateConfig(base_url=url, model="selfrl@v0", seed=seed, max_requests=10**6, max_seconds=3600.0,
                         arrivals_per_hour=3600.0, temperature=1.0, concurrency=concurrency, timeout_s=600.0,
                         families=[fam], phases=[PhaseSettings(n * 100.0, {fam.name: 1.0})])
    cfg.users.rating_p = cfg.users.correction_p = cfg.users.hostile_share = 0.0
    client = default_client(cfg.validate(), KEY)
    sim = Simulator(cfg, client, clock=FakeClock(0.0), monotonic=time.monotonic)
    plans = sim.plans
    sim.plans = lambda: itertools.islice(plans(), n)
    t = time.monotonic()
    sim.run()
    client.close()
    outcomes = [e for e in sim.events if e["event"] == "outcome"]
    served = [e for e in outcomes if e["served"]]
    return {"n": len(served), "correct": sum(bool(e["correct"]) for e in served),
            "failed": len(outcomes) - len(served), "seconds": round(time.monotonic() - t, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/soak-baseline", help="folder of the server's run and baseline.json")
    p.add_argument("--model", default="embedded:smollm2-135m-instruct", help="the served model")
    p.add_argument("--conversations", type=int, default=24, help="conversations per family and setting")
    p.add_argument("--families", default="arithmetic,function_calling,web", help="which families to ask")
    p.add_argument("--settings", default="new,old", help="new (the soak's), old (before), or both")
    p.add_argument("--seed", type=int, default=0, help="the users' seed")
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    a = p.parse_args(argv)
    from selfrl.config import SEED_MAX
    from selfrl.config.simulate import MAX_CONCURRENCY

    for flag, value, lo, hi in (("--conversations", a.conversations, 1, None), ("--concurrency", a.concurrency, 1,
                                MAX_CONCURRENCY), ("--seed", a.seed, 0, SEED_MAX)):
        if value < lo:
            p.error(f"{flag} must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            p.error(f"{flag} must be <= {hi} (the simulator's bound), got {value}")
    if why := out_problem(Path(a.out).absolute(), empty=False):
        p.error(f"--out {a.out} {why}")
    known = [f.name for f in FAMILIES]
    if bad := [f for f in a.families.split(",") if f not in known]:
        p.error(f"unknown families {bad} in --families; valid: {', '.join(known)}")
    if bad := [s for s in a.settings.split(",") if s not in ("new", "old")]:
        p.error(f"unknown settings {bad} in --settings; valid: new, old")
    out = Path(a.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    (out / "key").write_text(KEY + "\n")
    (out / "fault_trigger").write_text("")
    port = free_port()
    (out / "serve.toml").write_text(SERVE_TOML.format(
        run_dir=out / "run", port=port, model=a.model, tokens=96, lora_r=8, gate_batch=12, min_batch=12, max_batch=24,
        micro_batch_tokens=2048, checkpointing="true",
        feedback_wait_s=60.0, max_kl=0.5, keep_newest=3, keep_promoted=3, delete="true", lr=1e-4,
        families=families_toml(1, 0.1)))
    server = Server(out, out / "serve.toml", out / "fault_trigger", extra=["--no-learn"])
    server.start(port)
    rows = {}
    try:
        new = simulate_config(argparse.Namespace(tiny=False, seed=a.seed, day_s=1440.0, arrivals_per_hour=30.0,
                                                 concurrency=a.concurrency, val_size=1), server.url, 10.0, out)
        for fam in new.families:
            if fam.name not in a.families.split(","):
                continue
            for setting in a.settings.split(","):
                if setting == "old" and fam.name not in OLD:
                    continue
                f = type(fam)(**{**vars(fam), **(OLD[fam.name] if setting == "old" else {})})
                r = served_success(server.url, f, a.conversations, a.seed, a.concurrency)
                rows[f"{fam.name}/{setting}"] = {**r, "settings": {k: v for k, v in vars(f).items()
                                                                   if k in ("options", "max_turns", "max_tokens",
                                                                            "tool_choice")}}
                print(f"{fam.name:17s} {setting}: {r['correct']}/{r['n']} served answers correct "
                      f"({r['failed']} unanswered, {r['seconds']} s)  {rows[f'{fam.name}/{setting}']['settings']}",
                      flush=True)
    finally:
        server.stop()
    (out / "baseline.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
