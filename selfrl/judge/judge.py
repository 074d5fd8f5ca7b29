"""One judge (one endpoint and rubric) scoring one group of trajectories, with its calibration
pairs mixed in, its verdicts cached, and its calls run concurrently.

* **pointwise**: one call per distinct answer of the group (equal answers are judged once
  and share the verdict), plus one call per calibration answer, all at once up to the
  endpoint's ``max_concurrency``.
* **group**: one call for the whole group (RULER-style: the shared context once, each
  distinct answer a candidate), the group's own calibration answers shuffled in among the
  candidates; a file pair answers another question and gets a two-candidate call of its own.

Only the ranking matters to GRPO (advantages are centred within the group), so a group
call's scores need not mean the same across groups.
"""

from __future__ import annotations

import hashlib
import random
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field

from selfrl.config.judge import JudgeEndpoint
from selfrl.judge.cache import VerdictCache, verdict_key
from selfrl.judge.calibration import CalibrationPair, held_back, ranked_right
from selfrl.judge.client import JudgeClient
from selfrl.judge.prompt import Messages, content_hash, group_messages, pointwise_messages, split_messages
from selfrl.judge.verdict import JudgeFailure, Verdict, group_schema, parse_group, parse_pointwise, pointwise_schema
from selfrl.core.tasks import Task
from selfrl.core.trajectory import Trajectory


@dataclass
class GroupVerdicts:
    """One judge's verdicts on one group.

    Attributes:
        verdicts: ``{trajectory id: Verdict}`` for every trajectory judged.
        failed: ``{trajectory id: reason}`` for every trajectory without a usable verdict (a
            failed call, or the whole group held back by calibration).
        cached: trajectories whose verdict came from the cache.
        right: calibration pairs ranked right; ``pairs``: calibration pairs judged.
        held_back: why the verdicts were held back (calibration failed), or None.
    """

    verdicts: dict[str, Verdict] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    cached: int = 0
    right: int = 0
    pairs: int = 0
    held_back: str | None = None


def _assistant(text: str) -> Messages:
    return [{"role": "assistant", "content": text}]


class Judge:
    """Scores groups with one endpoint.

    Args:
        endpoint: the judge's settings.
        client: its HTTP client (None: one is made from ``endpoint``).
        cache: the verdict cache (None: no cache).
        max_errors: ``[judge] calibration_max_errors``.
    """

    def __init__(self, endpoint: JudgeEndpoint, client: JudgeClient | None = None, cache: VerdictCache | None = None,
                 max_errors: float = 0.0):
        self.endpoint, self.cache, self.max_errors = endpoint, cache, max_errors
        self.client = client or JudgeClient(endpoint)
        self.rubric = endpoint.rubric_text
        self.rubric_sha = hashlib.sha256(self.rubric.encode()).hexdigest()[:12]
        self.pool = ThreadPoolExecutor(endpoint.max_concurrency, thread_name_prefix=f"judge-{endpoint.name}")

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    # -- one call each ----------------------------------------------------------------------

    def _pointwise(self, context: Messages, answer: Messages) -> Future:
        e = self.endpoint
        return self.pool.submit(self.client.complete, pointwise_messages(self.rubric, context, answer, e.explain),
                                pointwise_schema(e.explain), lambda text: parse_pointwise(text, e.explain))

    def _group(self, context: Messages, answers: list[tuple[str, Messages]]) -> Future:
        e, ids = self.endpoint, [cid for cid, _ in answers]
        return self.pool.submit(self.client.complete, group_messages(self.rubric, context, answers, e.explain),
                                group_schema(ids, e.explain), lambda text: parse_group(text, ids, e.explain))

    # -- a group ----------------------------------------------------------------------------

    def judge_group(self, task: Task, group: list[Trajectory], pairs: list[CalibrationPair]) -> GroupVerdicts:
        """Verdicts on every member of ``group`` (trajectories of ``task``), with the
        calibration ``pairs`` judged in the same batch. Never raises for a failed call: the
        failure is recorded in the result. A group found whole in the cache makes no call (and
        so judges no pair)."""
        answers: dict[str, Messages] = {}  # distinct answers by content hash, in first-seen order
        members: dict[str, list[str]] = {}  # hash -> trajectory ids
        for t in group:
            _, answer = split_messages(t.messages, task.question)
            h = content_hash(answer)
            answers.setdefault(h, answer)
            members.setdefault(h, []).append(t.id)
        context = split_messages(group[0].messages, task.question)[0] if group else []
        group_hash = content_hash([{"role": "hash", "content": h} for h in sorted(answers)])
        relative = self.endpoint.mode == "group"
        keys = {h: verdict_key(self.endpoint, task.id, h, group_hash if relative else "") for h in answers}
        found = {h: v for h in answers if self.cache is not None and (v := self.cache.get(keys[h])) is not None}
        if relative and len(found) < len(answers):
            found = {}  # a relative score is reused only with the whole group it was compared in
        todo = [h for h in answers if h not in found]
        res = GroupVerdicts(cached=sum(len(members[h]) for h in found))
        got, failed = dict(found), {}
        if todo:
            fresh, failed, res.right, res.pairs = self._judge(context, answers, todo, pairs, group_hash)
            got.update(fresh)
        if held_back(res.right, res.pairs, self.max_errors):
            res.held_back = (f"judge {self.endpoint.name} failed calibration: ranked {res.pairs - res.right} of "
                             f"{res.pairs} known good/bad pair(s) wrongly; its verdicts on this group are held back")
            got, failed = {}, {h: res.held_back for h in answers}
        elif self.cache is not None:
            for h in todo:
                if h in got:
                    self.cache.put(keys[h], self.endpoint.name, got[h])
        for h, ids in members.items():
            for tid in ids:
                if h in got:
                    res.verdicts[tid] = got[h]
                else:
                    res.failed[tid] = failed.get(h, "no verdict")
        return res

    def _judge(self, context: Messages, answers: dict[str, Messages], todo: list[str], pairs: list[CalibrationPair],
               group_hash: str) -> tuple[dict[str, Verdict], dict[str, str], int, int]:
        """The calls for the answers ``todo`` and the calibration ``pairs``, made at once;
        returns ``(verdicts by hash, failures by hash, pairs ranked right, pairs judged)``. A pair
        whose call failed counts as ranked wrongly."""
        got: dict[str, Verdict] = {}
        failed: dict[str, str] = {}
        known: list[list[float | None]] = [[None, None] for _ in pairs]  # (good, bad) score of each pair
        # (call, on its verdict, on its failure)
        calls: list[tuple[Future, Callable[[object], None], Callable[[str], None]]] = []

        def answer_call(fut: Future, h: str) -> None:
            calls.append((fut, lambda v: got.__setitem__(h, v), lambda err: failed.__setitem__(h, err)))

        def known_call(fut: Future, i: int, j: int) -> None:  # pair i, good (j=0) or bad (j=1)
            calls.append((fut, lambda v: known[i].__setitem__(j, v.score), lambda err: None))

        def pair_context(p: CalibrationPair) -> Messages:
            return context if p.question is None else [{"role": "user", "content": p.question}]

        rng = random.Random(group_hash)
        if self.endpoint.mode == "pointwise":
            for h in todo:
                answer_call(self._pointwise(context, answers[h]), h)
            for i, p in enumerate(pairs):
                known_call(self._pointwise(pair_context(p), _assistant(p.good)), i, 0)
                known_call(self._pointwise(pair_context(p), _assistant(p.bad)), i, 1)
        else:
            # the group's call: its answers and its own task's known answers, shuffled, ids c1..cN
            entries = [(("answer", h), answers[h]) for h in todo]
            entries += [((j, i), _assistant(text)) for i, p in enumerate(pairs) if p.question is None
                        for j, text in enumerate((p.good, p.bad))]
            rng.shuffle(entries)
            cids = [f"c{n + 1}" for n in range(len(entries))]
            fut = self._group(context, [(cid, msgs) for cid, (_, msgs) in zip(cids, entries)])
            for cid, (tag, _) in zip(cids, entries):
                if tag[0] == "answer":
                    calls.append((fut, lambda out, h=tag[1], cid=cid: got.__setitem__(h, out[cid]),
                                  lambda err, h=tag[1]: failed.__setitem__(h, err)))
                else:
                    calls.append((fut, lambda out, j=tag[0], i=tag[1], cid=cid: known[i].__setitem__(j, out[cid].score),
                                  lambda err: None))
            for i, p in enumerate(pairs):  # a pair for another question: a two-candidate call of its own
                if p.question is None:
                    continue
                order = [0, 1]
                rng.shuffle(order)
                texts = (p.good, p.bad)
                fut = self._group(pair_context(p), [(f"c{n + 1}", _assistant(texts[j])) for n, j in enumerate(order)])
                for n, j in enumerate(order):
                    calls.append((fut, lambda out, j=j, i=i, cid=f"c{n + 1}": known[i].__setitem__(j, out[cid].score),
                                  lambda err: None))
        for fut, on_verdict, on_failure in calls:
            try:
                out = fut.result()
            except JudgeFailure as err:
                on_failure(str(err))
            except Exception as err:  # anything else in a call is recorded too, never a score
                on_failure(f"judge {self.endpoint.name}: {type(err).__name__}: {err}")
            else:
                on_verdict(out)
        right = sum(g is not None and b is not None and ranked_right(g, b) for g, b in known)
        return got, failed, right, len(pairs)
