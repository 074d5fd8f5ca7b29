"""``selfrl serve``: load the policy, build the service, run uvicorn."""

from __future__ import annotations

import copy
import sys
from typing import Any

from selfrl.serve.config import ServeConfig


def load_serve_config(path: str | None, overrides: dict[str, Any]) -> ServeConfig:
    """Defaults, then a TOML file, then dotted ``overrides`` (None values skipped).

    Raises:
        selfrl.config.ConfigError: unreadable file, unknown key, wrong type or a value that
            ``ServeConfig.validate`` (the same rules as ``selfrl run``) refuses.
    """
    from selfrl.config import fill

    return fill(ServeConfig(), path, overrides).validate()


def serve(config: str | None, overrides: dict[str, Any], api_key_file: str | None, learn: bool = True,
          protect_completions: bool = False) -> int:
    """Run the server until Ctrl-C; returns the exit code (2 for bad input)."""
    from selfrl.config import ConfigError
    from selfrl.model import ModelLoadError

    try:
        cfg = load_serve_config(config, overrides)
        from selfrl.serve.app import load_api_key

        api_key = load_api_key(api_key_file)
        if protect_completions and api_key is None:
            raise ConfigError("--protect-completions needs an API key (SELFRL_API_KEY or --api-key-file)")
        from selfrl.tasks import get_task_source
        from selfrl.tools import resolve_tools

        get_task_source(cfg.task.source, **cfg.task.options)  # fail before the model loads
        resolve_tools(cfg.rollout.tools)
        import uvicorn

        from selfrl.loop import build_policy
        from selfrl.serve.app import create_app
        from selfrl.serve.service import Service

        model, tok = build_policy(cfg)
        learner_model = copy.deepcopy(model) if learn and not cfg.replica else None  # a replica has no learner
        service = Service(model, tok, cfg, learner_model=learner_model)
    except (ConfigError, ModelLoadError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"selfrl: error: {msg}", file=sys.stderr)
        return 2
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"selfrl: warning: binding to {cfg.host} exposes the server beyond this machine", file=sys.stderr)
    if api_key is None:
        print("selfrl: no API key (SELFRL_API_KEY or --api-key-file): /v1/feedback and /admin are disabled",
              file=sys.stderr)
    print(f"selfrl: serving {cfg.model.name} as {cfg.served_model_name!r} (version {service.engine.version}) "
          f"on http://{cfg.host}:{cfg.port}/v1; run dir {cfg.run_dir}"
          + (" (replica: its owner learns; promoted versions are followed)" if cfg.replica else ""), file=sys.stderr)
    app = create_app(service, api_key, protect_completions, learn=learn)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")
    return 0
