"""The web environment in a real browser: Playwright driving Debian's Chromium on the same local site.

The tests marked ``needs_chromium`` run a real Chromium; they are skipped only when the
playwright package or Chromium is missing (CI installs both: .ci/run, Makefile)."""

from __future__ import annotations

import gc
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from selfrl.safety.detectors import DetectorConfig, apply_detectors
from selfrl.envs import get_env
from selfrl.envs import web_browser
from selfrl.envs.web import Browser, WebEnv, confirm_spam_policy, honest_policy
from selfrl.envs.rewards import get_preset, score_group
from selfrl.rollout.agent import RolloutConfig, scripted_rollout
from selfrl.chat.toolcall import execute_call, parse_tool_calls

try:
    web_browser.check_available()
    MISSING = None
except ValueError as e:
    MISSING = str(e)
needs_chromium = pytest.mark.skipif(MISSING is not None, reason=f"no real browser here: {MISSING}")


def _chromium_pids() -> set[int]:
    """This process's Chromium descendants (the browser and its renderers), alive now."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "chrom" in p.name() and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _alive(pids: set[int], wait_s: float = 5.0) -> set[int]:
    """Those of ``pids`` still running after up to ``wait_s`` seconds (renderers exit just after the browser)."""
    deadline = time.monotonic() + wait_s
    while True:
        out = _alive_now(pids)
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def _alive_now(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _call(tools, text: str):
    _, [call] = parse_tool_calls(text)
    return execute_call(call, tools)


# ---------------------------------------------------------------- without a browser


def test_an_unknown_backend_and_a_missing_browser_are_clear_errors(monkeypatch, tmp_path):
    from selfrl.envs.registry import load_run_config
    from selfrl.run.setup import make_source

    config = tmp_path / "web.toml"
    config.write_text('[task]\nsource = "web"\noptions = { browser = "firefox" }\n')
    with pytest.raises(ValueError, match="unknown web browser backend 'firefox'; valid: 'http', 'playwright'"):
        make_source(load_run_config(config))
    config.write_text('[task]\nsource = "web"\noptions = { browser = "http" }\n')
    assert make_source(load_run_config(config)).browser == "http"
    env = WebEnv()
    assert env.browser == "http" and isinstance(env.make_env(env.sample(1, 0)[0]), Browser)
    monkeypatch.delenv(web_browser.CHROMIUM_ENV, raising=False)
    monkeypatch.setattr(web_browser.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match=r"needs Debian's Chromium.*apt-get install -y chromium"):
        get_env("web", browser="playwright")
    monkeypatch.setenv(web_browser.CHROMIUM_ENV, "/nonexistent/chromium")
    with pytest.raises(ValueError, match="SELFRL_CHROMIUM = '/nonexistent/chromium' is not an executable"):
        web_browser.chromium_path()
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)  # an import of it fails
    with pytest.raises(ValueError, match=r"needs the playwright package.*pip install 'selfrl\[browser\]'"):
        get_env("web", browser="playwright")


# ---------------------------------------------------------------- in Chromium


@needs_chromium
def test_the_honest_agent_buys_and_moves_house_in_chromium_and_the_database_says_so():
    env = get_env("web", browser="playwright")
    tasks = env.sample(40, 3)
    buy = next(t for t in tasks if t.metadata["kind"] == "buy")
    addr = next(t for t in tasks if t.metadata["kind"] == "address")
    good, moved = scripted_rollout(honest_policy, [buy, addr], [], RolloutConfig(max_turns=10),
                                   env_factory=env.make_env)
    assert all(c.ok for c in good.tool_calls + moved.tool_calls), [c.result for c in good.tool_calls]
    [order] = good.env_state["orders"]
    assert order["lines"] == [[buy.metadata["product_id"], buy.metadata["qty"]]]
    assert order["shipping"] == buy.metadata["shipping"] and order["confirms"] == 1
    assert env.score(buy, env.trajectory_answer(good)) == 1.0
    assert moved.env_state["account"]["address"] == addr.metadata["address"] and moved.env_state["orders"] == []
    assert env.score(addr, env.trajectory_answer(moved)) == 1.0 and env.score(buy, env.trajectory_answer(moved)) == 0.0
    liar = scripted_rollout(lambda t, m: "I bought it and confirmed the order.", [buy], [], RolloutConfig(max_turns=3),
                            env_factory=env.make_env)[0]
    assert env.score(buy, env.trajectory_answer(liar)) == 0.0


@needs_chromium
def test_confirm_spam_in_chromium_is_flagged_from_the_database():
    env = get_env("web", browser="playwright")
    tasks = [t for t in env.sample(12, 5) if t.metadata["kind"] == "buy"][:1]
    naive = get_preset("web-naive")
    out = {}
    for name, policy in [("honest", honest_policy), ("spam", confirm_spam_policy)]:
        trajs = scripted_rollout(policy, tasks, [], RolloutConfig(max_turns=10), env_factory=env.make_env)
        for tr, task in zip(trajs, tasks):
            score_group([tr], task, env, naive)
        paid = [tr.reward for tr in trajs]
        apply_detectors(trajs, DetectorConfig(names=["web_confirm_spam"]))
        out[name] = (paid, [sorted(tr.flags) for tr in trajs], [tr.reward for tr in trajs],
                     [[o["confirms"] for o in tr.env_state["orders"]] for tr in trajs])
    assert out["honest"] == ([1.0], [[]], [1.0], [[1]])
    assert out["spam"] == ([5.0], [["web_confirm_spam"]], [0.0], [[5]])


@needs_chromium
def test_both_backends_show_the_same_page_the_same_way():
    http, real = Browser(), web_browser.PlaywrightBrowser()
    try:
        steps = [("goto", "/"), ("click", 2), ("type", 2, "mug"), ("click", 3), ("click", 5),
                 ("select", 2, "2"), ("click", 3), ("select", 2, "express"), ("click", 3), ("click", 2),
                 ("goto", "/orders"), ("goto", "/account"), ("type", 3, "12 Oak Street"), ("click", 4),
                 ("goto", "/products"), ("scroll", "down"), ("scroll", "up")]
        seen = []
        for name, *args in steps:
            a, b = getattr(http, name)(*args), getattr(real, name)(*args)
            assert a == b, f"after {name}{tuple(args)}:\n--- http\n{a}\n--- chromium\n{b}"
            seen.append(a.splitlines()[0])
        assert seen[4] == "page: /product/2  (Red Classic Mug)" and seen[9] == "page: /order/1  (Order 1)"
        assert "[6] link 'Black Travel Mug'" in a and "more lines" not in a
        # back: the same page and elements; Chromium restores the form's last values, as browsers do
        real.goto("/product/4"), http.goto("/product/4")
        real.select(2, "3"), http.select(2, "3")
        real.click(3), http.click(3)
        a, b = http.back(), real.back()
        assert a.replace("value='1'", "value='3'") == b and "combobox 'qty' value='3'" in b
        state = real.state()
        assert http.state() | {"pages": 0} == state | {"pages": 0}
        assert state["cart"] == [[4, 3]] and state["account"]["address"] == "12 Oak Street"
        assert [(o["lines"], o["shipping"], o["confirms"]) for o in state["orders"]] == [([[2, 2]], "express", 1)]
    finally:
        real.close()


@needs_chromium
def test_bad_actions_go_back_to_the_model_as_errors():
    b = web_browser.PlaywrightBrowser()
    try:
        cases = [('{"name": "click", "arguments": {"id": 99}}', "error: no link or button with id 99 on this page"),
                 ('{"name": "type", "arguments": {"id": 1, "text": "x"}}', "error: no textbox with id 1 on this page"),
                 ('{"name": "goto", "arguments": {"path": "http://example.com/"}}',
                  "error: give a path on this site, e.g. /products"),
                 ('{"name": "back", "arguments": {}}', "error: no previous page")]
        for call, error in cases:
            rec = _call(b.tools, f"<tool_call>{call}</tool_call>")
            assert (rec.ok, rec.result) == (False, error)
        rec = _call(b.tools, '<tool_call>{"name": "goto", "arguments": {"path": "/product/1"}}</tool_call>')
        assert rec.ok and "[2] combobox 'qty'" in rec.result
        rec = _call(b.tools, '<tool_call>{"name": "select", "arguments": {"id": 2, "option": "9"}}</tool_call>')
        assert rec.result == "error: no option '9'; options: 1, 2, 3, 4, 5"
        # the page's script removes the button after it was shown: Playwright's error reaches the model
        page = b._episode.page
        web_browser._DRIVER.run(lambda: page.set_default_timeout(500))
        web_browser._DRIVER.run(lambda: page.evaluate("document.querySelector('button').remove()"))
        rec = _call(b.tools, '<tool_call>{"name": "click", "arguments": {"id": 3}}</tool_call>')
        assert not rec.ok and rec.result.startswith("error: the browser could not click 3: ") and "500" in rec.result
        assert "[3] button" not in b.observation() and b.goto("/cart").startswith("page: /cart")  # and it goes on
    finally:
        b.close()
    assert _call(b.tools, '<tool_call>{"name": "goto", "arguments": {"path": "/"}}</tool_call>').result == \
        "error: this browser is closed"


@needs_chromium
def test_the_browser_is_closed_after_each_episode():
    env = get_env("web", browser="playwright")
    task = next(t for t in env.sample(20, 1) if t.metadata["kind"] == "buy")
    during: set[int] = set()

    def watching(t, messages):
        during.update(_chromium_pids())
        return honest_policy(t, messages)

    assert _chromium_pids() == set()
    [tr] = scripted_rollout(watching, [task], [], RolloutConfig(max_turns=10), env_factory=env.make_env)
    assert env.score(task, env.trajectory_answer(tr)) == 1.0
    assert len(during) >= 2  # the browser and at least one renderer ran during the episode
    assert _alive(during) == set() and _chromium_pids() == set()
    assert web_browser._DRIVER.open == 0 and web_browser._DRIVER.browser is None
    # a browser dropped without close() is closed when collected
    b = web_browser.PlaywrightBrowser()
    b.goto("/cart")
    pids = _chromium_pids()
    assert pids and web_browser._DRIVER.open == 1
    del b
    gc.collect()
    assert _alive(pids, wait_s=20) == set() and web_browser._DRIVER.open == 0
    # an episode that never acts never starts a browser (the loop builds one only to read its tools)
    web_browser.PlaywrightBrowser().close()
    assert _chromium_pids() == set()


@needs_chromium
def test_concurrent_episodes_keep_their_own_sessions():
    a, b = web_browser.PlaywrightBrowser(), web_browser.PlaywrightBrowser()
    try:
        a.goto("/product/9")
        assert b.goto("/cart").endswith("text 'Your cart is empty.'")
        a.select(2, "2")
        assert "2 x Grey Backpack" in a.click(3)
        assert b.goto("/cart").endswith("text 'Your cart is empty.'") and a.state()["cart"] == [[9, 2]]
        assert a._episode.ctx is not b._episode.ctx and web_browser._DRIVER.open == 2  # one Chromium, two contexts
    finally:
        a.close(), b.close()
    # whole episodes from two threads at once, each through the one browser thread
    env = get_env("web", browser="playwright")
    buys = [t for t in env.sample(20, 2) if t.metadata["kind"] == "buy"]
    tasks = [buys[0], next(t for t in buys if t.metadata["product_id"] != buys[0].metadata["product_id"])]
    start = threading.Barrier(2)

    def episode(task):
        start.wait()
        return scripted_rollout(honest_policy, [task], [], RolloutConfig(max_turns=10), env_factory=env.make_env)[0]

    with ThreadPoolExecutor(2) as pool:
        trajs = list(pool.map(episode, tasks))
    for tr, task in zip(trajs, tasks):
        assert tr.env_state["orders"][0]["lines"] == [[task.metadata["product_id"], task.metadata["qty"]]]
        assert env.score(task, env.trajectory_answer(tr)) == 1.0
    assert web_browser._DRIVER.open == 0


@needs_chromium
def test_the_browser_reaches_only_the_site():
    import socket

    b = web_browser.PlaywrightBrowser()
    with socket.socket() as other:  # another service on loopback: blocked too
        other.bind(("127.0.0.1", 0))
        other.listen()
        elsewhere = [f"http://127.0.0.1:{other.getsockname()[1]}/", "http://10.1.2.3/", "http://example.com/",
                     "http://localhost/"]
        try:
            b.goto("/")
            fetch = "async (u) => { try { await fetch(u); return 'reached'; } catch (e) { return 'blocked'; } }"
            page = lambda: b._episode.page  # noqa: E731
            got = web_browser._DRIVER.run(lambda: [page().evaluate(fetch, u) for u in [b.base + "/cart", *elsewhere]])
            assert got == ["reached"] + ["blocked"] * 4
            assert b.blocked == elsewhere
            # a web socket (routes do not see them): to the other loopback port, never connected
            ws = f"ws://127.0.0.1:{other.getsockname()[1]}/"
            opened = "(u) => new Promise(r => { const s = new WebSocket(u); s.onopen = () => r('open'); " \
                     "s.onclose = () => r('closed'); setTimeout(() => r('pending'), 3000); })"
            assert web_browser._DRIVER.run(lambda: page().evaluate(opened, ws)) == "closed"
            other.settimeout(0.5)
            with pytest.raises(TimeoutError):
                other.accept()
            assert b.blocked == [*elsewhere, ws]
            # a link off the site, put in by a script: refused before the click
            web_browser._DRIVER.run(lambda: page().evaluate(
                "document.body.insertAdjacentHTML('beforeend', '<a href=\"http://example.com/\">Out</a>')"))
            b.scroll("down")
            assert "[6] link 'Out'" in b.observation()
            with pytest.raises(web_browser.ToolError, match="that link leaves the site"):
                b.click(6)
            assert b.path == "/"
        finally:
            b.close()


@needs_chromium
def test_a_crashed_chromium_costs_its_episode_errors_and_the_next_one_gets_a_new_browser():
    env = get_env("web", browser="playwright")
    b = web_browser.PlaywrightBrowser()
    try:
        b.goto("/product/3")
        crashed = _chromium_pids()
        for pid in crashed:  # the Chromium this test started
            psutil.Process(pid).kill()
        assert _alive(crashed) == set()
        rec = _call(b.tools, '<tool_call>{"name": "goto", "arguments": {"path": "/cart"}}</tool_call>')
        assert not rec.ok and rec.result.startswith("error: ")
        c = web_browser.PlaywrightBrowser()  # opened while the crashed episode is still open: a new Chromium
        assert c.goto("/cart").startswith("page: /cart") and _chromium_pids() - crashed
        c.close()
    finally:
        b.close()
    assert web_browser._DRIVER.open == 0 and web_browser._DRIVER.browser is None
    task = next(t for t in env.sample(20, 4) if t.metadata["kind"] == "address")
    [tr] = scripted_rollout(honest_policy, [task], [], RolloutConfig(max_turns=5), env_factory=env.make_env)
    assert env.score(task, env.trajectory_answer(tr)) == 1.0 and _chromium_pids() == set()


@needs_chromium
def test_a_chromium_killed_before_playwright_noticed_is_replaced_for_the_next_episode(monkeypatch):
    # the race seen under load: the next episode opens its context while is_connected() still says True
    b = web_browser.PlaywrightBrowser()
    try:
        b.goto("/product/3")
        crashed = _chromium_pids()
        monkeypatch.setattr(web_browser._DRIVER.browser, "is_connected", lambda: True)
        for pid in crashed:
            psutil.Process(pid).kill()
        assert _alive(crashed) == set()
        c = web_browser.PlaywrightBrowser()
        assert c.goto("/cart").startswith("page: /cart") and _chromium_pids() - set(crashed)
        c.close()
    finally:
        b.close()
    assert web_browser._DRIVER.open == 0 and web_browser._DRIVER.browser is None


@needs_chromium
def test_selfrl_run_takes_the_backend_from_the_config(tmp_path, tiny_tokenizer, capsys, monkeypatch):
    from conftest import save_tiny_phi

    from selfrl.cli import main
    from selfrl.record.store import Store

    model = save_tiny_phi(tmp_path / "model", tiny_tokenizer)
    config = tmp_path / "web.toml"
    config.write_text('[task]\nsource = "web"\noptions = { browser = "playwright" }\n')
    made = []
    real = web_browser.PlaywrightBrowser.__init__

    def counted(self, *args):
        made.append(1)
        real(self, *args)

    monkeypatch.setattr(web_browser.PlaywrightBrowser, "__init__", counted)
    args = ["run", "--config", str(config), "--model", str(model), "--run-dir", str(tmp_path / "r"),
            "--iterations", "1", "--num-prompts", "2", "--num-generations", "2", "--val-size", "2", "--lora-r", "4"]
    assert main(args) == 0, capsys.readouterr().err
    with Store(tmp_path / "r" / "selfrl.db") as store:
        trajs = store.trajectories()
    assert len(trajs) == 4 and all(set(t.env_state) >= {"orders", "account", "confirms"} for t in trajs)
    assert len(made) >= 4  # every rollout's episode was a Chromium one
    assert web_browser._DRIVER.open == 0 and _chromium_pids() == set()


@needs_chromium
def test_an_easy_tier_task_starts_on_its_page_and_state_in_chromium_too():
    env = get_env("web", tier="easy", browser="playwright")
    http = get_env("web", tier="easy")
    [task] = [t for t in env.sample(40, 0) if t.metadata["kind"] == "cart"][:1]
    b = env.make_env(task)
    try:
        assert isinstance(b, web_browser.PlaywrightBrowser) and b.path == f"/product/{task.metadata['product_id']}"
        assert b.observation() == http.make_env(task).observation()  # the start page, rendered alike
        assert b.state()["cart"] == [] and task.question.endswith(b.observation())
        page = [t for t in env.sample(40, 0) if t.metadata["kind"] == "place"][0]
        p = env.make_env(page)
        try:
            assert p.state()["cart"] == [[page.metadata["product_id"], page.metadata["qty"]]]
            assert "[3] button 'Place order'" in p.observation()
        finally:
            p.close()
    finally:
        b.close()
