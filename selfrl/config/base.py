"""The rules every settings table of :mod:`selfrl.config` uses: the error, a rule list,
``Literal`` choices, finite floats, and filling a dataclass from TOML and dotted overrides.

Imports no torch and nothing else of selfrl.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any, get_args


class ConfigError(ValueError):
    """An invalid configuration value or key; the message names it."""


def require(rules: list[tuple[bool, str]], where: str = "") -> None:
    """Raise :class:`ConfigError` with ``where + message`` for the first rule that does not hold."""
    for ok, msg in rules:
        if not ok:
            raise ConfigError(where + msg)


def one_of(value: Any, allowed: Any, name: str) -> tuple[bool, str]:
    """A rule: ``value`` is one of the values of the ``Literal`` type ``allowed``."""
    options = get_args(allowed)
    return value in options, f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}"


def check_finite(obj: Any, where: str = "") -> None:
    """Every float field of the dataclass ``obj``, nested sections included, is finite
    (``inf`` passes a rule such as ``> 0``; ``nan`` fails it with a misleading message).

    Raises:
        ConfigError: the first field that holds ``inf``, ``-inf`` or ``nan``, named with its section.
    """
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_finite(value, f"{where}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}{f.name} must be a finite number, got {value!r}")


def non_finite_weights(weights: Any) -> dict[str, Any]:
    """The entries of a ``name = weight`` table whose weight is not a finite number (a bool is
    not a number here); empty for anything that is not a table (another rule refuses that).

    >>> non_finite_weights({"verifier": 1.0, "format": "a", "length": float("inf")})
    {'format': 'a', 'length': inf}
    """
    if not isinstance(weights, dict):
        return {}
    return {name: w for name, w in weights.items()
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)}


def _apply(obj, values: dict[str, Any], where: str) -> None:
    """Set dataclass fields from a dict, recursing into nested dataclasses."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown key {where}{key!r}; valid: {', '.join(sorted(fields))}")
        current = getattr(obj, key)
        item = fields[key].metadata.get("table_of")
        if item is not None:  # an array of tables ([[agents]]): each one a fresh dataclass
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"{where}{key} must be an array of tables ([[{key}]])")
            items = []
            for i, v in enumerate(value):
                items.append(item())
                _apply(items[-1], v, f"{where}{key}[{i}].")
            setattr(obj, key, items)
            continue
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{key} must be a table")
            _apply(current, value, f"{where}{key}.")
            continue
        # the declared type, not the default's: "all-linear" must not forbid a list of modules
        declared = fields[key].type if isinstance(fields[key].type, str) else getattr(fields[key].type, "__name__", "")
        expected = {"int": int, "float": float, "str": str, "bool": bool}.get(declared)
        if expected in (int, float) and isinstance(value, bool):
            raise ConfigError(f"{where}{key} must be a number, got {value!r}")
        if expected is float and isinstance(value, int):
            value = float(value)
        if expected in (int, float, str, bool) and not isinstance(value, expected):
            raise ConfigError(f"{where}{key} must be {expected.__name__}, got {value!r}")
        setattr(obj, key, value)


def fill(cfg, path: str | Path | None = None, overrides: dict[str, Any] | None = None,
         base: dict[str, Any] | None = None):
    """Set the fields of a config dataclass from ``base``, then a TOML file, then dotted
    ``overrides`` (None values skipped); returns ``cfg``. Shared by ``selfrl run`` and
    ``selfrl serve``.

    Raises:
        ConfigError: unreadable file, unknown key or wrong type.
    """
    if base is not None:
        _apply(cfg, base, "")
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        _apply(cfg, data, "")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        *parents, leaf = dotted.split(".")
        nested: dict[str, Any] = {leaf: value}
        for p in reversed(parents):
            nested = {p: nested}
        _apply(cfg, nested, "")
    return cfg
