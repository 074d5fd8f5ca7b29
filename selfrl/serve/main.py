"""``selfrl serve``: load the policy, build the service, run uvicorn."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from selfrl.config.serve import ServeConfig


def load_serve_config(path: str | None, overrides: dict[str, Any]) -> ServeConfig:
    """Defaults, then a TOML file, then dotted ``overrides`` (None values skipped).

    Raises:
        selfrl.config.ConfigError: unreadable file, unknown key, wrong type or a value that
            ``ServeConfig.validate`` (the same rules as ``selfrl run``) refuses.
    """
    from selfrl.config import fill

    given: set[str] = set()  # the keys the file and flags set: a setting with no effect is refused
    return fill(ServeConfig(), path, overrides, given=given).validate(given)


class BindError(OSError):
    """The server's address could not be bound (in use, not permitted, or not an address here)."""


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one), not yet listening; uvicorn
    listens on it (``uvicorn.Server.run(sockets=[sock])``), so nothing is announced before
    the address is ours.

    Raises:
        BindError: the address is in use, not permitted, or not an address of this machine;
            the message names it and the cause.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise BindError(f"cannot bind {host}:{port}: {e.strerror or e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a TIME_WAIT port may be reused
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = " (another server uses it; choose --port)" if e.errno in (98, 48) else ""
        raise BindError(f"cannot bind {host}:{port}: {e.strerror or e}{hint}") from e
    sock.set_inheritable(True)
    return sock


def check_before_load(cfg: ServeConfig, learn: bool) -> None:
    """The refusals that need no model, made before it loads (seconds) and before the run directory
    or its log file is created: nothing is left behind.

    Raises:
        selfrl.record.rundir.NotAFolder: ``run_dir`` is a file.
        selfrl.record.store.NotAStore: ``run_dir/selfrl.db`` is not a selfrl store.
        selfrl.serve.replica.NoOwner: ``replica`` on a run directory no owner has served.
        selfrl.config.ConfigError: ``retention.trajectories_max_age_s`` on a server that does not learn; a
            replica whose ``[learner]`` age rule, model or LoRA shape is not its owner's.
        selfrl.model.load.ModelLoadError: ``model.name`` is a path that does not exist.
    """
    from pathlib import Path

    from selfrl.record.rundir import check_folder
    from selfrl.record.store import Store

    check_folder(cfg.run_dir)
    db = Path(cfg.run_dir) / "selfrl.db"
    if db.exists():
        with Store(db, readonly=True) as store:
            if cfg.replica:  # it answers feedback by the owner's age rule
                from selfrl.serve.replica import check_owner_age_rule, check_owner_model

                check_owner_model(cfg, store.runs(), cfg.run_dir)
                check_owner_age_rule(cfg.learner, store.runs(), cfg.run_dir)
    elif cfg.replica:
        from selfrl.serve.replica import no_owner

        raise no_owner(cfg.run_dir)
    if cfg.retention.trajectories_max_age_s and not cfg.replica and not learn:
        from selfrl.serve.retention import check_turn_retention

        check_turn_retention(cfg, learns=False)
    from selfrl.model.load import check_model_path

    check_model_path(cfg.model.name)


def remove_if_unused(run_dir: Path, created: bool) -> None:
    """After a refusal at start: remove the run directory this start created, with the empty log
    files it holds (nothing else is touched; a folder with anything more in it stays)."""
    if not created:
        return
    for log in run_dir.glob("serve*.log"):
        if log.is_file() and log.stat().st_size == 0:
            log.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        run_dir.rmdir()


def serve(config: str | None, overrides: dict[str, Any], api_key_file: str | None, learn: bool = True,
          protect_completions: bool = False) -> int:
    """Run the server until Ctrl-C, SIGTERM or SIGHUP; returns the exit code (``selfrl.cli.EXIT_CODES``):
    2 for bad input, 1 when the machine or another process is at fault (a port in use, a sampler that
    does not answer or serves other weights, a full disk), 128 + the signal's number after a stop
    signal (130, 143, 129; :mod:`selfrl.run.shutdown`). The log handlers
    it attaches (:mod:`selfrl.serve.logfile`) are detached when it returns."""
    with contextlib.ExitStack() as logs:
        return _serve(config, overrides, api_key_file, learn, protect_completions, logs)


def _serve(config: str | None, overrides: dict[str, Any], api_key_file: str | None, learn: bool,
           protect_completions: bool, logs: contextlib.ExitStack) -> int:
    from selfrl.config import ConfigError
    from selfrl.model.load import ModelLoadError
    from selfrl.safety.swap_check import SwapCheckError

    try:
        cfg = load_serve_config(config, overrides)
        from selfrl.engines.http import load_api_key

        api_key = load_api_key(api_key_file)
        if protect_completions and api_key is None:
            raise ConfigError("--protect-completions needs an API key (SELFRL_API_KEY or --api-key-file)")
        from selfrl.envs.registry import get_env
        from selfrl.run.setup import check_names

        check_names(cfg, cfg.learner.reward_weights)  # fail before the model loads
        if cfg.families:
            from selfrl.serve.families import check_family_sources

            check_family_sources(cfg)  # each family's environment and the tasks of its held-out set
        else:
            from selfrl.run.setup import check_held_out_size

            check_held_out_size(get_env(cfg.task.source, **cfg.task.options), cfg.gate.val_size, cfg.task.val_seed,
                                "gate.val_size")
        if cfg.sampler.url is not None:  # a wrong URL fails in seconds, not after the model loads
            from selfrl.run.sampler_sync import check_reachable

            check_reachable(cfg.sampler.url, cfg.sampler.kind)
        check_before_load(cfg, learn)
    except ConnectionError as e:  # the sampler does not answer: the machine's, as a taken port (exit code 1)
        print(f"selfrl: error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, ModelLoadError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"selfrl: error: {msg}", file=sys.stderr)
        return 2
    try:
        sock = bind(cfg.host, cfg.port)  # before the model loads: a taken port fails in a second
    except BindError as e:
        print(f"selfrl: error: {e}", file=sys.stderr)
        return 1
    try:
        import uvicorn

        from selfrl.model.load import build_policy
        from selfrl.serve.app import create_app
        from selfrl.serve.service import Service
        from selfrl.record.storage_errors import free_space_error

        where = next(p for p in (Path(cfg.run_dir).absolute(), *Path(cfg.run_dir).absolute().parents) if p.exists())
        if (full := free_space_error(where)) is not None:
            raise full  # before the model loads: a full or read-only disk fails in a second
        from selfrl.serve.logfile import close_log, open_log

        created = not Path(cfg.run_dir).exists()
        logs.callback(remove_if_unused, Path(cfg.run_dir), created)  # runs after the log is closed
        logs.callback(close_log, open_log(cfg.run_dir, cfg.log_max_bytes, cfg.log_backups,  # rotated by size
                                          f"serve-replica-{os.getpid()}.log" if cfg.replica else "serve.log"))
        model, tok = build_policy(cfg)
        # serve.seed made the adapter's initialisation reproducible; sampling draws from a fresh
        # stream per process, so a restart or a --replica never repeats another process's samples
        import torch

        torch.manual_seed(int.from_bytes(os.urandom(8), "little") % 2**63)
        learner_model = copy.deepcopy(model) if learn and not cfg.replica else None  # a replica has no learner
        service = Service(model, tok, cfg, learner_model=learner_model)
    except (ConfigError, ModelLoadError, ValueError, KeyError) as e:
        sock.close()
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"selfrl: error: {msg}", file=sys.stderr)
        return 2
    except (ConnectionError, SwapCheckError) as e:  # the vLLM server (sampler.url) is down, or serves other weights
        sock.close()
        print(f"selfrl: error: cannot start: {e}; fix the vLLM server at {cfg.sampler.url} (docs/guides/vllm.md) "
              "and start again", file=sys.stderr)
        return 1
    except Exception as e:  # a storage fault at start (disk full, store locked): one line, not a traceback
        from selfrl.record.storage_errors import classify

        fault = classify(e, cfg.run_dir)
        if fault is None:
            raise
        sock.close()
        print(f"selfrl: error: cannot start: {fault.message} [{fault.detail}]", file=sys.stderr)
        return 1
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"selfrl: warning: binding to {cfg.host} exposes the server beyond this machine", file=sys.stderr)
    if api_key is None:
        print("selfrl: no API key (SELFRL_API_KEY or --api-key-file): /v1/feedback and /admin are disabled",
              file=sys.stderr)
    app = create_app(service, api_key, protect_completions, learn=learn)
    port = sock.getsockname()[1]
    from selfrl.run.shutdown import exit_code, server as stoppable_server

    started = (f"serving {cfg.model.name} as {cfg.served_model_name!r} (version {service.engine.version}) on "
               f"http://{cfg.host}:{port}/v1; run dir {cfg.run_dir}"
               + (" (replica: its owner learns; promoted versions are followed)" if cfg.replica else ""))
    import logging

    logging.getLogger("selfrl.serve").info(started)  # serve.log's first line (the console gets the print)
    server = stoppable_server(uvicorn.Config(app, log_level="warning"), f"selfrl: {started}",
                              "stopping: requests in flight finish, the learner stops, the store closes")
    server.run(sockets=[sock])
    if server.stop_signal is not None:  # SIGINT 130, SIGTERM 143, SIGHUP 129 (selfrl.run.shutdown)
        print(f"selfrl: stopped by {signal.Signals(server.stop_signal).name}", file=sys.stderr)
        return exit_code(server.stop_signal)
    return 0 if server.started else 1
