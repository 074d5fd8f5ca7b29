"""Stateful environments: per-trajectory state behind the agent's tools.

The calculator is stateless, so one ``Tool`` list serves every trajectory. A
web shop is not: a cart belongs to one trajectory. An ``Environment`` is made
per trajectory (by ``TaskSource.make_env(task)``) and holds that state; its
``tools`` are bound to it. ``selfrl.rollout.rollout`` dispatches a trajectory's
calls to its own environment's tools, asks ``is_completed()`` after each turn
(the episode may end before ``max_turns``) and records ``state()`` on the
trajectory (``Trajectory.env_state``), which is what the task source scores.

This is verifiers' ``MultiTurnEnv`` (``env_response`` + ``is_completed``) cut to
what selfrl needs: the tool-call parsing and the chat layout stay in the
rollout, so an environment only supplies its tools and its state.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from selfrl.tools import Tool


@runtime_checkable
class Environment(Protocol):
    """Per-trajectory state plus the tools that act on it.

    Attributes:
        tools: this trajectory's tools (same names and schemas for every
            instance, so that prompts are identical), bound to this state.
        demonstration: a worked example as chat messages, shown before the task
            instead of the calculator's ``selfrl.rollout.DEMONSTRATION``; None
            for that default.
    """

    tools: list[Tool]
    demonstration: list[dict[str, str]] | None

    def is_completed(self) -> bool:
        """True when the episode is over (checked after each turn's tool calls)."""
        ...

    def state(self) -> dict[str, Any]:
        """JSON-serializable summary of the final state, stored as ``Trajectory.env_state``."""
        ...
