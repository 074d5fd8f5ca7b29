"""Fault injection for the crash-safety and collapse tests: one environment variable, read here only.

``SELFRL_FAULT`` holds comma-separated faults, each ``kind[:point]@iteration``:

* ``kill:<point>@N`` -- SIGKILL this process at the named point of iteration N
  (points: :data:`POINTS`); the way to test that ``--resume`` loses nothing.
* ``lr_x1000@N`` -- the update of iteration N runs with the learning rate times 1000.
* ``noise@N`` -- after the update of iteration N the LoRA weights are overwritten
  with Gaussian noise (std 1), as a corrupted checkpoint would be.
* ``nan_loss@N`` -- the loss of the update of iteration N is NaN.

``SELFRL_FAULT_FILE`` names a file whose text is read the same way at every hook, so that a
running process can be told to fault later (``scripts/soak.py`` writes ``noise@7`` into it
while ``selfrl serve`` runs): only the environment of the process's start decides whether the
file is read at all, and only whoever can write that file can inject. A missing or empty file
injects nothing.

Without either variable every hook is a no-op. Iteration -1 is the base validation
before the first iteration. The loop calls :func:`set_iteration` at the start of
each iteration, :func:`point` at the named points and :func:`active` where a
corrupting fault applies. In ``selfrl serve`` the background learner's update
number (0, 1, ..., counted on across restarts of the run directory) is the iteration, so ``noise@1`` poisons
its second update; the kill points that ``serve`` passes through are
``during_update``, ``during_save`` and ``after_save``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch

ENV = "SELFRL_FAULT"
ENV_FILE = "SELFRL_FAULT_FILE"
POINTS = ("after_rollout", "after_store", "during_update", "during_save", "after_save", "during_validation")
KINDS = ("kill", "lr_x1000", "noise", "nan_loss")


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` at ``point`` (kills only) of ``iteration``."""

    kind: str
    point: str | None
    iteration: int


def parse(spec: str) -> list[Fault]:
    """Parse a ``SELFRL_FAULT`` value.

    >>> parse("kill:during_save@1, nan_loss@0")
    [Fault(kind='kill', point='during_save', iteration=1), Fault(kind='nan_loss', point=None, iteration=0)]

    Raises:
        ValueError: unknown kind or point, or a missing ``@iteration``; the message lists the valid ones.
    """
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        head, sep, it = item.partition("@")
        kind, _, point = head.partition(":")
        if not sep or not it.lstrip("-").isdigit():
            raise ValueError(f"fault {item!r} needs '@<iteration>', e.g. kill:during_save@1")
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; valid: {', '.join(KINDS)}")
        if (kind == "kill") != bool(point) or (point and point not in POINTS):
            raise ValueError(f"fault {item!r}: kill takes one point of {', '.join(POINTS)}; other kinds take none")
        out.append(Fault(kind, point or None, int(it)))
    return out


_iteration = -1


def set_iteration(iteration: int) -> None:
    """Tell the hooks which iteration is running (-1: before the first)."""
    global _iteration
    _iteration = iteration


def _faults() -> list[Fault]:
    """The faults of ``SELFRL_FAULT`` and of the file ``SELFRL_FAULT_FILE`` names (read each call).

    Raises:
        ValueError: a bad spec in either (see :func:`parse`).
    """
    spec = os.environ.get(ENV, "")
    path = os.environ.get(ENV_FILE, "")
    if path:
        try:
            with open(path) as f:
                spec = f"{spec},{f.read()}"
        except FileNotFoundError:
            pass
    return parse(spec) if spec.strip(", \n") else []


def active(kind: str) -> bool:
    """True when a fault of ``kind`` is injected at the current iteration."""
    return any(f.kind == kind and f.iteration == _iteration for f in _faults())


def point(name: str) -> None:
    """A named point of the loop: SIGKILL this process here when a kill fault says so."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; valid: {', '.join(POINTS)}")
    if any(f.kind == "kill" and f.point == name and f.iteration == _iteration for f in _faults()):
        os.kill(os.getpid(), signal.SIGKILL)


def add_noise(params: list[torch.Tensor], std: float = 1.0) -> None:
    """Overwrite ``params`` in place with N(0, std^2) noise (the ``noise`` fault)."""
    with torch.no_grad():
        for p in params:
            p.normal_(0.0, std)
