"""``selfrl simulate``: load the config, check the server answers, run, write the report.

Writes ``<out_dir>/events.jsonl`` (every event as it happens) and ``<out_dir>/summary.json``
(``selfrl.simulate.summary``), and prints one line per family of served success.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from selfrl.config.simulate import load_simulate_config


def simulate(config: str | None, overrides: dict[str, Any], api_key_file: str | None) -> int:
    """Run ``selfrl simulate``; returns the exit code (0 done, 2 bad input or no server).

    Raises:
        selfrl.config.ConfigError: a bad config (the CLI prints it).
        ValueError: the API key file is unreadable or empty, or the key is shorter than 16 characters.
    """
    from selfrl.engines.http import api_key_source, load_api_key
    from selfrl.simulate.simulator import Simulator, default_client

    cfg = load_simulate_config(config, overrides)
    key = load_api_key(api_key_file)  # the file's first line, else SELFRL_API_KEY (ValueError: unreadable, short)
    if not key:
        print("selfrl: error: feedback needs the server's API key: set SELFRL_API_KEY or pass --api-key-file "
              "(the key selfrl serve was started with)", file=sys.stderr)
        return 2
    client = default_client(cfg, key)
    if (why := client.reachable(api_key_source(api_key_file))) is not None:
        print(f"selfrl: error: {why}", file=sys.stderr)
        return 2
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        summary = Simulator(cfg, client, log=out / "events.jsonl").run()
    finally:
        client.close()
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"requests: {summary['requests']['total']} ({summary['requests']['chat']} completions), "
          f"stopped by {summary['stopped_by']}, server errors {summary['http']['server_errors']}")
    for family, windows in summary["success"].items():
        n, ok = sum(w["n"] for w in windows), sum(w["correct"] for w in windows)
        print(f"  {family}: served success {ok}/{n}")
    print(f"summary: {out / 'summary.json'}")
    return 0
