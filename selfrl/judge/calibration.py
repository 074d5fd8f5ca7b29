"""Calibration: known-good and known-bad answers mixed into the judge's batches, unseen.

Each judged group gets ``calibration_pairs`` pairs. A pair is *ranked right* when the judge
scores its good answer strictly above its bad one (a tie is wrong: a judge that cannot tell
them apart is no judge for them). A judge that ranks more than ``calibration_max_errors`` of a
group's pairs wrongly has its verdicts for that group held back (the group is left out of the
update, recorded); its share ranked right is logged every iteration
(``judge/<name>/calibration``), so that drift shows in the report.

Where pairs come from (``[judge] calibration``):

* ``reference``: from a verified task, the judged group's own. The good answer states the
  task's reference answer, the bad one a nearby wrong number; both are checked by the task
  source's verifier, and a task whose answer is not a number gives no pair. In group mode the
  two answers join the group's own call as two more candidates, indistinguishable from the
  others; in pointwise mode they are two more calls.
* a JSONL file written by the user, one pair a line: ``{"question": ..., "good": ..., "bad": ...}``,
  taken in turn. Since they answer another question, they are judged in calls of their own
  (pointwise: one call each; group: the two together), sent beside the group's.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from selfrl.config.judge import CALIBRATION_OFF, CALIBRATION_REFERENCE
from selfrl.core.tasks import Task, TaskSource


@dataclass(frozen=True)
class CalibrationPair:
    """A known-good and a known-bad answer (assistant message texts) to ``question``; None: to the
    judged group's own task."""

    good: str
    bad: str
    question: str | None = None


def load_pairs(path: str | Path) -> list[CalibrationPair]:
    """The pairs of a JSONL file (blank lines skipped).

    Raises:
        ValueError: a line that is not an object with non-empty string ``question``, ``good``
            and ``bad`` (the line number is named), or a file without pairs.
    """
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) and row[k].strip()
                                                for k in ("question", "good", "bad")):
            raise ValueError(f"{path}:{n}: a calibration pair needs non-empty strings question, good and bad")
        pairs.append(CalibrationPair(row["good"], row["bad"], row["question"]))
    if not pairs:
        raise ValueError(f"{path}: no calibration pairs")
    return pairs


def reference_pairs(task: Task, source: TaskSource, k: int, seed: int = 0) -> list[CalibrationPair]:
    """Up to ``k`` pairs for ``task`` from its numeric reference answer: the good answer
    ``<answer>REF</answer>``, the bad one ``<answer>REF +- d</answer>`` (d from 1 to 10, drawn with
    ``seed`` and the task id), each kept only when ``source`` says the good one is right and
    the bad one wrong. [] when the answer is not a number.

    >>> from selfrl.envs import get_env
    >>> env = get_env("chain_sum")
    >>> task = env.sample(1, 0)[0]
    >>> pair = reference_pairs(task, env, 1)[0]
    >>> env.correct(task, env.extract_answer(pair.good)), env.correct(task, env.extract_answer(pair.bad))
    (True, False)
    """
    try:
        ref = Decimal(str(task.answer).strip().replace(",", ""))
    except InvalidOperation:
        return []
    if not ref.is_finite():
        return []
    rng = random.Random(f"{seed}:{task.id}")
    good = f"<answer>{task.answer.strip()}</answer>"
    if not source.correct(task, source.extract_answer(good)):
        return []
    out = []
    for _ in range(4 * k):
        if len(out) == k:
            break
        bad = f"<answer>{ref + rng.choice([-1, 1]) * rng.randint(1, 10)}</answer>"
        if not source.correct(task, source.extract_answer(bad)):
            out.append(CalibrationPair(good, bad))
    return out


class CalibrationSource:
    """The pairs for each judged group, from ``spec`` (``off``, ``reference`` or a JSONL path).

    Raises:
        ValueError: as :func:`load_pairs`.
    """

    def __init__(self, spec: str, k: int, seed: int = 0):
        self.spec, self.k, self.seed = spec, k, seed
        self.file_pairs = [] if spec in (CALIBRATION_OFF, CALIBRATION_REFERENCE) else load_pairs(spec)
        self.cursor = 0

    @property
    def enabled(self) -> bool:
        return self.spec != CALIBRATION_OFF

    def pairs(self, task: Task, source: TaskSource) -> list[CalibrationPair]:
        """The next ``k`` pairs for a group of ``task`` ([] when off, or no pair can be made)."""
        if self.spec == CALIBRATION_OFF:
            return []
        if self.spec == CALIBRATION_REFERENCE:
            return reference_pairs(task, source, self.k, self.seed)
        out = [self.file_pairs[(self.cursor + i) % len(self.file_pairs)] for i in range(self.k)]
        self.cursor += self.k
        return out


def ranked_right(good: float, bad: float) -> bool:
    """A pair is ranked right when the good answer scores strictly higher.

    >>> ranked_right(0.8, 0.2), ranked_right(0.5, 0.5)
    (True, False)
    """
    return good > bad


def held_back(right: int, total: int, max_errors: float) -> bool:
    """Whether a judge with ``right`` of ``total`` pairs ranked right is held back: its share of
    wrong rankings exceeds ``max_errors`` (no pairs: never).

    >>> held_back(1, 1, 0.0), held_back(0, 1, 0.0), held_back(3, 4, 0.25), held_back(2, 4, 0.25)
    (False, True, False, True)
    """
    return total > 0 and (total - right) / total > max_errors
