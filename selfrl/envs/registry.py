"""Find an environment by name: registered, ``rg:<dataset>``, ``module:attr``, or entry point.

Names resolve in this order (``get_env``):

1. a registered name (``register_env``; the built-in ones, loaded by
   :func:`selfrl.envs.builtin.load_builtin_envs` before the first lookup: arithmetic,
   webshop, code, function_calling, swe, web, plus the arithmetic aliases chain_sum and
   basic_arithmetic that older configs use);
2. a registered prefix (``register_prefix``): ``rg:<dataset>``, any reasoning-gym dataset
   as an arithmetic-style environment (registered by ``selfrl.envs.arithmetic``);
3. a dotted path ``package.module:Name`` (``--env mypkg.envs:MyEnv``): ``Name``
   is an ``Env`` subclass or a factory returning one;
4. a Python entry point in the group ``selfrl.envs`` (a third-party package
   declares ``[project.entry-points."selfrl.envs"] myenv = "mypkg.envs:MyEnv"``).

An unknown name gets an error that lists the valid ones (trl/scripts/grpo.py's
pattern), and the built-in environments that failed to import, each with its reason. ``load_run_config`` layers an environment's ``config_defaults`` under
the user's config file and flags.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from selfrl.envs.base import Env
from selfrl.envs.builtin import BUILTIN_ENVS, failure, failures_note, load_builtin_envs

__all__ = [
    "ENTRY_POINT_GROUP",
    "TASK_TABLE",
    "available_envs",
    "build_env",
    "describe_envs",
    "env_config_defaults",
    "get_env",
    "load_run_config",
    "register_env",
    "register_prefix",
]

ENTRY_POINT_GROUP = "selfrl.envs"
RG_PREFIX = "rg:"

EnvFactory = Callable[..., Env]


@dataclass(frozen=True)
class _Entry:
    factory: EnvFactory
    description: str
    alias_of: str | None  # an alias is listed with the environment it names


_REGISTRY: dict[str, _Entry] = {}
# prefix -> make(rest of the name) -> factory: a family of environments, e.g. rg:<dataset>
_PREFIXES: dict[str, Callable[[str], EnvFactory]] = {}


def register_env(name: str, factory: EnvFactory, description: str | None = None, alias_of: str | None = None) -> None:
    """Register ``factory(**options) -> Env`` under ``name``, once.

    ``description`` defaults to the factory's ``description`` attribute (an
    ``Env`` subclass has one). ``alias_of`` marks a second name for a listed
    environment (``selfrl envs`` shows it on that environment's line).

    Raises:
        ValueError: ``name`` is taken, uses the reserved ``rg:`` prefix, or holds a ``:``.
    """
    if name.startswith(RG_PREFIX) or ":" in name:
        raise ValueError(f"names starting with {RG_PREFIX!r} are reserved for reasoning-gym datasets "
                         f"and ':' for dotted paths: {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"environment {name!r} is already registered")
    desc = description if description is not None else getattr(factory, "description", "")
    _REGISTRY[name] = _Entry(factory, desc, alias_of)


def register_prefix(prefix: str, make: Callable[[str], EnvFactory]) -> None:
    """Register a family of environments named ``prefix + rest``: ``make(rest)`` gives the
    factory (``selfrl.envs.arithmetic`` registers ``rg:``, any reasoning-gym dataset).

    Raises:
        ValueError: ``prefix`` is registered already or does not end with ``:``.
    """
    if not prefix.endswith(":") or prefix in _PREFIXES:
        raise ValueError(f"an environment prefix ends with ':' and is registered once: {prefix!r}")
    _PREFIXES[prefix] = make


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_envs() -> list[str]:
    """Registered and entry-point environment names, sorted (aliases included)."""
    load_builtin_envs()
    return sorted(set(_REGISTRY) | set(_entry_points()))


def describe_envs() -> list[tuple[str, str]]:
    """``(name, one-line description)`` per environment, aliases folded into their line; sorted,
    entry points after the registered ones, and last each built-in environment that failed to
    import, with its reason."""
    load_builtin_envs()
    aliases: dict[str, list[str]] = {}
    for name, e in _REGISTRY.items():
        if e.alias_of:
            aliases.setdefault(e.alias_of, []).append(name)
    out = []
    for name, e in sorted(_REGISTRY.items()):
        if e.alias_of:
            continue
        also = f" (also: {', '.join(sorted(aliases[name]))})" if name in aliases else ""
        out.append((name, e.description + also))
    for name, ep in sorted(_entry_points().items()):
        if name not in _REGISTRY:
            out.append((name, f"entry point {ep.value}"))
    out += [(name, f"did not load: {failure(name)}") for name in BUILTIN_ENVS if failure(name)]
    return out


def _resolve_factory(name: str) -> EnvFactory:
    """The factory for ``name`` (see the module docstring for the order).

    Raises:
        ValueError: unknown name, or a dotted path that does not import; the message lists valid
            names. A built-in environment that failed to import is named with its reason.
    """
    if name not in _REGISTRY:
        load_builtin_envs()
    if failure(name) is not None:
        raise ValueError(f"the built-in environment {name!r} failed to import: {failure(name)}; "
                         "the others loaded (selfrl envs lists them)")
    if name in _REGISTRY:
        return _REGISTRY[name].factory
    for prefix, make in _PREFIXES.items():
        if name.startswith(prefix):
            return make(name[len(prefix):])
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load environment {name!r}: {type(e).__name__}: {e}") from e
        if not callable(obj):
            raise ValueError(f"environment {name!r} is not a class or factory")
        return obj
    eps = _entry_points()
    if name in eps:
        return eps[name].load()
    raise ValueError(
        f"unknown environment {name!r}; valid names: {', '.join(available_envs())}, "
        f"'{RG_PREFIX}<dataset>' for any reasoning-gym dataset, or 'package.module:Name'{failures_note()}"
    )


TASK_TABLE = "[task]"  # the config table whose ``options`` selfrl run's and serve's environment takes


def get_env(name: str, **options: Any) -> Env:
    """Build the environment ``name`` with ``options`` (the ``[task] options`` table).

    Raises:
        ValueError: unknown name (lists the valid ones), bad options, or a factory
            that returns something other than an ``Env``.
    """
    return build_env(name, options)


def build_env(name: str, options: dict[str, Any] | None = None, where: str = TASK_TABLE) -> Env:
    """Build the environment ``name`` with ``options``, the ``options`` of the config table ``where``
    (``"[task]"``, or e.g. ``"[[families]] 'web'"``: an error names the table to fix).

    Raises:
        ValueError: unknown name (lists the valid ones); an option the factory does not take, or
            a required one not given (the message names them and ``where``); a factory that
            refuses its arguments (a ``TypeError``, named with the options given); or a factory
            that returns something other than an ``Env``.
    """
    options = dict(options or {})
    factory = _resolve_factory(name)
    _check_option_names(name, factory, options, where)
    try:
        env = factory(**options)
    except TypeError as e:  # a signature the check cannot read (**kwargs passed on, a C type), or a bug in it
        given = ", ".join(sorted(options)) or "none"
        raise ValueError(f"environment {name!r} cannot be built with the options given ({given}): TypeError: "
                         f"{e}; set the options it takes in the options of {where} in the config file (--config)") from e
    if not isinstance(env, Env):
        raise ValueError(f"environment {name!r} built a {type(env).__name__}, not a selfrl.envs.Env")
    return env


def env_config_defaults(name: str) -> dict[str, Any]:
    """The dotted run-config defaults of environment ``name`` (its ``config_defaults``), without building it.

    Raises:
        ValueError: unknown name, as ``get_env``.
    """
    return dict(getattr(_resolve_factory(name), "config_defaults", {}) or {})


def _nest(dotted: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def load_run_config(path=None, overrides: dict[str, Any] | None = None, base: dict[str, Any] | None = None):
    """``selfrl.config.load_config`` with the environment's ``config_defaults`` as the lowest layer.

    Layers, lowest first: RunConfig defaults, the environment's defaults (only
    for a fresh run: ``base`` is None), ``base`` (a stored run's config), the
    TOML file at ``path``, then ``overrides``. The environment is the one named
    by ``task.source`` after all layers.

    Raises:
        selfrl.config.ConfigError: as ``load_config``, or an unknown environment.
    """
    from selfrl.config import ConfigError, load_config

    cfg = load_config(path, overrides, base)
    if base is not None:
        return cfg
    try:
        defaults = env_config_defaults(cfg.task.source)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return load_config(path, overrides, _nest(defaults)) if defaults else cfg


def _check_option_names(name: str, factory, options: dict, where: str = TASK_TABLE) -> None:
    """Raise ValueError for an option ``factory`` does not take (a misspelled key would
    otherwise be a bare TypeError), naming the valid ones, and for a required one not given,
    naming it and ``where`` to set it; a factory taking ``**kwargs`` or without a readable
    signature is left to check its own options."""
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and k != "self"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"environment {name!r} has no option {', '.join(map(repr, unknown))}; "
                         f"valid: {', '.join(valid) or '(none)'}")
    positional = [k for k, p in params.items() if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        raise ValueError(f"environment {name!r} takes {', '.join(map(repr, positional))} by position only, which "
                         "options cannot give; wrap it in a factory that takes them by name")
    missing = [k for k, p in params.items() if k != "self" and k not in options and p.default is p.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        example = ", ".join(f"{k} = ..." for k in missing)
        raise ValueError(f"environment {name!r} needs the option(s) {', '.join(map(repr, missing))}: set them in "
                         f"the options of {where} in the config file (--config), e.g. options = {{ {example} }}")
