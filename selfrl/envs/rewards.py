"""Reward functions, their registry and presets, and the scoring of trajectory groups.

A reward function is a plain callable ``fn(traj, ctx) -> float | None``; None
means "not applicable to this trajectory" and is left out of the weighted sum.
``score_group`` runs the weighted functions of a preset over one group (the
rollouts of one task in one iteration) and writes ``traj.rewards`` (the
breakdown), ``traj.reward`` (the weighted sum) and ``traj.correct`` (the
verifier's verdict, kept for accounting even when it is not rewarded).

Failures are never turned into rewards: a trajectory whose rollout failed
(``traj.error`` set) gets ``reward=None`` and is left out of the update, and a
reward function that raises records its exception on ``traj.error`` instead of
scoring 0.0 (verifiers' rubric does the latter and corrupts the gradient silently).
"""

from __future__ import annotations

import difflib
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal

from selfrl.core.tasks import Task, TaskSource
from selfrl.core.trajectory import Trajectory

__all__ = [
    "PRESETS",
    "PRESET_DOCS",
    "REWARD_FUNCS",
    "RewardContext",
    "RewardFunc",
    "format_reward",
    "get_preset",
    "get_reward_func",
    "agreement",
    "length_penalty",
    "normalize_answer",
    "partial_credit",
    "register_preset",
    "register_reward_func",
    "score_batch",
    "score_group",
    "self_consistency",
    "tool_success",
    "user_correction",
    "user_feedback",
    "verifier",
]


@dataclass
class RewardContext:
    """What a reward function may look at besides the trajectory itself.

    Attributes:
        task: the task the trajectory solved.
        source: the task source that made ``task`` (extracts and checks answers).
        group: every scorable trajectory of the same ``group_id``, the scored one included.
    """

    task: Task
    source: TaskSource
    group: list[Trajectory]
    cache: dict = field(default_factory=dict)  # per-group results a reward computes once (agreement)


RewardFunc = Callable[[Trajectory, RewardContext], "float | None"]


# ---------------------------------------------------------------- functions


def verifier(traj: Trajectory, ctx: RewardContext) -> float:
    """Binary correctness against the task's reference answer: 0.0 or 1.0, never None.

    1.0 when ``source.correct(task, source.trajectory_answer(traj))`` (by default the
    answer extracted from ``traj.final_answer``; the web shop's is its order outcome),
    i.e. the source's score is full credit, else 0.0. A trajectory with no final
    answer (e.g. truncated before answering) gets 0.0.

    Binary on purpose: reasoning-gym's ``score_answer`` gives partial credit to
    some wrong answers, e.g. "1227" for a reference of 227 scores 0.75 because it
    contains the right digits; rewarding that partial score would pay the policy
    for wrong answers.
    """
    answer = ctx.source.trajectory_answer(traj)
    return 1.0 if ctx.source.correct(ctx.task, answer) else 0.0


_NUMERIC_RE = re.compile(r"-?\d+(?:\.\d+)?")


def normalize_answer(answer: str | None) -> str | None:
    """Canonical text of an extracted answer, for comparing answers with each other.

    Strips whitespace and removes thousands commas; a plain number is written in
    its shortest form ("3.0" -> "3", "2.50" -> "2.5", "-0" -> "0"). Other text is
    kept as is (after strip and comma removal). None or empty gives None.
    """
    if answer is None:
        return None
    text = answer.strip().replace(",", "")
    if not text:
        return None
    if _NUMERIC_RE.fullmatch(text):
        value = Decimal(text)
        if value == value.to_integral_value():
            return str(int(value))
        return format(value.normalize(), "f")
    return text


def self_consistency(traj: Trajectory, ctx: RewardContext) -> float | None:
    """Label-free agreement with the group's majority answer: 0.0, 1.0, or None.

    Every member of ``ctx.group`` has its answer extracted
    (``source.extract_answer(final_answer or "")``) and normalized with
    ``normalize_answer``; members with no answer do not vote. The majority answer
    is the most frequent one, and it exists only when its count is greater than 1
    and no other answer has the same count (a unique plurality, not necessarily
    more than half). Returns:

    * None when fewer than 2 members gave an answer, or when there is no majority
      (a tie for the top count, or all answers different): the group carries no
      consensus to reward;
    * 1.0 when this trajectory's answer equals the majority answer;
    * 0.0 otherwise, including when this trajectory gave no answer.

    Agreement alone rewards a collapse to a constant answer (always saying "0"
    agrees perfectly); the validation gate (which checks accuracy on held-out
    tasks with the verifier) and the guards are what stop such a policy, not this
    function.
    """
    def answer_of(t: Trajectory) -> str | None:
        return normalize_answer(ctx.source.trajectory_answer(t))

    counts = Counter(a for a in map(answer_of, ctx.group) if a is not None)
    if sum(counts.values()) < 2:
        return None
    (top, top_count), *rest = counts.most_common()
    if top_count < 2 or (rest and rest[0][1] == top_count):
        return None
    return 1.0 if answer_of(traj) == top else 0.0


def tool_success(traj: Trajectory, ctx: RewardContext) -> float | None:
    """Share of this trajectory's tool calls that succeeded, in [0, 1]; None when no tool was called.

    A call succeeds when it parsed, named a known tool, matched its schema and ran
    (``ToolCallRecord.ok``); this is ``traj.tool_success_rate``.
    """
    return traj.tool_success_rate


_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"


def format_reward(traj: Trajectory, ctx: RewardContext) -> float:
    """Well-formed answer tag: 1.0 or 0.0 (registered as ``"format"``).

    1.0 when the final answer holds exactly one ``<answer>`` and exactly one
    ``</answer>``, in that order, with non-blank text between them (so nothing
    is nested: a second ``<answer>`` inside fails the count); else 0.0, also when
    there is no final answer. Text outside the tag is allowed.

    FINDINGS: in an earlier probe the policy learned this bonus at the expense of
    accuracy, so the presets give it weight 0 (they leave it out).
    """
    text = traj.final_answer or ""
    if text.count(_ANSWER_OPEN) != 1 or text.count(_ANSWER_CLOSE) != 1:
        return 0.0
    start = text.index(_ANSWER_OPEN) + len(_ANSWER_OPEN)
    end = text.index(_ANSWER_CLOSE)
    if end < start or not text[start:end].strip():
        return 0.0
    return 1.0


def partial_credit(traj: Trajectory, ctx: RewardContext) -> float:
    """The source's own score of the answer, partial credit included: in [0, 1], never None.

    ``source.score(task, source.trajectory_answer(traj))``. For function calling it
    pays the right function name and each right argument (``selfrl.envs.function_calling``);
    for reasoning-gym it pays some wrong answers (see ``verifier``), so the
    arithmetic presets do not use it.
    """
    return float(ctx.source.score(ctx.task, ctx.source.trajectory_answer(traj)))


def agreement(traj: Trajectory, ctx: RewardContext) -> float | None:
    """Label-free agreement of this sample with the rest of its group, as its environment defines it.

    The source computes it once per group with ``source.agreement_scores(task, group)``
    (``{trajectory id: score or None}``): CodeT-style execution agreement for code
    (``selfrl.envs.code``), call agreement for function calling
    (``selfrl.envs.function_calling``). A source without that method falls back to
    ``self_consistency`` on extracted answers.
    """
    scorer = getattr(ctx.source, "agreement_scores", None)
    if scorer is None:
        return self_consistency(traj, ctx)
    if "agreement" not in ctx.cache:
        ctx.cache["agreement"] = scorer(ctx.task, ctx.group)
    return ctx.cache["agreement"].get(traj.id)


CORRECTION_RE = re.compile(
    r"^\W*(no\b|nope\b|wrong\b|incorrect\b|not (quite|right|correct)\b|that'?s (not|wrong|incorrect)\b"
    r"|that is (not|wrong|incorrect)\b|try again\b|actually\b|you made a mistake|you are wrong|you're wrong)",
    re.IGNORECASE,
)
REPEAT_SIMILARITY = 0.85


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def correction_reason(new_user_text: str, previous_user_text: str | None) -> str | None:
    """Why ``new_user_text`` counts as a correction of our last answer, or None.

    >>> correction_reason("No, that's wrong. It is 42.", "What is 6*7?")
    'opens with a correction phrase'
    >>> correction_reason("what is 6 * 7?", "What is 6*7?")
    'repeats the previous request'
    >>> correction_reason("Thanks! Now add 3.", "What is 6*7?") is None
    True
    """
    if CORRECTION_RE.match(new_user_text or ""):
        return "opens with a correction phrase"
    if previous_user_text and new_user_text:
        ratio = difflib.SequenceMatcher(None, _norm(new_user_text), _norm(previous_user_text)).ratio()
        if ratio >= REPEAT_SIMILARITY:
            return "repeats the previous request"
    return None


def user_correction(traj: Trajectory, ctx: RewardContext) -> float | None:
    """-1.0 when a user message after the first answer corrects it, 0.0 when the user
    went on without correcting, None when no user spoke after an answer.

    A correction is what :func:`correction_reason` says it is (a correction phrase, or the
    request asked again); ``selfrl serve`` reads its conversations with the same rule.

    >>> t = Trajectory("t", "g", 0, messages=[{"role": "user", "content": "6*7?"},
    ...     {"role": "assistant", "content": "41"}, {"role": "user", "content": "No, that's wrong."}])
    >>> user_correction(t, None)
    -1.0
    """
    msgs = traj.messages
    answered = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if answered is None:
        return None
    first_user = next((m["content"] for m in msgs[:answered] if m["role"] == "user"), None)
    later = [m["content"] for m in msgs[answered + 1:] if m["role"] == "user"]
    if not later:
        return None
    return -1.0 if any(correction_reason(text, first_user) for text in later) else 0.0


LENGTH_PENALTY_TOKENS = 1024  # sampled tokens that cost the whole penalty


def length_penalty(traj: Trajectory, ctx: RewardContext) -> float:
    """Minus the share of ``LENGTH_PENALTY_TOKENS`` the trajectory sampled, in [-1, 0];
    -1.0 for a trajectory cut off at the token limit (DAPO's overlong penalty, linear).

    >>> length_penalty(Trajectory("t", "g", 0, completion_mask=[0] * 4 + [1] * 256), None)
    -0.25
    """
    if traj.truncated:
        return -1.0
    return -min(1.0, traj.num_completion_tokens / LENGTH_PENALTY_TOKENS)


def user_feedback(traj: Trajectory, ctx: RewardContext) -> float | None:
    """A user's verdict on a served turn, in [-1, 1] (explicit, inherited or implicit feedback,
    see ``selfrl.serve.feedback``); None when none arrived. ``selfrl serve`` puts each turn's
    value in its group's task as ``metadata["feedback"][traj.id]``; elsewhere it is None.

    >>> from selfrl.core.tasks import Task
    >>> t = Trajectory("g", "g", 0, id="t1")
    >>> ctx = RewardContext(Task("g", "served", "", "", {"feedback": {"t1": -1.0}}), None, [t])
    >>> user_feedback(t, ctx), user_feedback(Trajectory("g", "g", 0, id="t2"), ctx)
    (-1.0, None)
    """
    return (ctx.task.metadata.get("feedback") or {}).get(traj.id)


# ---------------------------------------------------------------- registry and presets

REWARD_FUNCS: dict[str, RewardFunc] = {
    "verifier": verifier,
    "self_consistency": self_consistency,
    "tool_success": tool_success,
    "format": format_reward,
    "partial_credit": partial_credit,
    "agreement": agreement,
    "user_correction": user_correction,
    "length_penalty": length_penalty,
    "user_feedback": user_feedback,  # served turns only (selfrl serve's learner)
}

# One named template per task kind. Each says what it pays and how a policy can game it.
# "label-free" presets never use the verifier: they stand for runs without reference answers.
PRESETS: dict[str, dict[str, float]] = {}
PRESET_DOCS: dict[str, str] = {}


def register_reward_func(name: str, fn: RewardFunc) -> None:
    """Register reward function ``fn`` under ``name``, once (an environment's own reward).

    Raises:
        ValueError: ``name`` is taken by another function.
    """
    if REWARD_FUNCS.get(name, fn) is not fn:
        raise ValueError(f"reward function {name!r} is already registered")
    REWARD_FUNCS[name] = fn


def register_preset(name: str, weights: dict[str, float], doc: str) -> None:
    """Register preset ``name`` = ``weights`` with ``doc`` (what it pays; how it can be gamed).

    Raises:
        ValueError: ``name`` is taken, a function is unknown, or a weight is not finite.
    """
    if name in PRESETS and PRESETS[name] != weights:
        raise ValueError(f"reward preset {name!r} is already registered")
    check_weights(weights)
    PRESETS[name] = dict(weights)
    PRESET_DOCS[name] = doc


def get_reward_func(name: str) -> RewardFunc:
    """The reward function registered as ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    if name not in REWARD_FUNCS:
        raise ValueError(f"unknown reward function {name!r}; valid names: {', '.join(sorted(REWARD_FUNCS))}")
    return REWARD_FUNCS[name]


def get_preset(name: str) -> dict[str, float]:
    """A copy of the weights ``{reward function name: weight}`` of preset ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown reward preset {name!r}; valid names: {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])


# ---------------------------------------------------------------- scoring


def check_weights(weights: dict[str, float]) -> dict[str, RewardFunc]:
    """The reward functions named by ``weights``.

    Raises:
        ValueError: an unknown name (the message lists the valid ones), or a weight
            that is not a finite number.
    """
    funcs = {name: get_reward_func(name) for name in weights}
    bad = {name: w for name, w in weights.items()
           if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)}
    if bad:
        raise ValueError(f"reward weights must be finite, got {bad}")
    return funcs


def score_group(
    trajs: list[Trajectory],
    task: Task,
    source: TaskSource,
    weights: dict[str, float],
) -> None:
    """Score one group of trajectories of ``task`` in place.

    For each trajectory with ``error is None``: ``rewards = {name: value}`` for
    every function named in ``weights`` (None values kept), ``reward = sum(w * v)``
    over the non-None values (0.0 when all are None), and ``correct`` = the
    verifier's verdict, computed always (also in label-free runs) for accounting.

    A trajectory with ``error`` set gets ``reward=None`` and is left out (it does
    not vote in ``self_consistency`` either). A reward function that raises, or
    returns a non-finite value, or a weighted sum that overflows to inf, records the
    failure on ``traj.error`` and leaves ``reward=None``; the other trajectories are
    still scored.

    Raises:
        ValueError: an unknown function name or a non-finite weight (before
            anything is written), or a trajectory of another task.
    """
    funcs = check_weights(weights)
    others = sorted({t.task_id for t in trajs if t.task_id != task.id})
    if others:
        raise ValueError(f"score_group for task {task.id} got trajectories of other task(s): {', '.join(others)}")
    scorable = [t for t in trajs if t.error is None]
    for traj in trajs:
        traj.reward = None
    ctx = RewardContext(task=task, source=source, group=scorable)
    for traj in scorable:
        traj.rewards = {}
        stage = "verifier (for correct)"
        try:
            traj.correct = verifier(traj, ctx) == 1.0
            for name, fn in funcs.items():
                stage = name
                value = fn(traj, ctx)
                if value is not None:
                    value = float(value)
                    if not math.isfinite(value):
                        raise ValueError(f"returned a non-finite value {value}")
                traj.rewards[name] = value
            stage = "weighted sum"
            total = float(sum(weights[n] * v for n, v in traj.rewards.items() if v is not None))
            if not math.isfinite(total):  # e.g. weight 1e200 x reward 1e200: inf, never a reward
                raise ValueError(f"sum(weight * value) over {traj.rewards} with weights {weights} "
                                 f"is {total}; use smaller weights or rewards")
        except Exception as err:  # recorded on the trajectory, never turned into a reward
            traj.error = f"reward {stage!r} failed: {type(err).__name__}: {err}"
            continue
        traj.reward = total


def score_batch(
    trajs: list[Trajectory],
    tasks_by_id: dict[str, Task],
    source: TaskSource,
    weights: dict[str, float],
) -> None:
    """Group ``trajs`` by ``group_id`` and ``score_group`` each group in place.

    Raises:
        ValueError: a group mixes tasks, or a trajectory's task is not in
            ``tasks_by_id`` (checked for all groups before any is scored), or as
            ``score_group``.
    """
    check_weights(weights)
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for traj in trajs:
        groups[traj.group_id].append(traj)
    for gid, group in groups.items():
        ids = sorted({t.task_id for t in group})
        if len(ids) != 1:
            raise ValueError(f"group {gid!r} mixes tasks: {', '.join(ids)}")
        if ids[0] not in tasks_by_id:
            raise ValueError(f"group {gid!r}: task {ids[0]} is not in tasks_by_id")
    for group in groups.values():
        score_group(group, tasks_by_id[group[0].task_id], source, weights)


# ---------------------------------------------------------------- the built-in templates

register_preset("verified", {"verifier": 1.0, "tool_success": 0.2},
                "arithmetic: 1 for the right answer, +0.2 x the share of tool calls that ran. "
                "Gamed by: calling the calculator pointlessly earns the 0.2 (capped at 0.2 a trajectory).")
register_preset("label-free", {"self_consistency": 1.0, "tool_success": 0.2},
                "arithmetic without labels: 1 for agreeing with the group's majority answer, +0.2 tool success. "
                "Gamed by: a collapse to one constant answer agrees perfectly; the held-out gate catches it.")
register_preset("code", {"verifier": 1.0},
                "code: 1 when the final program passes the task's hidden tests in the sandbox. "
                "Gamed by: special-casing the inputs visible in the docstring's examples when the hidden "
                "tests are few; reading the tests is impossible (they run after the answer, in the sandbox).")
register_preset("code-label-free", {"agreement": 1.0},
                "code without tests (CodeT-style): the share of the other samples whose programs give the same "
                "outputs as this one on inputs the samples wrote. Gamed by: programs that all fail the same way "
                "(or return a constant) agree; weak when most samples are wrong.")
register_preset("function_calling", {"verifier": 1.0},
                "function calling: 1 when the calls match BFCL's possible answers by AST (function names, "
                "required arguments, allowed values); for irrelevance, 1 for making no call. Gamed by: never "
                "calling on irrelevance-heavy mixes; keep the category mix balanced.")
register_preset("function_calling-partial", {"partial_credit": 1.0},
                "function calling with partial credit: 0.5 for the right function name(s), 0.5 x the share of "
                "right arguments; 1 only for an exact AST match. Gamed by: the right name with junk arguments "
                "earns 0.5; the gate measures exact matches.")
register_preset("function_calling-label-free", {"agreement": 1.0},
                "function calling without answers: the share of the other samples that made the same calls "
                "(BFCL's normalisation; order ignored). Gamed by: a constant call, or never calling, agrees perfectly.")
