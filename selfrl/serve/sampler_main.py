"""``selfrl sampler``: load the policy as ``selfrl run`` would and serve it as a remote
sampling backend (:mod:`selfrl.serve.sampler_app`) until Ctrl-C, SIGTERM or SIGHUP (exit code
128 + the signal's number, :mod:`selfrl.run.shutdown`)."""

from __future__ import annotations

import signal
import sys
from typing import Any


def sampler(config: str | None, overrides: dict[str, Any], host: str, port: int, api_key_file: str | None) -> int:
    """Run the sampler; returns the exit code (2 for bad input).

    ``config`` and ``overrides`` are a ``selfrl run`` config (the model, its device and
    dtype, and the LoRA shape the learner's adapters will have).
    """
    from selfrl.config import ConfigError, load_config
    from selfrl.model.load import ModelLoadError

    try:
        cfg = load_config(config, overrides)
        from selfrl.engines.http import load_api_key

        api_key = load_api_key(api_key_file)
        import uvicorn

        from selfrl.engines.reference import Engine
        from selfrl.serve.sampler_app import create_sampler_app
        from selfrl.model.load import build_policy

        model, tok = build_policy(cfg)
    except (ConfigError, ModelLoadError, ValueError) as e:
        print(f"selfrl: error: {e}", file=sys.stderr)
        return 2
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"selfrl: warning: binding to {host} exposes the sampler (and its adapter loading) beyond this "
              "machine", file=sys.stderr)
    placement = next(model.parameters())
    print(f"selfrl: sampling {cfg.model.name} ({placement.device}, {cfg.model.dtype}) on http://{host}:{port}/sampler",
          file=sys.stderr)
    app = create_sampler_app(Engine(model, tok), api_key, model_name=cfg.model.name)
    from selfrl.run.shutdown import exit_code, server

    stoppable = server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    stoppable.run()
    if stoppable.stop_signal is not None:  # SIGINT 130, SIGTERM 143, SIGHUP 129 (selfrl.run.shutdown)
        print(f"selfrl: sampler stopped by {signal.Signals(stoppable.stop_signal).name}", file=sys.stderr)
        return exit_code(stoppable.stop_signal)
    return 0 if stoppable.started else 1
