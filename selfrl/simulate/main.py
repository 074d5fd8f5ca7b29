"""``selfrl simulate``: load the config, build the families, check the server answers, run (until the
schedule ends, a bound, or Ctrl-C), write the report.

Writes ``<out_dir>/events.jsonl`` (every event as it happens) and ``<out_dir>/summary.json``
(``selfrl.simulate.summary``), and prints one line per family of served success.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

from selfrl.config.simulate import load_simulate_config


def simulate(config: str | None, overrides: dict[str, Any], api_key_file: str | None) -> int:
    """Run ``selfrl simulate``; returns the exit code (``selfrl.cli.EXIT_CODES``): 0 done, 1 the
    server does not answer (or answers with an error), 2 bad input (a family that cannot run is
    refused before the server is contacted), 128 + the signal's number after Ctrl-C, which stops it
    as a bound does: summary.json is written (``selfrl.cli`` makes SIGTERM and SIGHUP Ctrl-C, and a
    second signal stop at once).

    Raises:
        selfrl.config.ConfigError: a bad config (the CLI prints it).
        ValueError: a family cannot be built (unknown environment, ``tool_choice = "required"``
            without tools, ...: :func:`selfrl.simulate.families.build_families`), the API key file
            is unreadable or empty, or the key is shorter than 16 characters; ``out_dir`` is a file
            (:class:`selfrl.record.rundir.NotAFolder`).
    """
    from selfrl.engines.http import api_key_source, load_api_key
    from selfrl.simulate.families import build_families
    from selfrl.simulate.simulator import Simulator, default_client

    from selfrl.record.rundir import check_folder

    cfg = load_simulate_config(config, overrides)
    check_folder(cfg.out_dir)  # a file given for the output folder: refused before anything is sent
    families = build_families(cfg)  # before the server is contacted: a family that cannot run is bad input
    key = load_api_key(api_key_file)  # the file's first line, else SELFRL_API_KEY (ValueError: unreadable, short)
    if not key:
        print("selfrl: error: feedback needs the server's API key: set SELFRL_API_KEY or pass --api-key-file "
              "(the key selfrl serve was started with)", file=sys.stderr)
        return 2
    client = default_client(cfg, key)
    if (refusal := client.reachable(api_key_source(api_key_file))) is not None:
        client.close()
        print(f"selfrl: error: {refusal.message}", file=sys.stderr)
        return refusal.exit_code
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:  # Ctrl-C stops the loop as a bound does (selfrl.cli makes SIGTERM and SIGHUP do the same)
        summary = Simulator(cfg, client, families=families, log=out / "events.jsonl").run()
    finally:
        client.close()
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    http = summary["http"]
    print(f"requests: {summary['requests']['total']} ({summary['requests']['chat']} completions), "
          f"stopped by {summary['stopped_by']}, server errors {http['server_errors']}, failed completions "
          f"{http['failed_completions']} of {http['completions_asked']}")
    for family, windows in summary["success"].items():
        n, ok = sum(w["n"] for w in windows), sum(w["correct"] for w in windows)
        print(f"  {family}: served success {ok}/{n}")
    print(f"summary: {out / 'summary.json'}")
    if summary["signal"] is not None:  # Ctrl-C 130, SIGTERM 143, SIGHUP 129
        print(f"selfrl: stopped by {summary['signal']}; summary.json holds what was sent", file=sys.stderr)
        return 128 + signal.Signals[summary["signal"]].value
    if http["completions_asked"] and http["failed_completions"] == http["completions_asked"]:
        answers = ", ".join(f"{n} x {'no answer or not a completion' if s == '0' else s}" for s, n in http["chat"].items())
        print(f"selfrl: error: every completion failed ({answers}): is selfrl serve running at {cfg.base_url}? "
              f"each answer is in {out / 'events.jsonl'}", file=sys.stderr)
        return 1
    return 0
