"""The environments shipped with selfrl, loaded explicitly: each one's module, imported by
name, so that one that fails to import is reported by name while the others still load.

An environment registers itself when its module is imported: its name (``register_env``),
and with it the tools, reward functions, presets and detectors it brings. Nothing imports
them as a side effect of importing ``selfrl.envs``; :func:`load_builtin_envs` does, once:

* ``selfrl run`` and ``selfrl serve`` call it at setup, before they check the names a
  config refers to (:func:`selfrl.run.setup.check_names`);
* :mod:`selfrl.envs.registry` calls it before it looks up a name or lists the
  environments, so that ``get_env("webshop")`` works from any script.

A user's environment loads by dotted path or entry point (``selfrl.envs.registry``) and is
not listed here. The modules are imported with ``importlib`` by name (plug-ins, as a
user's are): the import graph of ``selfrl/`` has no edge from here to them.

>>> "arithmetic" in BUILTIN_ENVS and not set(load_builtin_envs())  # every one loads here
True
"""

from __future__ import annotations

import importlib
import threading

# environment module (selfrl.envs.<name>) -> what it brings
BUILTIN_ENVS = {
    "arithmetic": "reasoning-gym arithmetic (aliases chain_sum, basic_arithmetic)",
    "webshop": "a scripted web shop with a cart",
    "code": "HumanEval/MBPP with hidden tests in the sandbox",
    "function_calling": "BFCL's function-calling tasks",
    "swe": "repairs of small repositories, with its detectors",
    "web": "a local web site, text or a real browser, with its detectors",
}

_lock = threading.RLock()  # one loader at a time; the loading thread may ask again
_loaded = False
_failed: dict[str, str] = {}  # module name -> "ExceptionType: message"


def load_builtin_envs() -> dict[str, str]:
    """Import every module of :data:`BUILTIN_ENVS` (once; later calls do nothing) and return
    the ones that failed: ``{name: "ExceptionType: message"}``, empty when all loaded.

    A module that raises while importing is recorded and skipped, and the others still load:
    :func:`failure` says why when that environment's name is looked up.
    """
    global _loaded
    with _lock:
        if not _loaded:
            _loaded = True  # set first: an environment's own imports may ask the registry again
            for name in BUILTIN_ENVS:
                try:
                    importlib.import_module(f"selfrl.envs.{name}")
                except Exception as e:  # noqa: BLE001  any failure is reported by name, never hidden
                    _failed[name] = f"{type(e).__name__}: {e}"
        return dict(_failed)


def failure(name: str) -> str | None:
    """Why the built-in environment ``name`` did not load (``"ExceptionType: message"``), or
    None when it loaded or is not a built-in one."""
    return _failed.get(name)


def failures_note() -> str:
    """One sentence naming every built-in environment that did not load and why ("" when none)."""
    if not _failed:
        return ""
    return " (built-in environments that failed to load: " + "; ".join(
        f"{name}: {why}" for name, why in _failed.items()) + ")"
