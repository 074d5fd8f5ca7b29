"""The rules every settings table of :mod:`selfrl.config` uses: the error, a rule list,
``Literal`` choices, finite floats, and filling a dataclass from TOML and dotted overrides.

Imports no torch and nothing else of selfrl but the error (:mod:`selfrl.core.errors`,
where the checks that need the model raise it too).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from pathlib import Path
from typing import Any, get_args

from selfrl.core.errors import ConfigError  # noqa: F401  (re-exported: selfrl.config.ConfigError)


def require(rules: list[tuple[bool, str]], where: str = "") -> None:
    """Raise :class:`ConfigError` with ``where + message`` for the first rule that does not hold."""
    for ok, msg in rules:
        if not ok:
            raise ConfigError(where + msg)


SEED_MAX = 2**63 - 1  # seeds are int64 (torch.manual_seed, numpy and SQLite take them)
SECONDS_MAX = 365 * 24 * 3600.0  # a year: waits and timeouts (threading refuses timeouts past ~292 years)
NAME_MAX = 64  # characters of an agent's or family's name: it names metrics (val/<name>, family/<name>/...)


def name_length(name: Any, why: str) -> tuple[bool, str]:
    """A rule: the name ``name`` is at most :data:`NAME_MAX` characters (``why``: what it names, for
    the message). A name that is no string passes (another rule refuses it).

    >>> name_length("x" * 65, "it names the metrics family/<name>/...")
    (False, 'name must be at most 64 characters (it names the metrics family/<name>/...), got 65: shorten it')
    """
    ok = not isinstance(name, str) or len(name) <= NAME_MAX
    got = len(name) if isinstance(name, str) else 0
    return ok, f"name must be at most {NAME_MAX} characters ({why}), got {got}: shorten it"


def _num(x: float) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def in_range(value: Any, name: str, low: float | None = None, high: float | None = None, *,
             low_open: bool = False, high_open: bool = False, interval: bool = False) -> tuple[bool, str]:
    """A rule: ``low <= value <= high`` (``<`` where ``low_open`` / ``high_open``; a None bound is
    not checked). The message names the field, the allowed range and the value, as one line:
    ``r must be >= 1 and <= 65536, got 1000000000``, or with ``interval`` ``in [0, 1), got 1.0``.

    >>> in_range(10**9, "r", 1, 65536)
    (False, 'r must be >= 1 and <= 65536, got 1000000000')
    >>> in_range(1.0, "min_spread", 0, 1, high_open=True, interval=True)
    (False, 'min_spread must be in [0, 1), got 1.0')
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if interval and low is not None and high is not None:
        rng = f"in {'(' if low_open else '['}{_num(low)}, {_num(high)}{')' if high_open else ']'}"
    else:
        parts = ([f"{'>' if low_open else '>='} {_num(low)}"] if low is not None else []) + \
                ([f"{'<' if high_open else '<='} {_num(high)}"] if high is not None else [])
        rng = " and ".join(parts)
    return ok, f"{name} must be {rng}, got {value!r}"


def at_most(low: Any, low_name: str, high: Any, high_name: str) -> tuple[bool, str]:
    """A rule for two fields that bound one range: ``low <= high``. The message names both, with
    their values (the full dotted names: either may be the one set wrongly), as one line.

    >>> at_most(2.0, "collapse.beta_min", 1.0, "collapse.beta_max")
    (False, 'collapse.beta_min (2) must be at most collapse.beta_max (1): lower the first or raise the second')
    """
    ok = not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)) or low <= high
    return ok, f"{low_name} ({_num(low)}) must be at most {high_name} ({_num(high)}): lower the first or raise the second"


def one_of(value: Any, allowed: Any, name: str) -> tuple[bool, str]:
    """A rule: ``value`` is one of the values of the ``Literal`` type ``allowed``."""
    options = get_args(allowed)
    return value in options, f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}"


def check_finite(obj: Any, where: str = "") -> None:
    """Every float field of the dataclass ``obj``, nested sections included, is finite
    (``inf`` passes a rule such as ``> 0``; ``nan`` fails it with a misleading message), and
    every field declared ``int`` holds an int (a config built in Python may hold ``3.5``).

    Raises:
        ConfigError: the first field that holds ``inf``, ``-inf`` or ``nan``, or a non-integer
            where an integer is declared, named with its section.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_finite(value, f"{where}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}{f.name} must be a finite number, got {value!r}")
        elif int in _numeric(hints.get(f.name)) and float not in _numeric(hints.get(f.name)) and value is not None \
                and (isinstance(value, bool) or not isinstance(value, int)):  # set from Python, not TOML
            raise ConfigError(f"{where}{f.name} must be an integer, got {value!r}")


def _numeric(hint: Any) -> tuple:
    """The number types a field's type hint allows: ``int | None`` -> (int,)."""
    args = get_args(hint) or (hint,)
    return tuple(a for a in args if a in (int, float))


def weights_problem(weights: Any, field: str = "reward_weights") -> str | None:
    """What is wrong with the weights of a ``name = weight`` table (``field``), or None: a weight
    that is no number at all (a string, a bool), or one that is not finite.

    >>> weights_problem({"verifier": "1"})
    "reward_weights: each weight must be a number, got {'verifier': '1'}"
    >>> weights_problem({"verifier": float("nan")})
    "reward_weights must be finite, got {'verifier': nan}"
    """
    odd = non_finite_weights(weights)
    words = {n: w for n, w in odd.items() if isinstance(w, bool) or not isinstance(w, (int, float))}
    if words:
        return f"{field}: each weight must be a number, got {words}"
    return f"{field} must be finite, got {odd}" if odd else None


def negative_weights_problem(weights: Any, who: str) -> str | None:
    """Why a table of finite reward weights with a negative weight is refused (``who`` trains it:
    ``"selfrl run"``, ``"selfrl serve"``), or None (no negative weight, or not a table of numbers:
    :func:`weights_problem` says so).

    >>> negative_weights_problem({"verifier": 1.0, "length_penalty": -0.1}, "selfrl run")[:64]
    "reward_weights: negative weight {'length_penalty': -0.1}: selfrl"
    """
    if not isinstance(weights, dict) or weights_problem(weights):
        return None
    negative = {n: w for n, w in weights.items() if w < 0}
    if not negative:
        return None
    return (f"reward_weights: negative weight {negative}: {who} would train away from what the reward pays"
            + (" (a negative user_feedback learns the opposite of what its users rate)" if "user_feedback" in negative
               else "")
            + "; use weights >= 0" + (" (length_penalty's values are already negative)" if "length_penalty" in negative
                                      else ""))


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


def unknown_key(obj: Any, key: str, where: str) -> str:
    """The error for ``key``, no field of the dataclass ``obj`` (at ``where``, ``"train."`` say): the
    full key, the field it is likely a misspelling of, the tables of ``obj`` that do have it (a key
    written at the top of the file that belongs in a table), then the valid keys.

    >>> from dataclasses import dataclass, field
    >>> @dataclass
    ... class L: reward_weights: dict = None; min_batch: int = 2
    >>> @dataclass
    ... class C: port: int = 0; learner: L = field(default_factory=L)
    >>> unknown_key(C(), "reward_weights", "")
    "unknown key 'reward_weights'; it belongs in [learner] (learner.reward_weights); valid: learner, port"
    >>> unknown_key(L(), "min_bach", "learner.")
    "unknown key 'learner.min_bach' (did you mean 'min_batch'?); valid: min_batch, reward_weights"
    """
    from difflib import get_close_matches

    names = sorted(f.name for f in dataclasses.fields(obj))
    message = f"unknown key {where + str(key)!r}"
    if like := get_close_matches(str(key), names, 1, cutoff=0.75):
        message += f" (did you mean {like[0]!r}?)"
    homes = [f.name for f in dataclasses.fields(obj) if dataclasses.is_dataclass(getattr(obj, f.name, None))
             and key in {g.name for g in dataclasses.fields(getattr(obj, f.name))}]
    if homes:
        message += "; it belongs in " + " or ".join(f"[{where}{h}] ({where}{h}.{key})" for h in homes)
    return message + f"; valid: {', '.join(names)}"


def _apply(obj, values: dict[str, Any], where: str, given: set[str] | None = None) -> None:
    """Set dataclass fields from a dict, recursing into nested dataclasses; each dotted key set
    (a table's own name too) is added to ``given`` when it is a set."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(unknown_key(obj, key, where))
        if given is not None:
            given.add(where + key)
        current = getattr(obj, key)
        item = fields[key].metadata.get("table_of")
        if item is not None:  # an array of tables ([[agents]]): each one a fresh dataclass
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"{where}{key} must be an array of tables ([[{key}]])")
            items = []
            for i, v in enumerate(value):
                items.append(item())
                _apply(items[-1], v, f"{where}{key}[{i}].", given)
            setattr(obj, key, items)
            continue
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{key} must be a table")
            _apply(current, value, f"{where}{key}.", given)
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
         base: dict[str, Any] | None = None, given: set[str] | None = None):
    """Set the fields of a config dataclass from ``base``, then a TOML file, then dotted
    ``overrides`` (None values skipped); returns ``cfg``. Shared by ``selfrl run`` and
    ``selfrl serve``.

    ``given``, when a set, receives the dotted key of every value the file and ``overrides``
    set, whatever the value (``task.source``; a table's name too: ``task``, ``families``,
    ``families[0].source``), so that a check can refuse a setting that would have no effect;
    ``base``'s keys are not added (a stored run's config, an environment's defaults: not the user's).

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
        _apply(cfg, data, "", given)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        *parents, leaf = dotted.split(".")
        nested: dict[str, Any] = {leaf: value}
        for p in reversed(parents):
            nested = {p: nested}
        _apply(cfg, nested, "", given)
    return cfg
