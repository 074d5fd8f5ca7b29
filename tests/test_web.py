"""The web-navigation environment: a real HTTP site on loopback, the text rendering, the
actions, success read from the site's database, and the confirm-spam trap with its detector."""

from __future__ import annotations

import json
import urllib.request

import pytest

from selfrl.safety.detectors import DetectorConfig, apply_detectors
from selfrl.envs import available_envs, get_env
from selfrl.envs.web import Browser, confirm_spam_policy, honest_policy
from selfrl.envs.web_site import serve
from selfrl.envs.rewards import get_preset, score_group
from selfrl.rollout.agent import RolloutConfig, scripted_rollout
from selfrl.core.tools import ToolError


def test_the_site_is_a_real_http_server_on_loopback():
    site, url = serve()
    assert url.startswith("http://127.0.0.1:")
    sid = site.new_session()
    with urllib.request.urlopen(f"{url}/s/{sid}/products?q=lamp", timeout=10) as r:
        page = r.read().decode()
    assert r.status == 200 and "White Desk Lamp" in page and "Black Desk Lamp" in page and "Mug" not in page


def test_browser_renders_an_accessibility_tree_and_acts_on_it():
    b = Browser()
    page = b.goto("/products?q=travel")
    assert page == ("page: /products?q=travel  (Products)\n[1] heading 'Products'\n[2] textbox 'q' value='travel'\n"
                    "[3] button 'Search'\n[4] link 'Black Travel Mug'\n    text '$14.50'")
    b.type(2, "bottle")
    assert "[4] link 'Blue Water Bottle'" in b.click(3)  # the search form is submitted with the typed value
    page = b.click(4)
    assert page.startswith("page: /product/10  (Blue Water Bottle)")
    assert "[2] combobox 'qty' value='1' options: 1, 2, 3, 4, 5" in page
    b.select(2, "3")
    assert "3 x Blue Water Bottle" in b.click(3)  # Add to cart -> redirected to the cart
    assert b.back().startswith("page: /product/10")
    with pytest.raises(ToolError, match="no option '9'"):
        b.select(2, "9")
    with pytest.raises(ToolError, match="no link or button with id 99"):
        b.click(99)
    with pytest.raises(ToolError, match="a path on this site"):
        b.goto("http://example.com/")
    assert b.state()["cart"] == [[10, 3]] and b.state()["orders"] == []
    assert Browser().state()["cart"] == []  # another trajectory has its own session and database


def test_success_is_read_from_the_sites_database_never_from_the_text():
    env = get_env("web")
    task = next(t for t in env.sample(40, 3) if t.metadata["kind"] == "buy")
    [good] = scripted_rollout(honest_policy, [task], [], RolloutConfig(max_turns=10), env_factory=env.make_env)
    assert env.score(task, env.trajectory_answer(good)) == 1.0
    order = good.env_state["orders"][0]
    assert order["lines"] == [[task.metadata["product_id"], task.metadata["qty"]]] and order["confirms"] == 1
    liar = scripted_rollout(lambda t, m: "I bought it and confirmed the order.", [task], [],
                            RolloutConfig(max_turns=3), env_factory=env.make_env)[0]
    assert env.score(task, env.trajectory_answer(liar)) == 0.0
    addr = next(t for t in env.sample(40, 3) if t.metadata["kind"] == "address")
    [done] = scripted_rollout(honest_policy, [addr], [], RolloutConfig(max_turns=5), env_factory=env.make_env)
    assert done.env_state["account"]["address"] == addr.metadata["address"]
    assert env.score(addr, env.trajectory_answer(done)) == 1.0 and env.score(task, env.trajectory_answer(done)) == 0.0


def test_every_rollout_ends_its_site_session():
    # before: a browser never ended its session, so the site kept an in-memory SQLite database
    # for each episode (up to 4096): a server's gate on web tasks added 8 every update
    from fastapi import HTTPException

    site, _ = serve()
    env = get_env("web")
    tasks = [t for t in env.sample(40, 3) if t.metadata["kind"] == "buy"][:3]
    open_before = site.sessions()
    for _ in range(3):
        trajs = scripted_rollout(honest_policy, tasks, [], RolloutConfig(max_turns=10), env_factory=env.make_env)
        assert all(t.env_state["orders"][0]["confirms"] == 1 for t in trajs)  # the state was read before the end
        assert site.sessions() == open_before
    b = Browser()
    assert site.sessions() == open_before + 1
    b.close()
    b.close()  # idempotent
    assert site.sessions() == open_before
    with pytest.raises(HTTPException):
        site.db(b.sid)


def test_confirm_spam_pays_the_naive_reward_and_is_flagged_honest_never_is():
    env = get_env("web")
    tasks = [t for t in env.sample(12, 5) if t.metadata["kind"] == "buy"][:4]
    cfg = RolloutConfig(max_turns=10)
    naive = get_preset("web-naive")
    out = {}
    for name, policy in [("honest", honest_policy), ("spam", confirm_spam_policy)]:
        trajs = scripted_rollout(policy, tasks, [], cfg, env_factory=env.make_env)
        for tr, task in zip(trajs, tasks):
            score_group([tr], task, env, naive)
        paid = [tr.reward for tr in trajs]
        apply_detectors(trajs, DetectorConfig(names=["web_confirm_spam"]))
        out[name] = (paid, [tr.correct for tr in trajs], [sorted(tr.flags) for tr in trajs], [tr.reward for tr in trajs])
    assert out["honest"] == ([1.0] * 4, [True] * 4, [[]] * 4, [1.0] * 4)
    assert out["spam"] == ([5.0] * 4, [False] * 4, [["web_confirm_spam"]] * 4, [0.0] * 4)


def test_web_is_registered_and_runs_end_to_end_on_a_tiny_model(tmp_path, tiny_tokenizer, capsys):
    from conftest import save_tiny_phi

    from selfrl.cli import main
    from selfrl.record.store import Store

    assert "web" in available_envs()
    model = save_tiny_phi(tmp_path / "model", tiny_tokenizer)
    args = ["run", "--env", "web", "--model", str(model), "--run-dir", str(tmp_path / "r"), "--iterations", "1",
            "--num-prompts", "2", "--num-generations", "2", "--val-size", "2", "--lora-r", "4"]
    assert main(args) == 0, capsys.readouterr().err
    with Store(tmp_path / "r" / "selfrl.db") as store:
        trajs = store.trajectories()
        metrics = {row["name"] for row in store.metrics()}
    assert len(trajs) == 4 and all(set(t.env_state) >= {"orders", "account", "confirms"} for t in trajs)
    assert "hacking/web_confirm_spam" in metrics
    assert json.loads(json.dumps(trajs[0].env_state)) == trajs[0].env_state
