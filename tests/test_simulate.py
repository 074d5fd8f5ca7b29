"""The user simulator (selfrl.simulate) without a model: its schedule, noise, delays, hostile
users, determinism and bounds, against a scripted stand-in for the server (``tests/simulated.py``).
Its settings, what it refuses at start and how it stops: ``tests/test_simulate_startup.py``."""

from __future__ import annotations

import itertools
import json
import math
import random
import re

import pytest
from simulated import ScriptedServer, arithmetic_config, arithmetic_family

from selfrl.config.simulate import FamilySettings, PhaseSettings, SimulateConfig
from selfrl.simulate import FakeClock, ScaledClock, Simulator
from selfrl.simulate.families import Family, held_out_ids
from selfrl.simulate.schedule import Phase, Schedule
from selfrl.simulate.summary import delay_bucket
from selfrl.simulate.users import is_hostile, plan, reaction, verdict


def within_binomial(k: int, n: int, p: float, z: float = 4.0) -> bool:
    """``k`` successes of ``n`` draws are within ``z`` standard deviations of ``n * p``."""
    return abs(k - n * p) <= z * math.sqrt(n * p * (1 - p)) + 1


@pytest.fixture(scope="module")
def arithmetic():
    return arithmetic_family()


# ------------------------------------------------------------------ the schedule


def test_phases_start_where_the_last_one_ends_and_their_mix_holds():
    s = Schedule([Phase(100.0, {"a": 1.0}), Phase(50.0, {"a": 0.2, "b": 0.8}), Phase(10.0, {"b": 1.0, "c": 0.0})])
    assert [s.phase_at(t) for t in (0.0, 99.999, 100.0, 149.999, 150.0, 159.999)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="outside"):
        s.phase_at(160.0)
    rng = random.Random(0)
    assert {s.family_at(50.0, rng) for _ in range(200)} == {"a"}
    draws = [s.family_at(120.0, rng) for _ in range(4000)]
    assert within_binomial(draws.count("b"), 4000, 0.8)
    assert {s.family_at(155.0, rng) for _ in range(500)} == {"b"}  # weight 0: never


def test_arrivals_are_a_poisson_process_inside_the_schedule():
    s = Schedule([Phase(3600.0 * 100, {"a": 1.0})])
    times = list(s.arrivals(30.0, random.Random(1)))
    assert times == sorted(times) and times[-1] < s.end_s
    assert abs(len(times) - 3000) <= 4 * math.sqrt(3000)  # Poisson: variance = mean


def test_the_plans_follow_the_phases():
    cfg = SimulateConfig(families=[FamilySettings("a", "chain_sum"), FamilySettings("b", "chain_sum")],
                         phases=[PhaseSettings(3600.0, {"a": 1.0}), PhaseSettings(3600.0, {"a": 0.25, "b": 0.75})],
                         arrivals_per_hour=2000.0).validate()
    plans = list(Simulator(cfg, ScriptedServer(), families={}).plans())
    first = [p for p in plans if p.at_s < 3600.0]
    second = [p for p in plans if p.at_s >= 3600.0]
    assert {p.family for p in first} == {"a"} and {p.phase for p in first} == {0} and {p.phase for p in second} == {1}
    assert within_binomial(sum(p.family == "b" for p in second), len(second), 0.75)


# ------------------------------------------------------------------ judging: noise, reactions, delays


def test_the_share_of_wrong_judgements_is_the_noise():
    cfg = arithmetic_config()
    cfg.users.noise = 0.1
    s = Schedule([Phase(86400.0, {"arithmetic": 1.0})])
    plans = [plan(cfg, s, k, 1.0) for k in range(5000)]
    wrong = [p for p in plans if verdict(True, p) is False]
    assert within_binomial(len(wrong), 5000, 0.1)
    assert all(verdict(False, p) is True for p in wrong)  # the same users misjudge a wrong answer


def test_reactions_come_at_their_probabilities():
    cfg = arithmetic_config()
    u = cfg.users
    s = Schedule([Phase(86400.0, {"arithmetic": 1.0})])
    plans = [plan(cfg, s, k, 1.0) for k in range(5000)]
    wrong = [reaction(False, p, u.rating_p, u.correction_p) for p in plans]
    right = [reaction(True, p, u.rating_p, u.correction_p) for p in plans]
    assert within_binomial(wrong.count("rating"), 5000, u.rating_p)
    assert within_binomial(wrong.count("correction"), 5000, u.correction_p)
    assert "correction" not in right and within_binomial(right.count("silence"), 5000, 1 - u.rating_p)


def test_delays_are_log_uniform_from_seconds_to_days():
    cfg = arithmetic_config()
    cfg.users.min_delay_s, cfg.users.max_delay_s = 1.0, 1e5
    s = Schedule([Phase(86400.0, {"arithmetic": 1.0})])
    delays = [plan(cfg, s, k, 1.0).delay_s for k in range(5000)]
    assert min(delays) >= 1.0 and max(delays) <= 1e5
    for decade in range(5):  # each factor of ten holds a fifth of them
        n = sum(10**decade <= d < 10 ** (decade + 1) for d in delays)
        assert within_binomial(n, 5000, 0.2), (decade, n)
    assert [delay_bucket(x) for x in (59.0, 60.0, 3599.0, 86399.0, 86400.0)] == \
        ["<1m", "1m-1h", "1m-1h", "1h-1d", ">=1d"]


def test_delayed_feedback_is_sent_when_the_simulated_time_comes(arithmetic):
    clock = FakeClock(5.0)
    cfg = arithmetic_config(arrivals_per_hour=2.0)
    cfg.users.noise, cfg.users.rating_p, cfg.users.correction_p, cfg.users.hostile_share = 0.0, 0.5, 0.5, 0.0
    cfg.users.min_delay_s, cfg.users.max_delay_s = 10.0, 4 * 86400.0
    server = ScriptedServer(clock, wrong=True)
    sim = Simulator(cfg, server, clock=clock, families={"arithmetic": arithmetic})
    summary = sim.run()
    assert summary["feedback"]["reactions"]["rating"] > 5 and summary["feedback"]["reactions"]["correction"] > 5
    assert summary["feedback"]["delays"][">=1d"] > 0 and summary["feedback"]["pending"] == 0
    sent = {b["response_id"]: (t, b) for k, t, b in server.calls if k == "feedback"}
    outcomes = {e["conversation"]: e for e in sim.events if e["event"] == "outcome"}
    judgements = [e for e in sim.events if e["event"] == "judgement"]
    assert len(sent) == len(judgements) == len(outcomes)  # no silence: rating_p + correction_p = 1, all wrong
    for j in judgements:
        rid = outcomes[j["conversation"]]["response_id"]
        t, body = sent[rid]  # the server saw it at the answer's time plus the delay, on the simulated clock
        assert t - 5.0 == pytest.approx(outcomes[j["conversation"]]["t_sim"] + j["delay_s"], abs=2e-3)
        assert t - 5.0 == pytest.approx(j["due_s"], abs=1e-3)
        assert body == ({"response_id": rid, "choice": 0, "rating": -1.0} if j["reaction"] == "rating" else
                        {"response_id": rid, "choice": 0, "corrected": True, "correction": body["correction"]})
    assert clock() - 5.0 > 86400.0  # days went by on the simulated clock, none in real time


def test_a_correction_continues_the_conversation_and_says_the_answer(arithmetic):
    clock = FakeClock(0.0)
    cfg = arithmetic_config(arrivals_per_hour=2.0)
    cfg.users.noise, cfg.users.rating_p, cfg.users.correction_p, cfg.users.hostile_share = 0.0, 0.0, 1.0, 0.0
    server = ScriptedServer(clock, wrong=True)
    summary = Simulator(cfg, server, clock=clock, families={"arithmetic": arithmetic}).run()
    follow = [b for k, _, b in server.calls if k == "chat" and b["messages"][-1]["role"] == "user"
              and b["messages"][-1]["content"].startswith("No, that's wrong")]
    posts = [b for k, _, b in server.calls if k == "feedback"]
    assert len(follow) == len(posts) == summary["feedback"]["reactions"]["correction"] > 0
    for body, post in zip(follow, posts):
        assert body["messages"][-2]["role"] == "assistant" and body["messages"][-2]["content"].startswith("<answer>")
        assert body["messages"][-1]["content"] == f"No, that's wrong, the answer is {post['correction']}."
        assert post["corrected"] is True and re.fullmatch(r"-?\d+", post["correction"])


# ------------------------------------------------------------------ hostile users


def test_hostile_users_come_at_their_share_and_their_acts_are_recorded(arithmetic):
    assert within_binomial(sum(is_hostile(3, f"u-{i}", 0.3) for i in range(4000)), 4000, 0.3)
    clock = FakeClock(0.0)
    cfg = arithmetic_config(arrivals_per_hour=20.0, seed=3)
    cfg.users.hostile_share, cfg.users.flood_size = 0.3, 5
    server = ScriptedServer(clock)
    sim = Simulator(cfg, server, clock=clock, families={"arithmetic": arithmetic})
    summary = sim.run()
    outcomes = [e for e in sim.events if e["event"] == "outcome"]
    assert all(e["hostile"] == is_hostile(3, e["user"], 0.3) for e in outcomes)  # a hostile user stays hostile
    population = sum(is_hostile(3, f"arithmetic-{i}", 0.3) for i in range(50)) / 50  # the 50 users drawn
    assert within_binomial(sum(e["hostile"] for e in outcomes), len(outcomes), population)
    acts = summary["hostile"]["actions"]
    assert set(acts) == {"random_rating", "flood", "replay_turn", "replay_feedback"}
    status = summary["hostile"]["status"]
    assert sum(status["flood"].values()) == 5 * acts["flood"]
    assert set(status["replay_turn"]) == {"200"} and sum(status["replay_turn"].values()) == acts["replay_turn"]
    assert status["random_rating"].get("400", 0) > 0  # out-of-range ratings were refused
    assert summary["http"]["server_errors"] == 0
    replayed = [b for k, _, b in server.calls if k == "chat"]
    assert len(replayed) != len({json.dumps(b, sort_keys=True) for b in replayed})  # a turn sent twice


# ------------------------------------------------------------------ determinism and bounds


def _comparable(events):
    return [{k: v for k, v in e.items() if k not in ("t_real", "latency_s")} for e in events]


def test_the_same_seed_gives_the_same_traffic(arithmetic):
    def run(seed):
        clock = FakeClock(0.0)
        cfg = arithmetic_config(seed=seed, arrivals_per_hour=10.0)
        cfg.users.hostile_share = 0.2
        sim = Simulator(cfg, ScriptedServer(clock), clock=clock, families={"arithmetic": arithmetic})
        return sim.run(), sim.events, [p for p in itertools.islice(sim.plans(), 50)]

    a, b, c = run(7), run(7), run(8)
    assert _comparable(a[1]) == _comparable(b[1]) and a[2] == b[2]
    assert {k: v for k, v in a[0].items() if k not in ("real_seconds", "latency_s")} == \
        {k: v for k, v in b[0].items() if k not in ("real_seconds", "latency_s")}
    assert a[2] != c[2] and _comparable(a[1]) != _comparable(c[1])


def test_requests_stop_at_max_requests(arithmetic):
    clock = FakeClock(0.0)
    server = ScriptedServer(clock)
    summary = Simulator(arithmetic_config(max_requests=7), server, clock=clock, families={"arithmetic": arithmetic}).run()
    assert len(server.calls) == summary["requests"]["total"] == 7 and summary["stopped_by"] == "max_requests"


class SlowServer(ScriptedServer):
    """:class:`ScriptedServer` whose completions take ``seconds`` of real time; counts how many
    requests it holds at once (``most``)."""

    def __init__(self, clock=None, seconds: float = 0.03):
        super().__init__(clock)
        self.seconds, self.now, self.most = seconds, 0, 0
        self.lock = __import__("threading").Lock()

    def chat(self, user, body):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            __import__("time").sleep(self.seconds)
            return super().chat(user, body)
        finally:
            with self.lock:
                self.now -= 1


def test_a_pool_of_users_talks_at_once_and_sends_the_same_conversations(arithmetic):
    def run(concurrency):
        clock = FakeClock(0.0)
        server = SlowServer(clock)
        cfg = arithmetic_config(concurrency=concurrency, arrivals_per_hour=40.0,
                                phases=[PhaseSettings(3600.0, {"arithmetic": 1.0})])
        sim = Simulator(cfg, server, clock=clock, families={"arithmetic": arithmetic})
        return sim.run(), sim.events, server

    (one, ev1, s1), (four, ev4, s4) = run(1), run(4)
    assert s1.most == 1 and s4.most == 4  # one at a time, then four at once
    assert one["stopped_by"] == four["stopped_by"] == "done"
    served = [sorted((e["conversation"], e["correct"]) for e in ev if e["event"] == "outcome") for ev in (ev1, ev4)]
    assert served[0] == served[1] and len(served[0]) > 20  # the same conversations, the same verdicts
    assert one["feedback"]["reactions"] == four["feedback"]["reactions"]
    assert one["requests"]["total"] == four["requests"]["total"] == len(s4.calls)


def test_a_pool_stops_at_max_requests_exactly(arithmetic):
    clock = FakeClock(0.0)
    server = SlowServer(clock)
    summary = Simulator(arithmetic_config(max_requests=9, concurrency=3, arrivals_per_hour=40.0), server, clock=clock,
                        families={"arithmetic": arithmetic}).run()
    assert len(server.calls) == summary["requests"]["total"] == 9 and summary["stopped_by"] == "max_requests"


def test_a_failure_in_a_pool_thread_is_raised_by_run(arithmetic):
    class Broken(SlowServer):
        def feedback(self, body):
            raise RuntimeError("the stand-in broke")

    clock = FakeClock(0.0)
    sim = Simulator(arithmetic_config(concurrency=2, arrivals_per_hour=40.0), Broken(clock), clock=clock,
                    families={"arithmetic": arithmetic})
    with pytest.raises(RuntimeError, match="the stand-in broke"):
        sim.run()


def test_group_by_sets_the_task_key_of_every_turn(arithmetic):
    keys = {}
    for group_by in ("task", "family"):
        clock = FakeClock(0.0)
        server = ScriptedServer(clock)
        Simulator(arithmetic_config(max_requests=30, group_by=group_by), server, clock=clock,
                  families={"arithmetic": arithmetic}).run()
        keys[group_by] = [body["task_key"] for route, _, body in server.calls if route == "chat"]
    assert len(set(keys["task"])) > 5 and all(k.startswith("arithmetic:") for k in keys["task"])
    assert set(keys["family"]) == {"arithmetic"} and len(keys["family"]) == len(keys["task"])


def test_each_family_sends_its_tool_choice_with_its_tools(arithmetic):
    clock = FakeClock(0.0)
    server = ScriptedServer(clock)
    required = Family(FamilySettings("arithmetic", "chain_sum", tool_choice="required"))
    Simulator(arithmetic_config(max_requests=20), server, clock=clock, families={"arithmetic": required}).run()
    bodies = [body for route, _, body in server.calls if route == "chat"]
    assert len(bodies) >= 10 and all(b["tool_choice"] == "required" and b["tools"] for b in bodies)
    server = ScriptedServer(clock := FakeClock(0.0))
    Simulator(arithmetic_config(max_requests=20), server, clock=clock, families={"arithmetic": arithmetic}).run()
    assert {body["tool_choice"] for route, _, body in server.calls if route == "chat"} == {"auto"}


def test_required_tool_choice_without_tools_is_refused_before_any_request(arithmetic):
    class NoTools(Family):
        def openai_tools(self, ep):
            return []

    fam = NoTools.__new__(NoTools)
    fam.__dict__.update(arithmetic.__dict__)
    fam.settings = FamilySettings("arithmetic", "chain_sum", tool_choice="required")
    server = ScriptedServer(clock := FakeClock(0.0))
    with pytest.raises(ValueError, match='tool_choice = "required" but its environment offers no tools'):
        Simulator(arithmetic_config(max_requests=5), server, clock=clock, families={"arithmetic": fam}).run()
    assert server.calls == []


def test_page_ids_offers_each_turn_only_the_ids_of_the_page_shown():
    web = Family(FamilySettings("web", "web", {"tier": "easy", "page_ids": True}))
    ep = web.open(web.task(123))
    first = {t["function"]["name"]: t["function"]["parameters"] for t in web.openai_tools(ep)}
    ep.call("goto", json.dumps({"path": "/cart"}))
    then = {t["function"]["name"]: t["function"]["parameters"] for t in web.openai_tools(ep)}
    assert first["goto"]["properties"]["path"]["enum"] and first["click"]["properties"]["id"]["enum"]
    assert then.get("click") != first["click"] and "back" in then and "back" not in first
    plain = Family(FamilySettings("web", "web", {"tier": "easy"}))
    ep = plain.open(plain.task(123))
    assert plain.openai_tools(ep) == [t.openai_schema() for t in ep.tools.values()]  # without page_ids: as they are
    assert "enum" not in json.dumps(plain.openai_tools(ep)[0]["function"]["parameters"]["properties"]["id"])


def test_time_stops_at_max_seconds(arithmetic):
    ticks = itertools.count()
    clock = FakeClock(0.0)
    server = ScriptedServer(clock)
    sim = Simulator(arithmetic_config(max_seconds=20.0), server, clock=clock, families={"arithmetic": arithmetic},
                    monotonic=lambda: float(next(ticks)))  # one real second per look at the clock
    summary = sim.run()
    assert summary["stopped_by"] == "max_seconds" and 0 < len(server.calls) < 20
    assert all(e["t_real"] <= 20.0 for e in sim.events if e["event"] == "request")


def test_a_scaled_clock_stops_before_a_wait_past_max_seconds(arithmetic):
    slept = []
    now = [0.0]

    def sleep(s):
        slept.append(s)
        now[0] += s

    clock = ScaledClock(day_s=86400.0, start=0.0, sleep=sleep, monotonic=lambda: now[0])  # real time
    cfg = arithmetic_config(max_seconds=4000.0, arrivals_per_hour=1.0)
    summary = Simulator(cfg, ScriptedServer(clock), clock=clock, families={"arithmetic": arithmetic},
                        monotonic=lambda: now[0]).run()
    assert summary["stopped_by"] == "max_seconds" and sum(slept) <= 4000.0


def test_a_scaled_clock_runs_days_in_seconds():
    now = [0.0]
    c = ScaledClock(day_s=10.0, start=0.0, sleep=lambda s: now.__setitem__(0, now[0] + s), monotonic=lambda: now[0])
    c.wait_until(86400.0 * 3)
    assert now[0] == pytest.approx(30.0) and c() == pytest.approx(86400.0 * 3)
    with pytest.raises(ValueError, match="day_s"):
        ScaledClock(day_s=0.0)


# ------------------------------------------------------------------ tasks and tools


def test_users_never_ask_a_held_out_task(arithmetic):
    held = held_out_ids(arithmetic.env, 64, 2000)
    assert len(held) >= 64 and held == arithmetic.held_out
    first = arithmetic.env.sample(1, 2000)[0]
    assert first.id in held and arithmetic.task(2000).id not in held  # seed 2000 gives a held-out task: drawn again
    assert all(arithmetic.task(random.Random(i).getrandbits(62)).id not in held for i in range(300))


def test_the_families_run_their_own_tools():
    web = Family(FamilySettings("web", "web", {"tier": "easy"}))
    ep = web.open(web.task(123))
    assert {"click", "goto", "stop"} <= set(ep.tools)
    assert "page:" in ep.call("goto", json.dumps({"path": "/cart"}))
    assert ep.call("click", '{"id": "x"}').startswith("error:")  # a bad call is an error message, not an exception
    state, error = ep.close()
    assert error is None and state["path"] == "/cart" and web.correct(ep, "", state) is False
    fc = Family(FamilySettings("fc", "function_calling", {"categories": ["simple"]}))
    ep = fc.open(fc.task(5))
    gt = json.loads(ep.task.answer)[0]
    (name, args), = gt.items()
    ep.call(name, json.dumps({k: v[0] for k, v in args.items() if v and v[0] != ""}))
    assert ep.done() and fc.correct(ep, "", ep.close()[0]) is True
    msgs = fc.first_messages(fc.open(fc.task(5)), "d")
    assert msgs[0]["role"] == "system" and msgs[-1]["role"] == "user"
    assert any(m.get("tool_calls") for m in msgs) and any(m["role"] == "tool" for m in msgs)


def test_a_failing_environment_is_logged_not_judged(arithmetic):
    class Broken:
        tools, demonstration = [], None

        def is_completed(self):
            return False

        def state(self):
            raise RuntimeError("site down")

    class BrokenFamily(Family):
        def open(self, task):
            ep = super().open(task)
            ep.state = Broken()
            return ep

    fam = BrokenFamily.__new__(BrokenFamily)
    fam.__dict__.update(arithmetic.__dict__)
    clock = FakeClock(0.0)
    sim = Simulator(arithmetic_config(max_requests=5), ScriptedServer(clock), clock=clock, families={"arithmetic": fam})
    sim.run()
    outcomes = [e for e in sim.events if e["event"] == "outcome"]
    assert outcomes and all(not e["served"] and "site down" in e["error"] for e in outcomes)
    assert not [e for e in sim.events if e["event"] == "judgement"]
