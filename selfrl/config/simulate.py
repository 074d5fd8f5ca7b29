"""Settings of ``selfrl simulate``: the server it talks to, its bounds, how users judge
(``[users]``), which environments they come from (``[[families]]``) and how the mix of
families drifts over time (``[[phases]]``). Times are simulated seconds unless a name says
``real``; see docs/guides/simulate.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from selfrl.config.base import NAME_MAX, SECONDS_MAX, SEED_MAX, at_most, check_finite, fill, in_range, require

HostileAction = Literal["random_rating", "flood", "replay_turn", "replay_feedback"]
HOSTILE_ACTIONS: tuple[str, ...] = get_args(HostileAction)
GroupBy = Literal["task", "family"]
ToolChoice = Literal["auto", "required", "none"]
TOOL_CHOICES: tuple[str, ...] = get_args(ToolChoice)
GROUP_BY: tuple[str, ...] = get_args(GroupBy)
MAX_TURNS = 32  # turns of one conversation (tool calls and answers)
MAX_SIM_S = 10 * 365 * 24 * 3600.0  # ten simulated years: a schedule, a delay
MAX_CONCURRENCY = 1024  # conversations and reactions in flight at once (threads of one process)
MAX_ARRIVALS_PER_HOUR = 10**7  # conversations that start per simulated hour


@dataclass
class UserSettings:
    """How a simulated user judges an answer and reacts to it."""

    noise: float = 0.1  # share of wrong judgements: the user's verdict is the verifier's, flipped with this probability
    rating_p: float = 0.4  # probability of an explicit rating (+1 when judged right, -1 when judged wrong)
    correction_p: float = 0.3  # probability of a correction in the next turn when judged wrong (a user who judges it right stays silent instead)
    min_delay_s: float = 5.0  # shortest judgement delay (simulated seconds); delays are log-uniform in [min_delay_s, max_delay_s]
    max_delay_s: float = 3 * 86400.0  # longest judgement delay (simulated seconds)
    hostile_share: float = 0.05  # share of users who are hostile (each user is drawn once, by seed)
    hostile_actions: list[str] = field(default_factory=lambda: list(HOSTILE_ACTIONS))  # what hostile users do: random_rating, flood, replay_turn, replay_feedback
    flood_size: int = 20  # feedback posts of one flood, all on one turn

    def check(self, where: str = "users.") -> None:
        unknown = [a for a in self.hostile_actions if a not in HOSTILE_ACTIONS] \
            if isinstance(self.hostile_actions, list) else ["(not a list)"]
        require([
            in_range(self.noise, "noise", 0, 1, interval=True),
            in_range(self.rating_p, "rating_p", 0, 1, interval=True),
            in_range(self.correction_p, "correction_p", 0, 1, interval=True),
            (self.rating_p + self.correction_p <= 1.0,
             f"rating_p + correction_p must be <= 1 (the rest is silence), got {self.rating_p + self.correction_p!r}"),
            in_range(self.min_delay_s, "min_delay_s", 0, MAX_SIM_S, low_open=True),
            in_range(self.max_delay_s, "max_delay_s", 0, MAX_SIM_S, low_open=True),
            in_range(self.hostile_share, "hostile_share", 0, 1, interval=True),
            (not unknown and (self.hostile_actions or self.hostile_share == 0),
             f"hostile_actions must be a non-empty list of {', '.join(HOSTILE_ACTIONS)} (or hostile_share = 0), "
             f"got {self.hostile_actions!r}"),
            in_range(self.flood_size, "flood_size", 1, 10_000),
        ], where)
        require([at_most(self.min_delay_s, f"{where}min_delay_s", self.max_delay_s, f"{where}max_delay_s")])


@dataclass
class FamilySettings:
    """One family of users: the environment their tasks come from, and how they talk to the server."""

    name: str = "arithmetic"  # the family's name, sent as metadata.family and used in [[phases]] weights
    env: str = "chain_sum"  # the environment (selfrl envs): its tasks, tools and verifier
    options: dict[str, Any] = field(default_factory=dict)  # the environment's options, e.g. { tier = "easy" } for web
    users: int = 20  # distinct users of this family (user ids <name>-0 .. <name>-<users-1>)
    max_turns: int = 4  # most completions of one conversation (each tool call asks for one more)
    max_tokens: int = 96  # max_tokens of each completion
    demonstration: bool = True  # show the environment's worked example before the task (as a few-shot client would)
    tool_choice: ToolChoice = "auto"  # OpenAI tool_choice sent with the tools on each completion: auto | required (one call, decoded under the server's grammar) | none
    heldout_seed: int = 2000  # the server's task.val_seed for this family: its held-out tasks are never asked
    heldout_size: int = 64  # the server's gate.val_size for this family (held-out tasks excluded by id)

    def check(self, where: str = "families[].") -> None:
        require([
            (isinstance(self.name, str) and self.name.strip() != "" and len(self.name) <= NAME_MAX,
             f"name must be a non-empty string of at most {NAME_MAX} characters, got {self.name!r}"),
            (isinstance(self.env, str) and self.env != "", f"env must name an environment (selfrl envs), got {self.env!r}"),
            (isinstance(self.options, dict), "options must be a table"),
            in_range(self.users, "users", 1, 1_000_000),
            in_range(self.max_turns, "max_turns", 1, MAX_TURNS),
            in_range(self.max_tokens, "max_tokens", 1, 1_000_000),
            (self.tool_choice in TOOL_CHOICES,
             f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {self.tool_choice!r}"),
            in_range(self.heldout_seed, "heldout_seed", 0, SEED_MAX),
            in_range(self.heldout_size, "heldout_size", 0, 100_000),
        ], where)


@dataclass
class PhaseSettings:
    """One phase of the schedule: how long it lasts and how often each family arrives in it."""

    duration_s: float = 3600.0  # length of the phase in simulated seconds
    weights: dict[str, float] = field(default_factory=lambda: {"arithmetic": 1.0})  # family name = relative arrival weight

    def check(self, families: list[str], where: str = "phases[].") -> None:
        w = self.weights if isinstance(self.weights, dict) else {}
        bad = {k: v for k, v in w.items() if isinstance(v, bool) or not isinstance(v, (int, float))
               or not math.isfinite(v) or v < 0}
        require([
            in_range(self.duration_s, "duration_s", 0, MAX_SIM_S, low_open=True),
            (isinstance(self.weights, dict), "weights must be a table of family = weight"),
            (not bad, f"weights must be finite numbers >= 0, got {bad}"),
            (sum(w.values()) > 0 if not bad else True, "weights must give at least one family a weight above 0"),
            (set(w) <= set(families), f"weights name families that are not in [[families]]: "
                                      f"{sorted(set(w) - set(families))}; valid: {', '.join(families)}"),
        ], where)


def _default_families() -> list[FamilySettings]:
    return [FamilySettings("arithmetic", "chain_sum"),
            FamilySettings("function_calling", "function_calling", {"categories": ["simple"]}, max_turns=2,
                           heldout_size=96),
            FamilySettings("web", "web", {"tier": "easy"}, max_turns=3, heldout_size=24)]


def _default_phases() -> list[PhaseSettings]:
    return [PhaseSettings(3600.0, {"arithmetic": 1.0}),
            PhaseSettings(3600.0, {"arithmetic": 0.5, "function_calling": 0.5}),
            PhaseSettings(3600.0, {"arithmetic": 0.2, "function_calling": 0.4, "web": 0.4})]


@dataclass
class SimulateConfig:
    """Everything ``selfrl simulate`` needs (defaults: a ``selfrl serve`` on 127.0.0.1:8000)."""

    base_url: str = "http://127.0.0.1:8000"  # the server (selfrl serve); /v1 is added for the OpenAI client (a trailing /v1 given is taken off)
    model: str = "selfrl"  # the model id asked for (the server's served_model_name)
    seed: int = 0  # one seed for the whole traffic: schedule, users, tasks, noise, delays, hostile acts
    max_requests: int = 1000  # most HTTP requests sent (completions and feedback together)
    max_seconds: float = 3600.0  # most real seconds the simulation runs
    arrivals_per_hour: float = 20.0  # conversations that start per simulated hour (a Poisson process)
    day_s: float = 0.0  # real seconds one simulated day lasts; 0: simulated time never waits (a day passes at once)
    window_s: float = 3600.0  # simulated seconds of one window of the served-success table
    temperature: float = 1.0  # sampling temperature of each completion
    concurrency: int = 1  # conversations and reactions in flight at once (a pool of users; 1: one at a time)
    group_by: GroupBy = "family"  # the task_key sent: family (every turn of a family: one learner group per family) | task ("<family>:<task id>": a task rarely repeats, so few groups)
    per_user_tokens: bool = True  # each user sends its own bearer token on completions (false: the API key, for --protect-completions)
    timeout_s: float = 300.0  # real seconds one HTTP request may take
    out_dir: str = "runs/simulate"  # where summary.json and events.jsonl are written
    users: UserSettings = field(default_factory=UserSettings)
    families: list[FamilySettings] = field(default_factory=_default_families, metadata={"table_of": FamilySettings})
    phases: list[PhaseSettings] = field(default_factory=_default_phases, metadata={"table_of": PhaseSettings})

    def validate(self) -> SimulateConfig:
        """Check every value, and take a trailing ``/v1`` (the form OpenAI clients are given) and
        ``/`` off ``base_url`` (:func:`server_root`); returns ``self``.

        Raises:
            ConfigError: the first value out of range, named with its table.
        """
        check_finite(self)
        names = [f.name for f in self.families]
        require([
            (isinstance(self.base_url, str) and self.base_url.startswith(("http://", "https://")),
             f"base_url must start with http:// or https://, got {self.base_url!r}"),
            (isinstance(self.model, str) and self.model != "", "model must name the served model"),
            in_range(self.seed, "seed", 0, SEED_MAX),
            in_range(self.max_requests, "max_requests", 1, 10**9),
            in_range(self.max_seconds, "max_seconds", 0, SECONDS_MAX, low_open=True),
            in_range(self.arrivals_per_hour, "arrivals_per_hour", 0, MAX_ARRIVALS_PER_HOUR, low_open=True),
            in_range(self.day_s, "day_s", 0, SECONDS_MAX),
            in_range(self.window_s, "window_s", 0, MAX_SIM_S, low_open=True),
            in_range(self.temperature, "temperature", 0, 2),
            in_range(self.concurrency, "concurrency", 1, MAX_CONCURRENCY),
            (self.group_by in GROUP_BY, f"group_by must be one of {', '.join(GROUP_BY)}, got {self.group_by!r}"),
            in_range(self.timeout_s, "timeout_s", 0, SECONDS_MAX, low_open=True),
            (bool(self.families), "[[families]] must name at least one family"),
            (len(set(names)) == len(names), f"family names must differ, got {names}"),
            (bool(self.phases), "[[phases]] must hold at least one phase"),
        ])
        self.base_url = server_root(self.base_url)
        self.users.check()
        for i, f in enumerate(self.families):
            f.check(f"families[{i}].")
        default = _default_phases()
        named = sorted({n for p in default for n in p.weights})
        require([(self.phases != default or set(named) <= set(names),
                  f"[[families]] is set but [[phases]] is not, and the default schedule's phases name the families "
                  f"{', '.join(named)}: add [[phases]] tables that weight your own families "
                  f"({', '.join(names)}), e.g. [[phases]] duration_s = 3600, weights = {{ {names[0]} = 1.0 }}")])
        for i, p in enumerate(self.phases):
            p.check(names, f"phases[{i}].")
        return self


def server_root(url: str) -> str:
    """The server's root URL: ``url`` without a trailing ``/`` and ``/v1`` (the address OpenAI
    clients take; the simulator adds ``/v1`` itself, and the admin routes are not under it).

    >>> server_root("http://127.0.0.1:8000/v1/"), server_root("http://h:1"), server_root("https://h/api/v1")
    ('http://127.0.0.1:8000', 'http://h:1', 'https://h/api')
    """
    url = url.rstrip("/")
    return url.removesuffix("/v1").rstrip("/") if url.endswith("/v1") else url


def load_simulate_config(path=None, overrides: dict[str, Any] | None = None) -> SimulateConfig:
    """Defaults, then the TOML file at ``path``, then dotted ``overrides`` (None skipped), validated.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or a value out of range.
    """
    return fill(SimulateConfig(), path, overrides).validate()
