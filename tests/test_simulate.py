"""The user simulator (selfrl.simulate) without a model: its schedule, noise, delays, hostile
users, determinism and bounds, against a scripted stand-in for the server."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import time

import pytest

from selfrl.config import ConfigError
from selfrl.config.simulate import FamilySettings, PhaseSettings, SimulateConfig, load_simulate_config
from selfrl.simulate import FakeClock, ScaledClock, Simulator
from selfrl.simulate.client import Reply
from selfrl.simulate.families import Family, held_out_ids
from selfrl.simulate.schedule import Phase, Schedule
from selfrl.simulate.summary import delay_bucket
from selfrl.simulate.users import is_hostile, plan, reaction, verdict


def within_binomial(k: int, n: int, p: float, z: float = 4.0) -> bool:
    """``k`` successes of ``n`` draws are within ``z`` standard deviations of ``n * p``."""
    return abs(k - n * p) <= z * math.sqrt(n * p * (1 - p)) + 1


class ScriptedServer:
    """A stand-in for ``selfrl serve``: answers arithmetic with a calculator call, then the tool's
    result (right unless ``wrong``), anything else with plain text; feedback is 200 for a served
    response and a rating in [-1, 1], 400 out of range, 404 for an unknown id. Records the clock's
    time of every request."""

    def __init__(self, clock=None, wrong: bool = False):
        self.clock, self.wrong = clock, wrong
        self.ids = itertools.count()
        self.served: set[str] = set()
        self.calls: list[tuple[str, float, dict]] = []

    def chat(self, user, body):
        self.calls.append(("chat", self.clock() if self.clock else 0.0, body))
        rid = f"chatcmpl-{next(self.ids)}"
        self.served.add(rid)
        msgs = body["messages"]
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        tool = next((m for m in msgs[last_user + 1:] if m["role"] == "tool"), None)
        names = [t["function"]["name"] for t in body.get("tools", [])]
        message = {"role": "assistant", "content": "I cannot tell."}
        if tool is not None:
            value = int(tool["content"]) + (1 if self.wrong else 0)
            message = {"role": "assistant", "content": f"<answer>{value}</answer>"}
        elif "calculator" in names and "problem:" in msgs[last_user]["content"]:
            expr = msgs[last_user]["content"].split("problem:")[1].split("=")[0].strip()
            message = {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{rid}", "type": "function",
                       "function": {"name": "calculator", "arguments": json.dumps({"expression": expr})}}]}
        return Reply(200, 0.01, {"id": rid, "choices": [{"index": 0, "message": message}]})

    def feedback(self, body):
        self.calls.append(("feedback", self.clock() if self.clock else 0.0, body))
        if body["response_id"] not in self.served:
            return Reply(404, 0.001, {"error": {"message": "no such response"}}, "404")
        r = body.get("rating")
        if r is not None and not -1 <= r <= 1:
            return Reply(400, 0.001, {"error": {"message": "rating out of range"}}, "400")
        return Reply(200, 0.001, {"object": "feedback"})


def arithmetic_config(**top) -> SimulateConfig:
    cfg = SimulateConfig(families=[FamilySettings("arithmetic", "chain_sum", users=50)],
                         phases=[PhaseSettings(86400.0, {"arithmetic": 1.0})], arrivals_per_hour=4.0,
                         max_requests=10_000)
    for k, v in top.items():
        setattr(cfg, k, v)
    return cfg.validate()


@pytest.fixture(scope="module")
def arithmetic():
    return Family(FamilySettings("arithmetic", "chain_sum"))


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


# ------------------------------------------------------------------ tasks, tools and the config


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


def test_environments_that_run_model_code_are_refused():
    with pytest.raises(ValueError, match="model-written code"):
        Family(FamilySettings("code", "code"))


@pytest.mark.parametrize("key,value,message", [
    ("users.noise", 1.5, "users.noise must be in"),
    ("users.rating_p", 0.8, "rating_p \\+ correction_p must be <= 1"),
    ("users.max_delay_s", 1.0, r"users.min_delay_s \(5\) must be at most users.max_delay_s \(1\): lower the first"),
    ("users.min_delay_s", 4e5, r"^users.min_delay_s \(400000\) must be at most users.max_delay_s \(259200\)"),
    ("users.max_delay_s", 0.0, r"^users.max_delay_s must be > 0"),
    ("users.hostile_actions", ["bite"], "users.hostile_actions must be a non-empty list"),
    ("max_requests", 0, "max_requests must be >= 1"),
    ("base_url", "localhost:8000", "base_url must start with http"),
    ("concurrency", 0, "concurrency must be >= 1"),
    ("group_by", "user", "group_by must be one of task, family"),
    ("families", [{"name": "a", "tool_choice": "always"}],
     r"families\[0\]\.tool_choice must be one of auto, required, none, got 'always'"),
])
def test_bad_settings_are_refused_with_their_name(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_simulate_config(None, {key: value})


def test_a_phase_naming_an_unknown_family_is_refused(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('[[families]]\nname = "a"\n[[phases]]\nduration_s = 10.0\nweights = { b = 1.0 }\n')
    with pytest.raises(ConfigError, match=r"phases\[0\]\.weights name families that are not in \[\[families\]\]"):
        load_simulate_config(p)


def test_the_shipped_config_is_the_default():
    from pathlib import Path

    assert load_simulate_config(Path(__file__).parents[1] / "configs" / "simulate.toml") == SimulateConfig().validate()


def test_the_shipped_serve_families_config_holds_out_only_tasks_the_simulated_users_never_ask():
    # configs/serve_families.toml beside configs/simulate.toml (docs/guides/simulate.md): the server's
    # held-out sets, built as its gate builds them, are tasks the simulator redraws, so no user asks one
    import dataclasses
    from pathlib import Path

    from selfrl.serve.families import FamilyGate
    from selfrl.serve.main import load_serve_config

    configs = Path(__file__).parents[1] / "configs"
    serve = load_serve_config(str(configs / "serve_families.toml"), {})
    sim_cfg = load_simulate_config(configs / "simulate.toml")
    assert [(f.name, f.source, f.options, f.val_size, f.val_seed, f.tolerance) for f in serve.families] == [
        ("arithmetic", "chain_sum", {}, 64, 2000, 0.05),
        ("function_calling", "function_calling", {"categories": ["simple"]}, 96, 2000, 0.05),
        ("web", "web", {"tier": "easy"}, 24, 2000, 0.05)]
    assert [(f.name, f.env, f.options, f.heldout_size, f.heldout_seed) for f in sim_cfg.families] == [
        (f.name, f.source, f.options, f.val_size, f.val_seed) for f in serve.families]
    held: dict[str, set[str]] = {}
    for t in FamilyGate(serve, store=None, ledger=None).val:  # ids "<family>/<task id>"
        family, _, task_id = t.id.partition("/")
        held.setdefault(family, set()).add(task_id)
    assert {f: len(ids) for f, ids in held.items()} == {"arithmetic": 64, "function_calling": 96, "web": 24}
    # the simulator's users at 30 times the shipped arrival rate: 1,693 conversations of the shipped schedule
    sim = Simulator(dataclasses.replace(sim_cfg, arrivals_per_hour=600.0), client=None)
    assert all(held[name] <= fam.held_out for name, fam in sim.families.items())  # each is redrawn
    asked: dict[str, set[str]] = {}
    redrawn = dict.fromkeys(held, 0)  # draws the held-out set turned away, per family
    for p in sim.plans():
        fam = sim.families[p.family]
        asked.setdefault(p.family, set()).add(fam.task(p.task_seed).id)
        [first] = fam.env.sample(1, p.task_seed)
        redrawn[p.family] += first.id in held[p.family]
    assert {f: len(ids) for f, ids in asked.items()} == {"arithmetic": 834, "function_calling": 207, "web": 160}
    assert all(not asked[f] & held[f] for f in held)
    assert redrawn == {"arithmetic": 11, "function_calling": 114, "web": 27}  # each would have been a held-out task


def test_users_send_one_key_per_family_by_default():
    # "task" keys rarely repeat (each conversation draws its own task), so the learner would find
    # no groups (docs/guides/simulate.md#groups-for-the-learner)
    assert SimulateConfig().group_by == "family"


def test_a_refused_or_short_api_key_is_named_by_where_it_was_read(tmp_path, monkeypatch, capsys):
    """selfrl simulate says whether the key came from --api-key-file (which file) or SELFRL_API_KEY."""
    import http.server
    import threading

    from selfrl.cli import main

    class Refuses(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    key_file = tmp_path / "key"
    key_file.write_text("0123456789abcdef-file\n")
    monkeypatch.setenv("SELFRL_API_KEY", "0123456789abcdef-env")
    try:
        for extra, source in (([], "the environment variable SELFRL_API_KEY"),
                              (["--api-key-file", str(key_file)], f"the API key file {key_file}")):
            assert main(["simulate", "--base-url", url, "--out", str(tmp_path / "sim"), *extra]) == 2
            err = capsys.readouterr().err.strip()
            assert err == (f"selfrl: error: {url} refuses the API key read from {source} (401): give the key "
                           "selfrl serve was started with (--api-key-file, else SELFRL_API_KEY)")
        key_file.write_text("")
        assert main(["simulate", "--base-url", url, "--api-key-file", str(key_file)]) == 2
        assert capsys.readouterr().err.strip() == f"selfrl: error: the API key file {key_file} is empty"
    finally:
        server.shutdown()


# ------------------------------------------------------------------ refused at start, stopped cleanly


class _Plain:
    """An environment whose conversations offer no tools (no shared ones, no state): a text answer."""

    @staticmethod
    def make():
        from selfrl.core.tasks import Task
        from selfrl.envs import Env

        class Plain(Env):
            name = "plain"
            description = "say a number"
            config_defaults = {"rollout.tools": []}

            def sample(self, n, seed):
                return [Task.make(self.name, f"say {(seed + i) % 100_000}", str((seed + i) % 100_000)) for i in range(n)]

            def score(self, task, answer):
                return float(answer == task.answer)

        return Plain


@pytest.fixture
def plain_env(monkeypatch):
    """``plain_envs:Plain``, importable by its dotted name."""
    import sys
    import types

    mod = types.ModuleType("plain_envs")
    mod.Plain = _Plain.make()
    monkeypatch.setitem(sys.modules, "plain_envs", mod)
    return "plain_envs:Plain"


@pytest.fixture
def counting_server():
    """A local HTTP server that answers 200 to everything and counts the requests it got."""
    import http.server
    import threading

    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", hits
    server.shutdown()


def simulate_cli(tmp_path, family: str, url: str) -> int:
    from selfrl.cli import main

    toml = tmp_path / "sim.toml"
    toml.write_text(f'[[families]]\nname = "a"\n{family}\n[[phases]]\nduration_s = 3600.0\nweights = {{ a = 1.0 }}\n')
    return main(["simulate", "--config", str(toml), "--base-url", url, "--out", str(tmp_path / "out")])


def test_required_tool_choice_with_an_environment_without_tools_is_refused_before_the_server_is_contacted(
        plain_env, counting_server, tmp_path, monkeypatch, capsys):
    url, hits = counting_server
    monkeypatch.setenv("SELFRL_API_KEY", "0123456789abcdef-env")
    message = ('tool_choice: "required" asks every completion for a tool call, but environment '
               f"'{plain_env}' offers no tools; set tool_choice = \"auto\" (or \"none\") for this family")
    with pytest.raises(ValueError) as err:
        Family(FamilySettings("a", plain_env, tool_choice="required"))
    assert str(err.value) == message
    assert simulate_cli(tmp_path, f'env = "{plain_env}"\ntool_choice = "required"', url) == 2
    assert capsys.readouterr().err.strip() == f"selfrl: error: families[0] (a).{message}"
    assert hits == [] and not (tmp_path / "out").exists()
    assert Family(FamilySettings("a", plain_env, tool_choice="auto")).offers_tools() is False  # "auto": allowed
    assert Family(FamilySettings("w", "web", {"tier": "easy"}, tool_choice="required")).offers_tools()  # its state's


def test_an_unknown_environment_is_refused_with_the_valid_names_before_the_server_is_contacted(
        counting_server, tmp_path, monkeypatch, capsys):
    from selfrl.envs.registry import available_envs

    url, hits = counting_server
    monkeypatch.setenv("SELFRL_API_KEY", "0123456789abcdef-env")
    assert simulate_cli(tmp_path, 'env = "chess"', url) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"selfrl: error: families[0] (a).env: unknown environment 'chess'; valid names: "
                          f"{', '.join(available_envs())}, ")
    assert hits == [] and len(err.splitlines()) == 1


def test_a_held_out_set_larger_than_the_environment_is_refused_at_once():
    import time

    t = time.monotonic()
    with pytest.raises(ValueError) as err:
        Family(FamilySettings("w", "web", {"tier": "easy"}, heldout_size=100_000))
    assert time.monotonic() - t < 30
    assert str(err.value) == ("heldout_size: source 'web' gave only 967 distinct tasks of the 100000 asked for "
                              "(sampled until no new one came); lower heldout_size, and the server's val_size for "
                              "this family with it")


def test_a_server_that_does_not_answer_is_the_machine_s_fault_with_its_url(tmp_path, monkeypatch, capsys):
    import http.server
    import socket
    import threading

    from selfrl.cli import main

    monkeypatch.setenv("SELFRL_API_KEY", "0123456789abcdef-env")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["simulate", "--base-url", url, "--out", str(tmp_path / "sim")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"selfrl: error: cannot reach {url}/admin/status (ConnectError: ")
    assert err.endswith("): start selfrl serve first, or pass --base-url with the address it serves on")

    class Fails(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"overloaded")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Fails)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert main(["simulate", "--base-url", url, "--out", str(tmp_path / "sim")]) == 1
    finally:
        server.shutdown()
    assert capsys.readouterr().err.strip() == (f"selfrl: error: {url}/admin/status answered 503 (overloaded): is "
                                               "selfrl serve running there? check --base-url")


class Interrupting(ScriptedServer):
    """Answers as :class:`ScriptedServer`; its ``at``-th completion sends ``signum`` to this process
    (SIGINT: as Ctrl-C does), whose handler raises in the main thread."""

    def __init__(self, clock, at: int, signum: int = 2):
        super().__init__(clock)
        self.at, self.signum, self.chats, self._n = at, signum, 0, itertools.count(1)

    def chat(self, user, body):
        import os

        self.chats = n = next(self._n)  # next() is atomic: pool threads count once each
        if n == self.at:
            os.kill(os.getpid(), self.signum)
            time.sleep(1)  # in the main thread, the handler raises in this sleep; a pool thread sleeps it out
        return super().chat(user, body)


@pytest.fixture
def default_sigint():
    """Ctrl-C raises KeyboardInterrupt, as in a fresh process: a library an earlier test started in
    this process (Ray's driver) may have put its own SIGINT handler in place."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("concurrency", [1, 3])
def test_ctrl_c_stops_the_loop_and_the_summary_says_so(arithmetic, concurrency, default_sigint):
    clock = FakeClock(0.0)
    server = Interrupting(clock, at=6)
    sim = Simulator(arithmetic_config(concurrency=concurrency), server, clock=clock, families={"arithmetic": arithmetic})
    summary = sim.run()
    assert summary["stopped_by"] == "interrupted" and summary["signal"] == "SIGINT"
    assert summary["requests"]["total"] == len(server.calls)  # every request answered is in the summary
    if concurrency == 1:
        assert summary["requests"]["chat"] == 5  # the sixth completion was cut by the signal
    else:  # the sixth is answered, as are those of the threads in flight until the loop stopped them
        assert 6 <= summary["requests"]["chat"] == server.chats <= 40
    full = Simulator(arithmetic_config(concurrency=concurrency), ScriptedServer(c := FakeClock(0.0)), clock=c,
                     families={"arithmetic": arithmetic}).run()
    assert full["stopped_by"] == "done" and full["signal"] is None and full["requests"]["total"] > 150
    assert sim.events[-1]["event"] == "stop" and sim.events[-1]["reason"] == "interrupted"


@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_stops_selfrl_simulate_with_its_summary_written(arithmetic, tmp_path, monkeypatch, capsys,
                                                                 signame, code):
    import signal

    import selfrl.simulate.simulator as simulator
    from selfrl.cli import main

    server = Interrupting(None, at=4, signum=getattr(signal, signame))
    server.reachable = lambda source: None
    server.close = lambda: None
    monkeypatch.setattr(simulator, "default_client", lambda cfg, key: server)
    monkeypatch.setenv("SELFRL_API_KEY", "0123456789abcdef-env")
    out = tmp_path / "sim"
    toml = tmp_path / "sim.toml"
    toml.write_text('arrivals_per_hour = 40.0\n[[families]]\nname = "arithmetic"\nenv = "chain_sum"\nheldout_size = 8\n'
                    '[[phases]]\nduration_s = 86400.0\nweights = { arithmetic = 1.0 }\n')
    assert main(["simulate", "--config", str(toml), "--out", str(out)]) == code
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted" and summary["signal"] == signame
    assert summary["requests"]["total"] == len(server.calls) >= 3
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "stop" and events[-1]["signal"] == signame
    err = capsys.readouterr().err
    assert f"selfrl: stopped by {signame}; summary.json holds what was sent" in err
    assert signal.getsignal(signal.SIGTERM) is not None  # the handlers are put back
