"""The user simulator (selfrl.simulate) without a model, at its two ends: the settings and the
shipped configs, what ``selfrl simulate`` refuses before it sends a request (bad settings,
environments, API keys, a server that does not answer), and how Ctrl-C and SIGTERM stop it with
its summary written. The rest of the simulator is ``tests/test_simulate.py``."""

from __future__ import annotations

import itertools
import json
import time

import pytest
from simulated import ScriptedServer, arithmetic_config, arithmetic_family

from selfrl.config import ConfigError
from selfrl.config.simulate import FamilySettings, SimulateConfig, load_simulate_config
from selfrl.simulate import FakeClock, Simulator
from selfrl.simulate.families import Family


@pytest.fixture(scope="module")
def arithmetic():
    return arithmetic_family()


# ------------------------------------------------------------------ the config


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


def test_own_families_without_phases_are_told_to_add_phases(tmp_path):
    toml = tmp_path / "sim.toml"
    toml.write_text('[[families]]\nname = "sums"\nenv = "chain_sum"\n')
    with pytest.raises(ConfigError) as err:
        load_simulate_config(toml)
    assert str(err.value) == ("[[families]] is set but [[phases]] is not, and the default schedule's phases name the "
                              "families arithmetic, function_calling, web: add [[phases]] tables that weight your own "
                              "families (sums), e.g. [[phases]] duration_s = 3600, weights = { sums = 1.0 }")
    toml.write_text(toml.read_text() + '[[phases]]\nweights = { sums = 1.0 }\n')
    assert [f.name for f in load_simulate_config(toml).families] == ["sums"]


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


def answering(status_body: bytes, chat_status: int, chat_body: bytes):
    """A local HTTP server (not selfrl serve): GET answers 200 with ``status_body``, POST answers
    ``chat_status`` with ``chat_body``; returns ``(server, url)``."""
    import http.server
    import threading

    class Other(http.server.BaseHTTPRequestHandler):
        def reply(self, status, body):
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if body.startswith(b"{") else "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.reply(200, status_body)

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.reply(chat_status, chat_body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


SIM_TOML = ('day_s = 0.0\nmax_requests = 3\narrivals_per_hour = 60.0\n[users]\nhostile_share = 0.0\n'
            '[[families]]\nname = "arithmetic"\nenv = "chain_sum"\n'
            '[[phases]]\nduration_s = 86400.0\nweights = { arithmetic = 1.0 }\n')


def test_a_server_that_is_not_selfrl_serve_is_named_with_what_it_answered(tmp_path, monkeypatch, capsys):
    from selfrl.cli import main

    monkeypatch.setenv("SELFRL_API_KEY", "0123456789abcdef-env")
    server, url = answering(b"<html>hello</html>", 200, b"{}")
    try:
        assert main(["simulate", "--base-url", url, "--out", str(tmp_path / "sim")]) == 1
    finally:
        server.shutdown()
    assert capsys.readouterr().err == (f"selfrl: error: {url}/admin/status answered 200 with something that is not "
                                       "selfrl serve's JSON ('<html>hello</html>'): is selfrl serve running there? "
                                       "check --base-url\n")


@pytest.mark.parametrize("chat_status,chat_body,said", [
    (404, b'{"detail": "Not Found"}', "3 x 404"),
    (200, b"<html>not json</html>", "3 x no answer or not a completion"),
    (200, b'{"object": "something else"}', "3 x no answer or not a completion"),
])
def test_when_every_completion_fails_simulate_says_so_and_exits_1(chat_status, chat_body, said, tmp_path,
                                                                  monkeypatch, capsys):
    from selfrl.cli import main

    monkeypatch.setenv("SELFRL_API_KEY", "0123456789abcdef-env")
    toml = tmp_path / "sim.toml"
    toml.write_text(SIM_TOML)
    server, url = answering(b"{}", chat_status, chat_body)
    try:
        code = main(["simulate", "--config", str(toml), "--base-url", url, "--out", str(tmp_path / "sim")])
    finally:
        server.shutdown()
    out, err = capsys.readouterr()
    assert code == 1
    assert "failed completions 3 of 3" in out
    assert err == (f"selfrl: error: every completion failed ({said}): is selfrl serve running at {url}? each answer "
                   f"is in {tmp_path / 'sim' / 'events.jsonl'}\n")
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert (summary["http"]["failed_completions"], summary["http"]["completions_asked"]) == (3, 3)


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


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_a_base_url_given_as_openai_clients_take_it_is_the_server_s_root(suffix, tmp_path, monkeypatch, capsys):
    # old code: --base-url http://HOST:PORT/v1 asked for /v1/admin/status, a bare 404
    import http.server
    import threading

    from selfrl.cli import main

    assert load_simulate_config(None, {"base_url": "http://127.0.0.1:8000" + suffix}).base_url == "http://127.0.0.1:8000"
    paths = []

    class Recording(http.server.BaseHTTPRequestHandler):
        def reply(self):
            paths.append((self.command, self.path))
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(404 if self.path != "/admin/status" else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = reply

        def log_message(self, *args):
            pass

    monkeypatch.setenv("SELFRL_API_KEY", "0123456789abcdef-env")
    toml = tmp_path / "sim.toml"
    toml.write_text(SIM_TOML)
    server = http.server.HTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        main(["simulate", "--config", str(toml), "--base-url", f"http://127.0.0.1:{server.server_port}{suffix}",
              "--out", str(tmp_path / "sim")])
    finally:
        server.shutdown()
    assert paths[0] == ("GET", "/admin/status")
    assert {p for _, p in paths[1:]} == {"/v1/chat/completions"}
