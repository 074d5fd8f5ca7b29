"""``selfrl run --sampler URL``: the learner in this process, rollouts and validation in a
``selfrl sampler`` app on loopback (uvicorn in a thread), every pushed version proved by the
swap check; an injected stale adapter and an injected hang stop promotion, within the deadline."""

import threading
import time

import pytest

from selfrl.cli import main
from selfrl.config import ConfigError, RunConfig
from selfrl.engines.reference import Engine
from selfrl.serve.sampler_app import create_sampler_app
from selfrl.model.load import build_policy
from selfrl.run.main import run
from selfrl.run.sampler_sync import swap_within
from selfrl.record.store import Store
from selfrl.safety.swap_check import SwapCheckError
from tests.engine_backends import start_loopback
from tests.recorded_logps import assert_sampled_by_recorded_versions

pytestmark = pytest.mark.usefixtures("short_reward")


def make_cfg(model_dir, run_dir, url=None, iterations=2) -> RunConfig:
    """As tests/test_loop.py's run (reference engine numbers, learning rate 1e-2: versions differ
    visibly on the probe), sampling at ``url``."""
    cfg = RunConfig(run_dir=str(run_dir), iterations=iterations, num_prompts=2, num_generations=3,
                    reward_weights={"short": 1.0})
    cfg.model.name, cfg.model.device, cfg.lora.r = str(model_dir), "cpu", 4
    cfg.task.source, cfg.task.num_train = "chain_sum", 40
    cfg.rollout.max_new_tokens, cfg.rollout.max_turns, cfg.rollout.temperature = 12, 2, 0.7
    cfg.gate.val_size, cfg.gate.eval_every = 6, 1
    cfg.train.learning_rate, cfg.train.micro_batch_size = 1e-2, 4
    cfg.sampler.url = url
    cfg.swap_check.deadline_s = 5.0
    return cfg.validate()


class StaleEngine(Engine):
    """Injected fault: acknowledges every swap (and reports the new version) but keeps the base weights."""

    def swap(self, state_dict, version):
        self.version = version
        return 0.0


class HangingEngine(Engine):
    """Injected fault: loads version 1 and more, then holds the engine (so the probe never
    answers) until ``release`` is set."""

    release = threading.Event()

    def swap(self, state_dict, version):
        seconds = super().swap(state_dict, version)
        if version >= 1:
            held = threading.Event()

            def hang():
                with self.lock:
                    held.set()
                    self.release.wait(120)

            threading.Thread(target=hang, daemon=True).start()
            held.wait(10)
        return seconds


def sampler(cfg, tok, engine_cls=Engine) -> str:
    """A ``selfrl sampler`` app serving its own copy of the policy (same model, seed, LoRA shape)."""
    model, _ = build_policy(cfg)
    return start_loopback(create_sampler_app(engine_cls(model, tok), model_name=cfg.model.name))


def read(run_dir):
    with Store(run_dir / "selfrl.db") as store:
        return store.versions(), store.events(), store.trajectories()


def test_a_run_through_a_remote_sampler_checks_every_version(model_dir, tiny_tokenizer, tmp_path):
    url = sampler(make_cfg(model_dir, tmp_path / "x"), tiny_tokenizer)
    cfg = make_cfg(model_dir, tmp_path / "r", url)
    result = run(cfg)
    versions, events, trajs = read(result.run_dir)
    assert [v["version"] for v in versions] == [0, 1, 2]
    assert versions[0]["status"] == "base" and {v["status"] for v in versions[1:]} <= {"promoted", "rejected"}
    promoted = [v["version"] for v in versions if v["status"] == "promoted"]
    assert promoted, "nothing was promoted: the run checks no promote step"
    checks = [(e["data"]["stage"], e["data"]["version"]) for e in events if e["kind"] == "swap_check"]
    assert not [e for e in events if e["kind"] == "swap_check_failed"]
    assert checks[0] == ("start", 0)
    assert [v for stage, v in checks if stage == "candidate"] == [1, 2]
    for v in promoted:  # the promote step proved each promoted version, before its promote event
        i = checks.index(("promote", v))
        promote_at = next(j for j, e in enumerate(events) if e["kind"] == "promote" and e["data"]["version"] == v)
        check_at = [j for j, e in enumerate(events) if e["kind"] == "swap_check"][i]
        assert check_at < promote_at
    assert checks[-1] == ("finish", result.final_version)
    for e in events:
        if e["kind"] == "swap_check":  # fp32 on both sides, same numerics: equal to rounding
            assert e["data"]["mean_abs_diff"] < 1e-5 and e["data"]["tolerance"] == 1e-3
    # the sampler sampled each trajectory with the version it is recorded under
    assert {t.adapter_version for t in trajs} >= {0} and len(trajs) == 12
    assert_sampled_by_recorded_versions(cfg, versions, [trajs[0], trajs[-1]], atol=1e-4)


def test_an_injected_stale_adapter_stops_promotion(model_dir, tiny_tokenizer, tmp_path):
    url = sampler(make_cfg(model_dir, tmp_path / "x"), tiny_tokenizer, StaleEngine)
    cfg = make_cfg(model_dir, tmp_path / "r", url)
    with pytest.raises(SwapCheckError, match=r"swap check failed for version 1 \((mismatch|stale)\).*not promoted"):
        run(cfg)
    versions, events, _ = read(tmp_path / "r")
    assert [(v["version"], v["status"]) for v in versions] == [(0, "base"), (1, "rejected")]
    assert versions[1]["metrics"]["swap_check"] == "mismatch"
    failed = [e for e in events if e["kind"] == "swap_check_failed"]
    assert failed[0]["data"]["stage"] == "candidate" and failed[0]["data"]["version"] == 1
    assert failed[0]["data"]["mean_abs_diff"] > 10 * failed[0]["data"]["tolerance"]
    assert versions[1]["metrics"]["swap_check/mean_abs_diff"] == pytest.approx(failed[0]["data"]["mean_abs_diff"])
    assert not [e for e in events if e["kind"] == "promote"]
    assert (tmp_path / "r" / "report.md").is_file()  # the run stopped cleanly


def test_an_injected_hang_fails_within_the_deadline(model_dir, tiny_tokenizer, tmp_path):
    url = sampler(make_cfg(model_dir, tmp_path / "x"), tiny_tokenizer, HangingEngine)
    cfg = make_cfg(model_dir, tmp_path / "r", url)
    cfg.swap_check.deadline_s = 1.0
    try:
        t = time.monotonic()
        with pytest.raises(SwapCheckError, match=r"version 1 \(timeout\).*within 1 s"):
            run(cfg)
        assert time.monotonic() - t < 300  # returned: no hang
        versions, events, _ = read(tmp_path / "r")
        failed = [e["data"] for e in events if e["kind"] == "swap_check_failed"]
        assert failed[0]["reason"] == "timeout" and failed[0]["version"] == 1 and failed[0]["stage"] == "candidate"
        assert failed[0]["seconds"] < 3.0
        # the end of the run could not put the champion back either (the sampler still hangs): reported
        assert failed[-1]["stage"] == "finish" and failed[-1]["reason"] == "timeout" and failed[-1]["seconds"] < 3.0
        assert [(v["version"], v["status"]) for v in versions] == [(0, "base"), (1, "rejected")]
        assert versions[1]["metrics"]["swap_check"] == "timeout"
    finally:
        HangingEngine.release.set()


class Fake:
    def __init__(self, delay_s=0.0, error=None):
        self.delay_s, self.error, self.version = delay_s, error, 0

    def swap(self, adapter, version):
        time.sleep(self.delay_s)
        if self.error:
            raise self.error
        self.version = version


def test_a_swap_the_sampler_never_acknowledges_fails_at_the_deadline():
    t = time.monotonic()
    res = swap_within(Fake(delay_s=3), {}, 3, 0.5, 1e-3)
    assert time.monotonic() - t < 2.0
    assert not res.ok and res.reason == "timeout" and "within 0.5 s" in res.detail and res.version == 3
    res = swap_within(Fake(error=ValueError("adapter does not fit")), {}, 3, 5.0, 1e-3)
    assert not res.ok and res.reason == "error" and "adapter does not fit" in res.detail
    fake = Fake()
    assert swap_within(fake, {}, 3, 5.0, 1e-3) is None and fake.version == 3


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c, "engine", "slots"), "engine = 'slots' picks an in-process backend"),
    (lambda c: setattr(c, "engine", "reference"), "engine = 'reference' picks an in-process backend"),
    (lambda c: setattr(c.distributed, "address", "local"), "distributed.address"),
    (lambda c: setattr(c.rollout, "constrain", "tool_call"), "rollout.constrain = 'tool_call'"),
    (lambda c: setattr(c.sampler, "url", "127.0.0.1:8100"), "sampler.url must start with http://"),
    (lambda c: setattr(c.sampler, "kind", "sglang"), "sampler.kind must be one of 'selfrl', 'vllm'"),
    (lambda c: setattr(c.swap_check, "deadline_s", 0.0), "swap_check.deadline_s must be > 0"),
])
def test_combinations_a_remote_sampler_cannot_honour_are_refused(change, message):
    cfg = RunConfig()
    cfg.sampler.url = "http://127.0.0.1:8100"
    change(cfg)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        cfg.validate()


def test_a_sampler_setting_without_a_sampler_url_is_refused_not_ignored(tmp_path):
    from selfrl.config import load_config

    with pytest.raises(ConfigError, match=r"^sampler\.kind \(--sampler-kind\) has no effect without sampler\.url: "
                       r"the run samples in process .*; add --sampler URL, or leave it out$"):
        load_config(None, {"sampler.kind": "vllm"})
    toml = tmp_path / "c.toml"
    toml.write_text("[sampler]\ntimeout_s = 5.0\napi_key_file = 'k'\n")
    with pytest.raises(ConfigError, match=r"^sampler\.api_key_file, sampler\.timeout_s have no effect"):
        load_config(toml)
    assert load_config(None, {"sampler.kind": "vllm", "sampler.url": "http://h:1"}).sampler.kind == "vllm"
    # a stored run's config (--resume) and an environment's defaults are not the user's settings
    assert load_config(None, None, {"sampler": {"kind": "vllm"}}).sampler.kind == "vllm"


def test_cli_an_unreachable_sampler_is_a_clear_error_before_the_model_loads(model_dir, tmp_path, capsys, monkeypatch):
    loaded = []
    monkeypatch.setattr("selfrl.run.setup.build_policy", lambda cfg: loaded.append(cfg))  # must not be reached
    t = time.monotonic()
    code = main(["run", "--model", str(model_dir), "--device", "cpu", "--lora-r", "4", "--run-dir",
                 str(tmp_path / "r"), "--sampler", "http://127.0.0.1:9", "--iterations", "1"])
    assert code == 1 and loaded == [] and time.monotonic() - t < 30  # the machine's fault, as a taken port
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("selfrl: error: cannot reach the selfrl sampler at http://127.0.0.1:9 (sampler.url, "
                          "--sampler) within 5 s: http://127.0.0.1:9/sampler/health: ")
    assert err.endswith("; start it (selfrl sampler --port PORT, with the run's model) or correct the URL, then "
                        "start again")
    assert not (tmp_path / "r").exists()  # nothing was started


def test_a_server_that_is_not_the_sampler_kind_named_is_unreachable_with_its_status():
    """--sampler-kind vllm pointed at something without /health (a selfrl sampler, a typo'd port
    of another server) is named by the status it answered."""
    import http.server

    from selfrl.engines.http import unreachable

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404 if self.path == "/health" else 200)
            self.end_headers()
            self.wfile.write(b'{"detail": "Not Found"}')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert unreachable(url, "/health") == f"{url}/health: HTTP 404: Not Found"
        assert unreachable(url, "/sampler/health") is None
    finally:
        server.shutdown()


def test_cli_a_stale_sampler_exits_1_and_resume_on_a_fixed_one_goes_on(model_dir, tiny_tokenizer, tmp_path, capsys):
    cfg = make_cfg(model_dir, tmp_path / "x")
    conf = tmp_path / "c.toml"
    conf.write_text('reward_weights = { short = 1.0 }\n[rollout]\nmax_new_tokens = 12\n'
                    'max_turns = 2\n[gate]\nval_size = 6\n[train]\nmicro_batch_size = 4\n')
    args = ["run", "--config", str(conf), "--model", str(model_dir), "--device", "cpu", "--lora-r", "4", "--task",
            "chain_sum", "--iterations", "2", "--num-prompts", "2", "--num-generations", "3", "--eval-every", "1",
            "--learning-rate", "0.01", "--temperature", "0.7"]
    run_dir = tmp_path / "r"
    assert main(args + ["--run-dir", str(run_dir), "--sampler", sampler(cfg, tiny_tokenizer, StaleEngine)]) == 1
    err = capsys.readouterr().err
    assert "selfrl: error: swap check failed for version 1 (mismatch)" in err and "--resume" in err
    # the sampler is fixed (here: another one, honest): the run continues from its champion
    assert main(["run", "--resume", str(run_dir), "--sampler", sampler(cfg, tiny_tokenizer)]) == 0
    versions, events, _ = read(run_dir)
    assert versions[1]["status"] == "rejected" and versions[1]["metrics"]["swap_check"] == "mismatch"
    assert [v["version"] for v in versions] == [0, 1, 2, 3]
    assert {v["status"] for v in versions[2:]} <= {"promoted", "rejected"}
    resumed = next(i for i, e in enumerate(events) if e["kind"] == "resume")
    checks = [(e["data"]["stage"], e["data"]["version"]) for e in events[:resumed] if e["kind"] == "swap_check"]
    # first session: the base, (version 1 failed), the champion put back at the stop (the stale sampler
    # holds the base weights, which are version 0's); then the resumed session's champion, before it goes on
    assert checks == [("start", 0), ("finish", 0), ("start", 0)]
    later = [(e["data"]["stage"], e["data"]["version"]) for e in events if e["kind"] == "swap_check"]
    assert ("candidate", 2) in later and ("candidate", 3) in later
