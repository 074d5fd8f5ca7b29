"""`selfrl serve` settings, API keys, and a restart that continues the run directory."""

import re

import pytest
import torch
from openai import OpenAI

from selfrl.record.adapters import lora_state
from selfrl.config import ConfigError
from selfrl.record import served as records
from selfrl.engines.http import load_api_key
from selfrl.serve.main import load_serve_config
from serving import add_version, running_server, tiny_serve_config


def test_api_key_from_env_or_file(tmp_path, monkeypatch):
    monkeypatch.delenv("SELFRL_API_KEY", raising=False)
    assert load_api_key(None) is None
    monkeypatch.setenv("SELFRL_API_KEY", "  0123456789abcdefXYZ \n")
    assert load_api_key(None) == "0123456789abcdefXYZ"
    f = tmp_path / "key"
    f.write_text("fedcba9876543210fedcba\nsecond line ignored\n")
    assert load_api_key(str(f)) == "fedcba9876543210fedcba"  # the file wins over the environment
    f.write_text("short\n")
    with pytest.raises(ValueError) as err:
        load_api_key(str(f))
    assert str(err.value).startswith(f"the API key from the API key file {f} is 5 characters long; it must be at "
                                     "least 16 (make one with: ")
    monkeypatch.setenv("SELFRL_API_KEY", "tiny")
    with pytest.raises(ValueError, match="^the API key from the environment variable SELFRL_API_KEY is 4 characters"):
        load_api_key(None)
    with pytest.raises(ValueError, match="cannot read"):
        load_api_key(str(tmp_path / "missing"))


def test_serve_config_layers_and_errors(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text('port = 9000\n[learner]\nmin_batch = 16\n[train]\nlearning_rate = 5e-5\n')
    cfg = load_serve_config(str(toml), {"learner.feedback_wait_s": 30, "port": None})
    assert (cfg.port, cfg.learner.min_batch, cfg.train.learning_rate, cfg.learner.feedback_wait_s) == (9000, 16, 5e-5, 30.0)
    assert cfg.host == "127.0.0.1"  # loopback unless told otherwise
    with pytest.raises(ConfigError, match=re.escape("unknown key 'learner.min_btch' (did you mean 'min_batch'?); valid: ")):
        load_serve_config(None, {"learner.min_btch": 3})
    # a selfrl run key written at the top of a serve config: the error says which table takes it
    top = tmp_path / "ported.toml"
    top.write_text("reward_weights = { user_feedback = 1.0 }\n")
    with pytest.raises(ConfigError, match=re.escape("unknown key 'reward_weights'; it belongs in [learner] "
                                                    "(learner.reward_weights); valid: ")):
        load_serve_config(str(top), {})
    with pytest.raises(ConfigError, match="min_batch"):
        load_serve_config(None, {"learner.min_batch": 1})
    with pytest.raises(ConfigError, match="must be int"):
        load_serve_config(None, {"port": "eighty"})


def test_restart_serves_the_latest_promoted_version_and_keeps_pending_turns(tiny_tokenizer, tiny_model_factory, tmp_path):
    cfg = tiny_serve_config(tmp_path / "run")
    model = tiny_model_factory(lora=True, eos_bias=3.0)
    with running_server(model, tiny_tokenizer, cfg) as (url, service):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        first = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        state = {k: torch.randn_like(v) for k, v in lora_state(model).items()}
        add_version(service, state, 1, metrics={"val/success": 0.5})
    fresh = tiny_model_factory(lora=True, eos_bias=3.0)
    with running_server(fresh, tiny_tokenizer, cfg) as (url, service):
        assert service.engine.version == 1
        assert all(torch.equal(v, state[k]) for k, v in lora_state(service.engine.model).items())
        with service.store.lock:
            row = records.find_response(service.store, first.id)
        assert row["status"] == "pending"  # still waiting for its reward after the restart
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.model_extra["adapter_version"] == 1


def test_stop_strings_cut_the_content(tiny_tokenizer, tiny_model_factory, tmp_path):
    model = tiny_model_factory(lora=True, eos_bias=-5.0)  # never ends early: 12 tokens of text
    with running_server(model, tiny_tokenizer, tiny_serve_config(tmp_path / "run")) as (url, service):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="selfrl", messages=[{"role": "user", "content": "go"}], max_tokens=12, temperature=0)
        full = client.chat.completions.create(**kw).choices[0].message.content
        stop = full[3:5]
        resp = client.chat.completions.create(stop=[stop], **kw)
        cut = resp.choices[0]
        assert cut.message.content == full[:full.index(stop)] and cut.finish_reason == "stop"
        # decoding ended at the stop string: what is recorded (and trained on) is what was sent, no more
        with service.store.lock:
            row = records.find_response(service.store, resp.id)
            traj = next(t for t in service.store.trajectories() if t.id == row["trajectory_id"])
        assert traj.num_completion_tokens == resp.usage.completion_tokens < 12
        assert stop in tiny_tokenizer.decode(traj.token_ids[-traj.num_completion_tokens:])


def test_a_pin_outlives_a_restart_and_rolled_back_versions_are_not_served(tiny_tokenizer, tiny_model_factory, tmp_path):
    from serving import API_KEY, http

    cfg = tiny_serve_config(tmp_path / "run")
    with running_server(tiny_model_factory(lora=True), tiny_tokenizer, cfg) as (url, service):
        for v in (1, 2):
            add_version(service, {k: torch.randn_like(x) for k, x in lora_state(service.engine.model).items()}, v)
        service.publish(2, service.state_of(2), "test")
        assert http("POST", url + "/admin/pin", {"version": 1}, key=API_KEY)[1]["pinned"] == 1
    with running_server(tiny_model_factory(lora=True), tiny_tokenizer, cfg) as (url, service):
        assert service.engine.version == 1 and service.pinned == 1
        status, body = http("POST", url + "/admin/rollback", {"version": 0}, key=API_KEY)
        assert status == 200 and body["pinned"] is None and body["served_version"] == 0
        status, body = http("POST", url + "/v1/chat/completions",
                            {"model": "selfrl@v2", "messages": [{"role": "user", "content": "x"}]})
        assert status == 409 and body["error"]["code"] == "version_not_servable"
        status, body = http("POST", url + "/admin/rollback", {"version": 2}, key=API_KEY)  # promoted again
        assert status == 200 and body["served_version"] == 2
        assert {v["version"]: v["status"] for v in body["versions"]}[2] == "promoted"



def test_restart_skips_a_version_whose_folder_is_incomplete(tiny_tokenizer, tiny_model_factory, tmp_path):
    cfg = tiny_serve_config(tmp_path / "run")
    with running_server(tiny_model_factory(lora=True), tiny_tokenizer, cfg) as (url, service):
        add_version(service, {k: torch.randn_like(v) for k, v in lora_state(service.engine.model).items()}, 1)
        weights = service.run_dir / "adapters" / "v000001" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a torn write
    with running_server(tiny_model_factory(lora=True), tiny_tokenizer, cfg) as (url, service):
        assert service.engine.version == 0
        # as in `selfrl run`: marked rolled_back with the reason, and a corrupt_version event
        assert any(e["kind"] == "corrupt_version" and "version 1" in e["message"] for e in service.store.events())
        assert service.ledger.get(1).status == "rolled_back" and "corrupt" in service.ledger.get(1).metrics
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(Exception, match="cannot be served"):
            client.chat.completions.create(model="selfrl@v1", messages=[{"role": "user", "content": "x"}])


def test_a_taken_port_is_a_clear_error_before_anything_is_announced(tmp_path, capsys, monkeypatch):
    import socket

    from selfrl.serve import main

    loaded = []
    monkeypatch.setattr("selfrl.model.load.build_policy", lambda cfg: loaded.append(cfg))  # must not be reached
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main.serve(None, {"port": port, "run_dir": str(tmp_path / "run")}, None)
    err = capsys.readouterr().err
    assert code == 1 and loaded == []
    assert f"selfrl: error: cannot bind 127.0.0.1:{port}: Address already in use" in err and "--port" in err
    assert "serving" not in err and "http://" not in err


def test_the_url_is_announced_only_once_the_socket_listens(monkeypatch):
    import socket
    import threading

    import uvicorn
    from fastapi import FastAPI

    from selfrl.serve import main

    sock = main.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with socket.socket() as probe:  # bound, not listening yet: a connection is refused
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    seen = []

    def announce(line, **kw):  # connect at the moment the line is printed
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            seen.append((line, c.getpeername()[1]))

    from selfrl.run import shutdown

    monkeypatch.setattr(shutdown, "print", announce, raising=False)
    server = shutdown.server(uvicorn.Config(FastAPI(), log_level="warning"), "serving on the port")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(300):
        if seen:
            break
        threading.Event().wait(0.05)
    server.should_exit = True
    thread.join(timeout=30)
    assert seen == [("serving on the port", port)]


def test_serve_refuses_the_judge_reward_in_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import selfrl.judge  # noqa: F401  registered, as in a process that imported it: the names check alone passed it

    from selfrl.serve import main

    toml = tmp_path / "serve.toml"
    toml.write_text("[learner]\nreward_weights = { judge = 1.0 }\n")
    with pytest.raises(ConfigError, match="learner.reward_weights: selfrl serve does not offer the 'judge' reward"):
        load_serve_config(str(toml), {})
    loaded = []
    monkeypatch.setattr("selfrl.model.load.build_policy", lambda cfg: loaded.append(cfg))  # must not be reached
    code = main.serve(str(toml), {"run_dir": str(tmp_path / "run")}, None)
    err = capsys.readouterr().err.strip()
    assert code == 2 and loaded == [] and len(err.splitlines()) == 1
    assert "train with a judge through selfrl run" in err and "user_feedback" in err
    cfg = load_serve_config(None, {})  # the default weights still load
    assert cfg.learner.reward_weights == {"user_feedback": 1.0, "tool_success": 0.2}


@pytest.mark.parametrize("weights, says", [
    ({"verifier": 1.0}, "cannot use the 'verifier' reward on served turns: it checks a task's reference answer"),
    ({"user_feedback": 1.0, "partial_credit": 0.5}, "cannot use the 'partial_credit' reward"),
    ({"user_feedback": 1.0, "self_consistency": 1.0}, "cannot use the 'self_consistency' reward on served turns: "
                                                      "it compares the samples of one task"),
    ({"user_feedback": 1.0, "agreement": 1.0}, "cannot use the 'agreement' reward"),
    ({"user_feedback": 1.0, "user_correction": 1.0}, "serve already counts a correcting next message as user_feedback"),
    ({"web_naive": 1.0}, "cannot use 'web_naive' on served turns: it is no built-in reward, and an environment's own "
                         "reward needs its task, which a served turn does not run"),
    ({"user_feedback": 1.0, "bogus": 0.5}, "cannot use 'bogus' on served turns: it is no built-in reward"),
    ({"webshop_naive": 1.0, "user_feedback": 1.0}, "cannot use 'webshop_naive' on served turns"),
    ({}, "{} has no positive 'user_feedback' weight"),
    ({"tool_success": 0.2}, "{'tool_success': 0.2} has no positive 'user_feedback' weight"),
    ({"user_feedback": 0.0, "tool_success": 0.2}, "has no positive 'user_feedback' weight"),
    ({"user_feedback": -1.0}, "negative weight {'user_feedback': -1.0}: selfrl serve would train away"),
    ({"user_feedback": 1.0, "length_penalty": -0.1}, "negative weight {'length_penalty': -0.1}: selfrl serve would "
                                                     "train away from what the reward pays; use weights >= 0 "
                                                     "(length_penalty's values are already negative)"),
])
def test_serve_refuses_reward_weights_that_cannot_apply_to_served_turns(tmp_path, capsys, monkeypatch, weights, says):
    """A reward served turns cannot carry, a table without user_feedback, or a negative weight would
    start fine and then score every rated turn alike ("no group had reward spread"): refused at load."""
    from selfrl.serve import main

    with pytest.raises(ConfigError) as err:
        load_serve_config(None, {"learner": {"reward_weights": weights}})
    assert str(err.value).startswith("learner.reward_weights: ") and says in str(err.value)
    if "cannot use" in says:
        assert "use only user_feedback, tool_success, format, length_penalty" in str(err.value)
    toml = tmp_path / "serve.toml"
    toml.write_text("[learner]\nreward_weights = { " + ", ".join(f"{k} = {v}" for k, v in weights.items()) + " }\n")
    loaded = []
    monkeypatch.setattr("selfrl.model.load.build_policy", lambda cfg: loaded.append(cfg))  # must not be reached
    code = main.serve(str(toml), {"run_dir": str(tmp_path / "run")}, None)
    err_text = capsys.readouterr().err.strip()
    assert code == 2 and loaded == [] and len(err_text.splitlines()) == 1 and says in err_text


@pytest.mark.parametrize("weights, says", [
    ({"user_feedback": True}, "learner.reward_weights: each weight must be a number, got {'user_feedback': True}"),
    ({"user_feedback": "1"}, "learner.reward_weights: each weight must be a number, got {'user_feedback': '1'}"),
    ({"user_feedback": float("inf")}, "learner.reward_weights must be finite, got {'user_feedback': inf}"),
    ({"User_Feedback": 1.0}, "learner.reward_weights: unknown reward 'User_Feedback' (did you mean user_feedback?); "
                             "selfrl serve uses only user_feedback, tool_success, format, length_penalty"),
    ({"user_feedback": 1.0, "tool_sucess": 0.2}, "unknown reward 'tool_sucess' (did you mean tool_success?)"),
])
def test_a_weight_that_is_no_number_or_a_misspelt_reward_says_so(weights, says):
    with pytest.raises(ConfigError) as err:
        load_serve_config(None, {"learner": {"reward_weights": weights}})
    assert says in str(err.value)


def test_serve_takes_the_rewards_a_served_turn_carries_and_families_change_nothing(tmp_path):
    weights = {"user_feedback": 1.0, "tool_success": 0.2, "format": 0.1, "length_penalty": 0.05}
    assert load_serve_config(None, {"learner": {"reward_weights": weights}}).learner.reward_weights == weights
    assert load_serve_config(None, {"learner": {"reward_weights": {"user_feedback": 0.5}}})
    from pathlib import Path

    families = Path(__file__).resolve().parents[1] / "configs" / "serve_families.toml"
    assert load_serve_config(str(families), {}).learner.reward_weights == {"user_feedback": 1.0, "tool_success": 0.2}
    toml = tmp_path / "families.toml"  # a family's held-out gate uses its verifier; the learner's reward cannot
    toml.write_text(families.read_text() + '\n[learner]\nreward_weights = { user_feedback = 1.0, verifier = 1.0 }\n')
    with pytest.raises(ConfigError, match="cannot use the 'verifier' reward on served turns"):
        load_serve_config(str(toml), {})


def test_every_built_in_reward_is_either_usable_by_serve_or_refused_with_its_reason():
    from selfrl.config.judge import JUDGE_REWARD
    from selfrl.config.serve import SERVE_REFUSED_REWARDS, SERVE_REWARDS
    from selfrl.envs.builtin import load_builtin_envs
    from selfrl.envs.rewards import REWARD_FUNCS
    from selfrl.serve.feedback import served_rewards

    load_builtin_envs()
    assert set(SERVE_REWARDS) <= set(REWARD_FUNCS)
    assert set(SERVE_REFUSED_REWARDS) <= set(REWARD_FUNCS)
    assert not set(SERVE_REWARDS) & set(SERVE_REFUSED_REWARDS)
    # the components a served turn's own reward rows name (selfrl.serve.feedback) are all usable
    assert set(served_rewards(1.0, 1.0, {})[0]) <= set(SERVE_REWARDS)
    ours = {n for n, fn in REWARD_FUNCS.items() if getattr(fn, "__module__", "").startswith("selfrl.")}  # not tests'
    unclassified = ours - set(SERVE_REWARDS) - set(SERVE_REFUSED_REWARDS) - {JUDGE_REWARD}
    assert unclassified <= {"web_naive", "webshop_naive"}, unclassified  # environments' rewards: the generic reason


def test_a_sampler_setting_without_a_sampler_url_is_refused_not_ignored():
    """serve's default kind is vllm: --sampler-kind (or a [swap_check] key) without --sampler would
    change nothing, so it is refused; a kind serve does not take is refused listing the one it does."""
    for overrides, key in (({"sampler.kind": "vllm"}, "sampler.kind (--sampler-kind) has"),
                           ({"swap_check.deadline_s": 5.0}, "swap_check.deadline_s (--swap-check-deadline) has")):
        with pytest.raises(ConfigError, match="^" + re.escape(key) + " no effect without sampler.url: .* add "
                           "--sampler URL, or leave it out$"):
            load_serve_config(None, overrides)
    for kind in ("selfrl", "bogus"):
        with pytest.raises(ConfigError) as err:
            load_serve_config(None, {"sampler.kind": kind})
        assert str(err.value).startswith(f"sampler.kind must be 'vllm', got {kind!r}: selfrl serve samples remotely "
                                         "through a vLLM server only")
    cfg = load_serve_config(None, {"sampler.url": "http://127.0.0.1:9", "sampler.kind": "vllm",
                                   "swap_check.deadline_s": 5.0})
    assert (cfg.sampler.kind, cfg.swap_check.deadline_s) == ("vllm", 5.0)


def test_task_source_beside_families_is_refused_even_at_its_default(tmp_path):
    toml = tmp_path / "serve.toml"
    families = '[[families]]\nname = "a"\nsource = "arithmetic"\n'
    for task, flags in (('[task]\nsource = "chain_sum"\n', {}),  # chain_sum: the default value
                        ("[task]\noptions = {}\n", {}),
                        ("", {"task.source": "chain_sum"})):  # --task chain_sum
        toml.write_text(task + families)
        with pytest.raises(ConfigError, match=r"^task\.(source|options) cannot be set with \[\[families\]\] "
                           r"\(nor --task\): each family's held-out set comes from its own source and options"):
            load_serve_config(str(toml), flags)
    toml.write_text("[task]\nval_seed = 7\n" + families)  # the families' default held-out seed: it applies
    assert load_serve_config(str(toml), {}).task.val_seed == 7


def test_run_only_task_settings_are_refused_by_serve(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text('[task]\nnum_train = 50\nchoice = "signal"\n')
    with pytest.raises(ConfigError, match=r"^task\.num_train, task\.choice: selfrl run's task settings, which selfrl "
                       r"serve does not use .*; remove them from \[task\]$"):
        load_serve_config(str(toml), {})


def test_an_unreachable_vllm_sampler_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import time

    from selfrl.serve import main

    loaded = []
    monkeypatch.setattr("selfrl.model.load.build_policy", lambda cfg: loaded.append(cfg))  # must not be reached
    t = time.monotonic()
    code = main.serve(None, {"run_dir": str(tmp_path / "run"), "sampler.url": "http://127.0.0.1:9"}, None)
    err = capsys.readouterr().err.strip()
    assert code == 1 and loaded == [] and time.monotonic() - t < 30 and len(err.splitlines()) == 1
    assert err.startswith("selfrl: error: cannot reach the vllm sampler at http://127.0.0.1:9 (sampler.url, "
                          "--sampler) within 5 s: http://127.0.0.1:9/health: ")
    assert "start it (vllm serve MODEL --enable-lora (docs/guides/vllm.md)) or correct the URL" in err


@pytest.mark.parametrize("overrides, message", [
    ({"learner.min_batch": 64, "learner.max_batch": 48},
     "learner.min_batch (64) must be at most learner.max_batch (48): lower the first or raise the second"),
    ({"learner.retry_max_s": 0.5}, "learner.retry_s (1) must be at most learner.retry_max_s (0.5)"),
    ({"learner.retry_s": 0.0}, "learner.retry_s must be > 0"),
    ({"learner.min_batch": 1}, "learner.min_batch must be >= 2"),
    ({"learner.order": "random"}, "learner.order must be one of 'newest', 'oldest', got 'random'"),
])
def test_the_learner_s_bound_pairs_name_both_keys(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_serve_config(None, overrides)
    assert str(err.value).startswith(message)


def test_serve_bounds_the_key_value_memory_of_its_engines(tiny_tokenizer, tiny_model_factory, tmp_path):
    import copy

    from selfrl.serve.service import Service

    model = tiny_model_factory(lora=True, eos_bias=2.0)
    cfg = tiny_serve_config(tmp_path / "run")
    cfg.engine, cfg.idle_kv_cache_mb, cfg.kv_continuation_mb = "slots", 64, 16
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    try:
        serving, learning = service.engine, service.learner.engine
        assert (serving.idle_cache_bytes, serving._continuations.max_bytes) == (64 * 2**20, 16 * 2**20)
        assert (learning.idle_cache_bytes, learning._continuations.max_bytes) == (0, 16 * 2**20)
        service.learner.ensure_champion_validated()  # the gate's batch, sampled by the learner's engine
        assert service.ledger.champion.success is not None
        assert learning.cache.nbytes == 0  # given back once the gate was done (it kept up to 2 GiB)
        assert (len(learning._continuations), learning._continuations.nbytes) == (0, 0)  # stale by the next gate
        assert learning._continuations.max_bytes == 16 * 2**20  # (still kept within a gate)
    finally:
        service.close()
    with pytest.raises(ConfigError, match=r"idle_kv_cache_mb must be >= 0 and <= 1048576, got -1"):
        load_serve_config(None, {"idle_kv_cache_mb": -1})
    with pytest.raises(ConfigError, match=r"learner.idle_kv_cache_mb must be >= 0"):
        load_serve_config(None, {"learner.idle_kv_cache_mb": -5})
    with pytest.raises(ConfigError, match="vLLM samples and holds its own cache.*drop idle_kv_cache_mb"):
        load_serve_config(None, {"sampler.url": "http://127.0.0.1:1", "idle_kv_cache_mb": 64})
