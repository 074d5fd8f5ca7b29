"""Serve replicas share one learner: two real ``selfrl serve`` processes on loopback, one
owning the run directory (lock, learner, versions), one ``--replica``. Traffic and feedback
sent only to the replica train the owner's learner, and the replica then serves the
version the owner promoted, named in its responses (selfrl.serve.replica)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import save_tiny_phi

from selfrl.record.store import Store
from serving import API_KEY, http

CONFIG = """
run_dir = "{run_dir}"
max_tokens_default = 8
batch_window_s = 0.02
engine = "reference"
follow_s = 0.2
[model]
name = "{model}"
device = "cpu"
[lora]
r = 4
[train]
learning_rate = 1e-2
[learner]
min_batch = 4
max_batch = 4
feedback_wait_s = 600.0
poll_s = 0.1
[gate]
val_size = 4
batch_size = 4
[rollout]
max_new_tokens = 6
max_turns = 1
[collapse]
enabled = false
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(config, port, *flags) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "SELFRL_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "selfrl.cli", "serve", "--config", str(config), "--port", str(port),
                             *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc, url, timeout=90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if http("GET", url + "/v1/models")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready within {timeout} s")


def chat(url, content):
    status, body = http("POST", url + "/v1/chat/completions", {
        "model": "selfrl", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
        "task_key": "arith"})
    assert status == 200, body
    return body


def stop(proc) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stdout.read()


def test_a_replicas_traffic_trains_the_owners_learner_and_it_serves_the_promoted_version(tmp_path, tiny_tokenizer):
    model = save_tiny_phi(tmp_path / "model", tiny_tokenizer)
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "run", model=model))
    # a replica with no owner yet has nothing to follow: refused before it loads anything
    from selfrl.serve.main import load_serve_config
    from selfrl.serve.replica import NoOwner
    from selfrl.serve.service import Service

    with pytest.raises(NoOwner, match="no servable version to follow: start its owner"):
        Service(None, tiny_tokenizer, load_serve_config(str(config), {"replica": True}))
    assert not (tmp_path / "run" / "selfrl.db").exists()
    owner, owner_url = start(config, free_port())
    replica = None
    try:
        wait_ready(owner, owner_url)
        replica, url = start(config, free_port(), "--replica")
        wait_ready(replica, url)
        first = [chat(url, f"q{i}") for i in range(4)]
        assert {r["adapter_version"] for r in first} == {0}
        assert http("POST", url + "/admin/pin", {"version": 0}, key=API_KEY)[1]["error"]["code"] == "replica"
        for i, r in enumerate(first):  # feedback, also to the replica: a group of 4 with reward spread
            assert http("POST", url + "/v1/feedback", {"response_id": r["id"], "rating": 1.0 if i % 2 else -1.0},
                        key=API_KEY)[0] == 200
        deadline, served = time.monotonic() + 90, None
        while time.monotonic() < deadline:
            served = chat(url, "after")
            if served["adapter_version"] == 1:
                break
            time.sleep(0.3)
        assert served["adapter_version"] == 1 and served["system_fingerprint"] == "selfrl-v1"
        status = http("GET", url + "/admin/status", key=API_KEY)[1]
        assert status["served_version"] == 1 and status["replica"]["swaps"] == 1 and status["learner"] is None
        assert http("GET", owner_url + "/admin/status", key=API_KEY)[1]["served_version"] == 1
    finally:
        logs = [stop(p) for p in (replica, owner) if p is not None]
    with Store(tmp_path / "run" / "selfrl.db", readonly=True) as store:
        runs = store.runs()
        owner_run, replica_run = runs[0]["id"], runs[1]["id"]
        assert not runs[0]["config"]["serve"]["replica"] and runs[1]["config"]["serve"]["replica"]
        [v1] = [v for v in store.versions() if v["version"] == 1]
        assert v1["status"] == "promoted"
        rows = store.conn.execute("SELECT s.status, s.trained_in, t.run_id FROM served s JOIN trajectories t "
                                  "ON t.id = s.trajectory_id").fetchall()
        trained = [r for r in rows if r["status"] == "trained"]
        # the four turns the replica served (its run id) are the ones the owner's learner trained version 1 on
        assert len(trained) == 4 and {(r["trained_in"], r["run_id"]) for r in trained} == {(1, replica_run)}
        assert not [r for r in rows if r["run_id"] == owner_run]  # the owner served nothing itself
        swaps = [e for e in store.events(replica_run) if e["kind"] == "swap"]
        assert [e["data"]["version"] for e in swaps] == [1], logs


def test_a_replica_whose_model_or_lora_shape_is_not_its_owners_is_refused():
    # before: a replica on another model was accepted and recorded another tokenizer's token ids in the
    # owner's store, which the owner's learner trains on with its own model
    from selfrl.config import ConfigError
    from selfrl.config.serve import ServeConfig
    from selfrl.serve.replica import check_owner_model

    owner = {"config": {"serve": {"replica": False, "model": {"name": "tiny:a", "device": "cpu"},
                                  "lora": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                                           "init_adapter": None}}}}
    other = {"config": {"serve": {"replica": True, "model": {"name": "tiny:b"}}}}
    same = ServeConfig()
    same.model.name, same.model.device = "tiny:a", "auto"  # where it runs may differ
    same.lora.r, same.lora.lora_alpha, same.lora.target_modules = 8, 16, ("q_proj", "v_proj")
    check_owner_model(same, [owner, other], "runs/x")  # another replica's values are not the owner's
    check_owner_model(ServeConfig(), [{"config": {"run": {}}}], "runs/x")  # no owner's start recorded
    bad = ServeConfig()
    bad.model.name, bad.lora.r, bad.lora.lora_alpha, bad.lora.target_modules = "embedded:smollm2-135m-instruct", 8, 16, \
        ["q_proj", "v_proj"]
    with pytest.raises(ConfigError) as e:
        check_owner_model(bad, [owner, other], "runs/x")
    assert str(e.value).endswith(
        "this replica's model is not its owner's (the last start of selfrl serve on runs/x): model.name = "
        "'embedded:smollm2-135m-instruct' here, 'tiny:a' there; the owner's learner trains on the token ids a "
        "replica records and a replica serves the owner's adapter versions, so both must be the owner's: set "
        "model.name = 'tiny:a' in this replica's config")
    bad.model.name, bad.lora.r = "tiny:a", 4
    with pytest.raises(ConfigError, match=r"lora\.r = 4 here, 8 there; .* set lora\.r = 8 in"):
        check_owner_model(bad, [owner], "runs/x")
