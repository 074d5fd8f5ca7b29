"""Settings of the LLM judge reward (``[judge]`` and its ``[[judge.endpoints]]``); part of
:mod:`selfrl.config`, which re-exports every name. Values are checked here; the judge itself
(:mod:`selfrl.judge`) is imported by the run's setup only when a config names it, never by
the config. Imports no torch and nothing of selfrl but :mod:`selfrl.config.base`.

    [judge]
    calibration = "reference"          # known-good and known-bad answers mixed into each judged group
    [[judge.endpoints]]
    name = "smol"
    base_url = "http://127.0.0.1:8200/v1"
    rubric = "Score how likely the final answer is correct."
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from selfrl.config.base import in_range, one_of, require

JudgeMode = Literal["pointwise", "group"]  # one trajectory per call | the whole group in one call (RULER-style)
Combine = Literal["mean", "min", "vote"]  # how several judges (and rule rewards) make one score
StructuredOutput = Literal["json_schema", "none"]  # ask for response_format json_schema | plain text parsed strictly

JUDGE_REWARD = "judge"  # the reward function name selfrl.judge registers (reward_weights = {judge = 1.0})
# The detectors selfrl.judge registers; the config accepts these names without importing it
# (tests/test_judge_detectors.py pins that the two lists agree).
JUDGE_DETECTORS = ("judge_addressed", "judge_length_bias", "judge_vacuous")
CALIBRATION_OFF, CALIBRATION_REFERENCE = "off", "reference"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class JudgeEndpoint:
    """One judge: an OpenAI-compatible chat endpoint, its rubric and how it is called."""

    name: str = "judge"  # the judge's name in metrics (judge/<name>/...) and on scored trajectories
    base_url: str = "http://127.0.0.1:8200/v1"  # the endpoint's base URL; /chat/completions is appended
    model: str = "selfrl"  # the model id sent in each request (selfrl serve answers to its served_model_name)
    api_key_env: str = ""  # the NAME of the environment variable holding the API key ("": no key); never the key
    rubric: str = ""  # what a good answer is, in words; or leave empty and give rubric_file
    rubric_file: str = ""  # a text file holding the rubric (read at setup; rubric and rubric_file are exclusive)
    rubric_version: str = "1"  # part of the cache key: change it when the rubric's meaning changes
    mode: JudgeMode = "group"  # pointwise (one call per distinct trajectory) | group (one call per group, ranked)
    explain: bool = True  # ask for a one-line reason before each score (better verdicts, more output tokens)
    structured_output: StructuredOutput = "json_schema"  # json_schema (fallback to strict parsing on a 4xx) | none
    max_tokens: int = 512  # output tokens one call may use
    temperature: float = 0.0  # the judge's sampling temperature (0: greedy)
    deadline_s: float = 60.0  # seconds one call may take (the socket timeout); then it is retried
    retries: int = 2  # further tries after a timeout, a connection error, a 5xx or an unreadable verdict
    max_concurrency: int = 4  # calls in flight to this endpoint at once
    price_input_per_m: float = 0.0  # cost of 1M input (prompt) tokens, in your currency; 0: not priced
    price_output_per_m: float = 0.0  # cost of 1M output (completion) tokens

    def check(self, where: str = "") -> None:
        require([
            (bool(_NAME.fullmatch(self.name or "")), f"name must be letters, digits, _ . or -, got {self.name!r}"),
            (isinstance(self.base_url, str) and self.base_url.startswith(("http://", "https://")),
             f"base_url must start with http:// or https://, got {self.base_url!r}"),
            (bool(self.model), "model must not be empty"),
            (self.api_key_env == "" or bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env)),
             f"api_key_env must be an environment variable NAME (e.g. JUDGE_API_KEY), got {self.api_key_env!r}; "
             "put the key itself in that variable, never in the config"),
            (bool(self.rubric) != bool(self.rubric_file), "give exactly one of rubric and rubric_file"),
            (not self.rubric_file or Path(self.rubric_file).is_file(), f"rubric_file {self.rubric_file!r} is not a file"),
            (bool(self.rubric_version), "rubric_version must not be empty"),
            one_of(self.mode, JudgeMode, "mode"),
            one_of(self.structured_output, StructuredOutput, "structured_output"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (math.isfinite(self.deadline_s) and self.deadline_s > 0, "deadline_s must be > 0"),
            (self.retries >= 0, "retries must be >= 0"),
            (self.max_concurrency >= 1, "max_concurrency must be >= 1"),
            (math.isfinite(self.price_input_per_m) and self.price_input_per_m >= 0, "price_input_per_m must be >= 0"),
            (math.isfinite(self.price_output_per_m) and self.price_output_per_m >= 0,
             "price_output_per_m must be >= 0"),
        ], where)

    @property
    def rubric_text(self) -> str:
        """The rubric: ``rubric``, else the text of ``rubric_file`` (stripped)."""
        return self.rubric or Path(self.rubric_file).read_text().strip()


@dataclass
class JudgeConfig:
    """The ``judge`` reward: one or more judges (``[[judge.endpoints]]``), combined with rule
    rewards, capped by a floor, checked by calibration pairs (docs/guides/judge.md). Empty
    ``endpoints``: no judge."""

    endpoints: list[JudgeEndpoint] = field(default_factory=list, metadata={"table_of": JudgeEndpoint})
    rules: list[str] = field(default_factory=list)  # rule reward names combined with the judges' scores (e.g. ["verifier"])
    combine: Combine = "mean"  # mean | min | vote: how the members' scores (judges and rules) make one score
    vote_threshold: float = 0.5  # vote: a member votes "good" when its score is at least this; the score is the share of good votes
    disagreement: float = 0.5  # a trajectory whose members' scores differ by more than this (max - min) is recorded as disputed
    hold_out_disputed: bool = True  # leave a group with any disputed trajectory out of the update (False: record only)
    floor: str = ""  # a rule reward that caps the score from above (e.g. "verifier": a failed check caps at its 0); "": none
    calibration: str = CALIBRATION_OFF  # off | reference (pairs from the task's numeric answer) | path of a JSONL file of pairs
    calibration_pairs: int = 1  # known-good/known-bad pairs mixed into each judged group
    calibration_max_errors: float = 0.0  # share of a group's pairs a judge may rank wrongly before its verdicts there are held back
    cache: bool = True  # keep verdicts in RUN_DIR/judge_cache.db (keyed by task, content hash, judge, rubric version)

    @property
    def names(self) -> list[str]:
        """The judges' names, in order."""
        return [e.name for e in self.endpoints]

    def check(self, where: str = "") -> None:
        for i, e in enumerate(self.endpoints):
            e.check(f"{where}endpoints[{i}] ({e.name}).")
        require([
            (len(set(self.names)) == len(self.names), f"endpoint names must be unique, got {self.names}"),
            (isinstance(self.rules, list) and all(isinstance(r, str) and r for r in self.rules),
             "rules must be a list of reward function names"),
            (JUDGE_REWARD not in self.rules and self.floor != JUDGE_REWARD,
             f"{JUDGE_REWARD!r} cannot be one of its own rules or its floor"),
            one_of(self.combine, Combine, "combine"),
            in_range(self.vote_threshold, "vote_threshold", 0, 1, interval=True),
            in_range(self.disagreement, "disagreement", 0, 1),  # scores are in [0, 1]; 1 records nothing
            in_range(self.calibration_pairs, "calibration_pairs", 1, 64),
            in_range(self.calibration_max_errors, "calibration_max_errors", 0, 1, high_open=True, interval=True),
            (self.calibration in (CALIBRATION_OFF, CALIBRATION_REFERENCE) or Path(self.calibration).is_file(),
             f"calibration must be 'off', 'reference' or a JSONL file of pairs, got {self.calibration!r} "
             "(no such file)"),
            (not (self.endpoints == [] and (self.rules or self.floor)),
             "rules and floor need at least one [[judge.endpoints]] table"),
        ], where)

    def reward_names(self) -> list[str]:
        """The rule reward names this section refers to (rules and floor), for the registry check."""
        return [*self.rules, *([self.floor] if self.floor else [])]
