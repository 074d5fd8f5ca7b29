"""The simulation loop: conversations arrive, users react later, everything is logged.

One queue of events ordered by simulated time (ties: the order they were queued): a
conversation's arrival (then the next arrival is queued), and a user's delayed reaction.
Each event is handled when the clock reaches it (``clock.wait_until``: at once with a
:class:`~selfrl.simulate.clock.FakeClock`, after a real sleep with a
:class:`~selfrl.simulate.clock.ScaledClock`). With ``concurrency = 1`` conversations run one
after another, and a conversation takes no simulated time under a fake clock. With
``concurrency = n`` a pool of ``n`` threads handles the events: an event due is handed to a
free thread, and the loop waits while all ``n`` are busy (a user who finds the server busy waits
its turn, as a client with a connection pool does). Under a fake clock the time then jumps to
the next event's even while earlier conversations are in flight, so their reactions are queued
from that later time; the plans and their draws are the same for every ``concurrency``.

* **A conversation** (:meth:`Simulator.converse`): the plan's task is sent as chat messages
  with the environment's tools (as that turn offers them: :meth:`Family.openai_tools`), the
  family's ``tool_choice`` and ``metadata = {"family", "user"}``; the model's tool calls
  run on the environment's tools and go back as tool messages, up to the family's
  ``max_turns``; the final answer is scored by the verifier (the outcome, logged), judged by
  the user and the reaction queued at ``now + delay_s``.
* **A reaction**: a rating is ``POST /v1/feedback {response_id, choice: 0, rating: ±1}``; a
  correction is the conversation sent back with a user message "No, that's wrong, the answer
  is X." (X: the task's reference answer), then ``POST /v1/feedback`` with ``corrected: true``
  and ``correction: X`` (the server reads corrections from feedback too), or
  ``correction_tool_calls`` where the corrected turn's right answer is a call
  (:meth:`Family.right_calls`: a function-calling task's first possible answer; the calculator
  on an arithmetic task's expression, while no tool has answered); a hostile user's
  action (``selfrl.simulate.users``).

Bounds: at most ``max_requests`` HTTP requests (completions and feedback alike) and
``max_seconds`` real seconds; reactions still queued when a bound or the schedule's end
stops the loop are counted as ``pending`` and never sent. The schedule's end stops new
conversations; queued reactions are still sent after it (within the bounds). Ctrl-C (a
``KeyboardInterrupt`` in the loop's thread; ``selfrl simulate`` turns SIGTERM and SIGHUP into
one too) stops it as a bound does: the requests in flight finish, and the summary of what was
sent says ``stopped_by: "interrupted"`` and the signal.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from selfrl.config.simulate import SimulateConfig
from selfrl.simulate.client import Client, Reply
from selfrl.simulate.clock import FakeClock, ScaledClock
from selfrl.simulate.families import Family, build_families
from selfrl.simulate.schedule import Phase, Schedule
from selfrl.simulate.summary import summarize
from selfrl.simulate.users import Plan, plan, reaction, verdict


class _Stop(Exception):
    """A bound is reached (``reason``: max_requests or max_seconds)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Simulator:
    """Simulated users against one server (see the module docstring).

    Args:
        cfg: :class:`SimulateConfig` (validated here).
        client: the HTTP side (:class:`selfrl.simulate.client.Client`, or a stand-in with ``chat``
            and ``feedback``).
        clock: the simulated clock, called for the time and told ``wait_until(t)``; default a
            :class:`ScaledClock` of ``day_s`` when ``day_s > 0``, else a :class:`FakeClock` from now.
            A test passes the same fake clock to the server's ``Service``.
        families: ``{name: Family}`` to use instead of building each from ``cfg.families``.
        log: where the JSONL event log goes (None: kept in memory only, ``events``).
        monotonic: the real clock of ``max_seconds`` (injectable for tests).

    Raises:
        selfrl.config.ConfigError: a value out of range.
        ValueError: a family cannot be built (:func:`selfrl.simulate.families.build_families`).
    """

    def __init__(self, cfg: SimulateConfig, client, clock=None, families: dict[str, Family] | None = None,
                 log: Path | None = None, monotonic: Callable[[], float] = time.monotonic):
        self.cfg = cfg.validate()
        self.client = client
        self.clock = clock if clock is not None else (ScaledClock(cfg.day_s) if cfg.day_s > 0 else FakeClock(time.time()))
        self.schedule = Schedule([Phase(p.duration_s, dict(p.weights)) for p in cfg.phases])
        self.families = families if families is not None else build_families(cfg)
        self.events: list[dict[str, Any]] = []
        self._log = None if log is None else open(log, "w")
        self._monotonic = monotonic
        self._queue: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.requests = 0
        self.sent_feedback: list[dict[str, Any]] = []  # bodies of feedback that was accepted (replay_feedback's pool)
        self._lock = threading.Condition()  # guards the queue, the counters and the log (concurrency > 1)
        self._in_flight = 0
        self._stopped: str | None = None  # a bound met in a pool thread: every thread stops at its next request
        self._failure: BaseException | None = None  # an error in a pool thread, raised again by run()

    # -- the plans --------------------------------------------------------------------------

    def plans(self):
        """Every conversation's :class:`Plan`, in order of arrival (a pure function of the config)."""
        rng = random.Random(f"selfrl-simulate:{self.cfg.seed}:arrivals")
        for k, at in enumerate(self.schedule.arrivals(self.cfg.arrivals_per_hour, rng)):
            yield plan(self.cfg, self.schedule, k, at)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run until the schedule ends and no reaction is queued, or a bound or Ctrl-C stops it;
        returns the summary (``selfrl.simulate.summary.summarize``) of everything logged.

        Raises:
            Exception: whatever a pool thread raised that is no bound (after the others finished).
        """
        self.t0, self.real0 = self.clock(), self._monotonic()
        plans = self.plans()
        self._push_arrival(plans)
        stopped, signum = "done", None
        pool = ThreadPoolExecutor(self.cfg.concurrency, "simulate") if self.cfg.concurrency > 1 else None
        try:
            while (nxt := self._next(pool)) is not None:
                kind, item = nxt
                if kind == "arrival":
                    self._push_arrival(plans)
                if pool is None:
                    self._handle(kind, item)
                else:
                    with self._lock:
                        self._in_flight += 1
                    pool.submit(self._work, kind, item)
        except _Stop as e:
            stopped = e.reason
        except KeyboardInterrupt as e:  # Ctrl-C; SIGTERM, SIGHUP under selfrl.run.shutdown.GracefulStop
            stopped, signum = "interrupted", getattr(e, "signum", signal.SIGINT)
        finally:
            if pool is not None:
                with self._lock:
                    if stopped != "done" and self._stopped is None:
                        self._stopped = stopped  # the threads in flight stop at their next request
                pool.shutdown(wait=True)
                self._drain()
        if self._failure is not None:
            raise self._failure
        stopped = "interrupted" if signum is not None else self._stopped or stopped
        name = None if signum is None else signal.Signals(signum).name
        pending = sum(1 for _, _, kind, _ in self._queue if kind != "arrival")
        self._emit({"event": "stop", "reason": stopped, "pending": pending, **({"signal": name} if name else {})})
        if self._log is not None:
            self._log.close()
        return summarize(self.events, self.cfg, stopped, pending, name)

    def _drain(self) -> None:
        """Wait until no event is in flight, at most ``timeout_s`` + 5 real seconds: Ctrl-C in the middle
        of handing an event to the pool can leave a thread the pool's shutdown does not wait for."""
        deadline = time.monotonic() + self.cfg.timeout_s + 5.0
        with self._lock:
            while self._in_flight > 0 and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(min(left, 0.1))

    def _next(self, pool) -> tuple[str, Any] | None:
        """The next event ``(kind, item)`` once it is due and a thread is free, or None when nothing
        is queued or in flight.

        Raises:
            _Stop: a bound is reached (here or in a pool thread).
        """
        wait = getattr(self.clock, "real_seconds_until", None)
        while True:
            with self._lock:
                if self._stopped is not None or self._failure is not None:
                    raise _Stop(self._stopped or "error")
                if not self._queue and not self._in_flight:
                    return None
                if not self._queue or (pool is not None and self._in_flight >= self.cfg.concurrency):
                    self._lock.wait(0.1)  # a thread finishes, or queues a reaction
                    continue
                due = self._queue[0][0]
                self._check_time(due)
                if pool is not None and wait is not None and wait(due) > 0:
                    self._lock.wait(min(wait(due), 0.1))  # an earlier reaction may be queued meanwhile
                    continue
                _, _, kind, item = heapq.heappop(self._queue)
            self.clock.wait_until(due)
            return kind, item

    def _handle(self, kind: str, item) -> None:
        if kind == "arrival":
            self.converse(item)
        else:
            self.react(kind, item)

    def _work(self, kind: str, item) -> None:
        """One event in a pool thread; a bound stops every thread, an error stops the run."""
        try:
            self._handle(kind, item)
        except _Stop as e:
            with self._lock:
                self._stopped = self._stopped or e.reason
        except BaseException as e:  # noqa: BLE001 - raised again by run() once the pool is done
            with self._lock:
                self._failure = self._failure or e
        finally:
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()

    def _push(self, due: float, kind: str, item) -> None:
        with self._lock:
            heapq.heappush(self._queue, (due, next(self._seq), kind, item))
            self._lock.notify_all()

    def _push_arrival(self, plans) -> None:
        p = next(plans, None)
        if p is not None:
            self._push(self.t0 + p.at_s, "arrival", p)

    def _check_time(self, due: float | None = None) -> None:
        left = self.cfg.max_seconds - (self._monotonic() - self.real0)
        wait = getattr(self.clock, "real_seconds_until", None)
        if left <= 0 or (due is not None and wait is not None and wait(due) > left):
            raise _Stop("max_seconds")

    def _emit(self, event: dict[str, Any]) -> None:
        with self._lock:
            event = {"t_sim": round(self.clock() - self.t0, 3), "t_real": round(self._monotonic() - self.real0, 3),
                     **event}
            self.events.append(event)
            if self._log is not None:
                self._log.write(json.dumps(event) + "\n")
                self._log.flush()

    def _request(self, route: str, purpose: str, p: Plan, body: dict[str, Any]) -> Reply:
        """One HTTP request within the bounds, logged."""
        with self._lock:
            if self._stopped is not None:
                raise _Stop(self._stopped)
            if self.requests >= self.cfg.max_requests:
                raise _Stop("max_requests")
            self._check_time()
            self.requests += 1
        reply = self.client.chat(p.user, body) if route == "chat" else self.client.feedback(body)
        event = {"event": "request", "route": route, "purpose": purpose, "conversation": p.index,
                 "family": p.family, "user": p.user, "phase": p.phase, "status": reply.status,
                 "latency_s": round(reply.latency_s, 4)}
        if route == "chat" and reply.ok:
            event["response_id"] = reply.body["id"]
            event["version"] = reply.body.get("adapter_version")  # the adapter version the server says served it
        elif route == "feedback":
            event.update({k: body[k] for k in ("response_id", "rating", "corrected") if k in body})
            if reply.ok and isinstance(reply.body, dict) and "outcome" in reply.body:
                event["outcome"] = reply.body["outcome"]  # used | queued | too_old (the age rule's answer)
        if reply.error is not None:
            event["error"] = reply.error
        self._emit(event)
        if route == "feedback" and reply.ok:
            with self._lock:
                self.sent_feedback.append(body)
        return reply

    # -- a conversation ---------------------------------------------------------------------

    def _body(self, p: Plan, fam: Family, messages, tools, task_id: str) -> dict[str, Any]:
        body = {"model": self.cfg.model, "messages": [dict(m) for m in messages], "max_tokens": fam.settings.max_tokens,
                "temperature": self.cfg.temperature, "metadata": {"family": p.family, "user": p.user},
                "task_key": f"{p.family}:{task_id}" if self.cfg.group_by == "task" else p.family}
        if tools:
            body["tools"] = tools
            body["tool_choice"] = fam.settings.tool_choice
        elif fam.settings.tool_choice == "required":
            raise ValueError(f"family {p.family!r}: tool_choice = \"required\" but its environment offers no tools; "
                             "use tool_choice = \"auto\"")
        return body

    def converse(self, p: Plan) -> None:
        """Run conversation ``p`` (see the module docstring)."""
        fam = self.families[p.family]
        ep = fam.open(fam.task(p.task_seed))
        messages = fam.first_messages(ep, f"call_demo{p.index}")
        last: tuple[Reply, dict[str, Any]] | None = None
        turns = 0
        try:
            for _ in range(fam.settings.max_turns):
                tools = fam.openai_tools(ep)  # again each turn: an environment may narrow them to its state
                body = self._body(p, fam, messages, tools, ep.task.id)
                reply = self._request("chat", "turn", p, body)
                turns += 1
                if not reply.ok:
                    break
                last = (reply, body)
                msg = reply.body["choices"][0]["message"]
                calls = msg.get("tool_calls") or []
                assistant: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
                if calls:
                    assistant["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                        "name": c["function"]["name"], "arguments": c["function"]["arguments"]}} for c in calls]
                elif assistant["content"] is None:
                    assistant["content"] = ""
                messages.append(assistant)
                if not calls:
                    break
                for c in calls:
                    messages.append({"role": "tool", "tool_call_id": c["id"],
                                     "content": ep.call(c["function"]["name"], c["function"]["arguments"])})
                if ep.done():
                    break
        finally:
            state, error = ep.close()
        if last is None or error is not None:  # nothing served, or the environment failed: nothing to judge
            self._emit({"event": "outcome", "conversation": p.index, "family": p.family, "user": p.user,
                        "phase": p.phase, "hostile": p.hostile, "served": False, "turns": turns,
                        **({"error": error} if error else {})})
            return
        reply, body = last
        final = reply.body["choices"][0]["message"].get("content") or ""
        correct = fam.correct(ep, final, state)
        response_id = reply.body["id"]
        self._emit({"event": "outcome", "conversation": p.index, "family": p.family, "user": p.user,
                    "phase": p.phase, "hostile": p.hostile, "served": True, "turns": turns, "correct": correct,
                    "response_id": response_id, "start_s": round(p.at_s, 3),
                    "version": reply.body.get("adapter_version")})
        due = self.clock() + p.delay_s
        if p.hostile:
            self._emit({"event": "hostile", "conversation": p.index, "family": p.family, "user": p.user,
                        "action": p.hostile_action, "delay_s": round(p.delay_s, 3)})
            self._push(due, "hostile", (p, response_id, body))
            return
        judged = verdict(correct, p)
        kind = reaction(judged, p, self.cfg.users.rating_p, self.cfg.users.correction_p)
        self._emit({"event": "judgement", "conversation": p.index, "family": p.family, "user": p.user,
                    "correct": correct, "judged_right": judged, "misjudged": p.misjudge, "reaction": kind,
                    "delay_s": round(p.delay_s, 3), "due_s": round(due - self.t0, 3)})
        if kind == "rating":
            self._push(due, "rating", (p, response_id, 1.0 if judged else -1.0))
        elif kind == "correction":
            cut = max(i for i, m in enumerate(messages) if m["role"] == "assistant") + 1
            self._push(due, "correction", (p, response_id, messages[:cut], ep.task, fam, tools))

    # -- reactions --------------------------------------------------------------------------

    def react(self, kind: str, item) -> None:
        """Send a queued reaction (a rating, a correction or a hostile action)."""
        if kind == "rating":
            p, response_id, rating = item
            self._request("feedback", "rating", p, {"response_id": response_id, "choice": 0, "rating": rating})
        elif kind == "correction":
            p, response_id, messages, task, fam, tools = item
            answer = task.answer
            follow = [*messages, {"role": "user", "content": f"No, that's wrong, the answer is {answer}."}]
            self._request("chat", "correction_turn", p, self._body(p, fam, follow, tools, task.id))
            calls = fam.right_calls(task, messages)  # a call's right answer is the calls, not their JSON as text
            fix = {"correction_tool_calls": [{"name": c["name"], "arguments": json.dumps(c["arguments"])}
                                             for c in calls]} if calls else {"correction": answer}
            self._request("feedback", "correction", p, {"response_id": response_id, "choice": 0, "corrected": True,
                                                        **fix})
        else:
            self.hostile(*item)

    def hostile(self, p: Plan, response_id: str, body: dict[str, Any]) -> None:
        """A hostile user's action on its conversation (``selfrl.simulate.users``)."""
        purpose = f"hostile:{p.hostile_action}"
        if p.hostile_action in ("random_rating", "flood"):
            for r in p.ratings:
                self._request("feedback", purpose, p, {"response_id": response_id, "choice": 0, "rating": r})
        elif p.hostile_action == "replay_turn":
            self._request("chat", purpose, p, body)
        else:  # replay_feedback
            with self._lock:
                pool = list(self.sent_feedback)
            again = pool[min(int(p.pick * len(pool)), len(pool) - 1)] if pool else \
                {"response_id": f"chatcmpl-never-served-{p.index}", "choice": 0, "rating": 1.0}
            self._request("feedback", purpose, p, dict(again))


def default_client(cfg: SimulateConfig, api_key: str) -> Client:
    """The HTTP client ``cfg`` describes."""
    return Client(cfg.base_url, api_key, cfg.seed, cfg.timeout_s, cfg.per_user_tokens)
