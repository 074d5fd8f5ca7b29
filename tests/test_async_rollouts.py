"""``selfrl run --async-rollouts``: the next batch is sampled by the sampler's own LoRA copy while
the update trains; each batch is trained one version behind (TIS-corrected), every push to the
copy is swap-checked, and a batch made staler by a rejection is dropped and sampled again."""

import pytest
import torch

from selfrl.rollout.prefetch import LocalSampler, shadow_policy
from selfrl.cli import main
from selfrl.config import ConfigError, RunConfig
from selfrl.engines.reference import Engine
from selfrl.run.loop import Runner
from selfrl.run.main import run
from selfrl.record.store import Store
from tests.recorded_logps import assert_sampled_by_recorded_versions

pytestmark = pytest.mark.usefixtures("short_reward")


def make_cfg(model_dir, run_dir, iterations=4) -> RunConfig:
    """tests/test_loop.py's tiny run, asynchronous, validated every 2 updates, a gate that
    promotes any candidate (tolerance 1) unless a test vetoes it."""
    cfg = RunConfig(run_dir=str(run_dir), iterations=iterations, num_prompts=2, num_generations=3,
                    reward_weights={"short": 1.0}, async_rollouts=True)
    cfg.model.name, cfg.model.device, cfg.engine, cfg.lora.r = str(model_dir), "cpu", "reference", 4
    cfg.task.source, cfg.task.num_train = "chain_sum", 40
    cfg.rollout.max_new_tokens, cfg.rollout.max_turns, cfg.rollout.temperature = 12, 2, 0.7
    cfg.gate.val_size, cfg.gate.eval_every, cfg.gate.tolerance = 6, 2, 1.0
    cfg.train.learning_rate, cfg.train.micro_batch_size = 1e-2, 4
    cfg.collapse.enabled = False  # which versions serve must follow the gate alone here
    return cfg.validate()


def read(run_dir):
    with Store(run_dir / "selfrl.db") as store:
        return store.versions(), store.events(), store.trajectories(), store.metrics()


def sampled_by(run_dir) -> dict[int, set[int]]:
    """Iteration -> the adapter versions its stored trajectories were sampled by."""
    with Store(run_dir / "selfrl.db") as store:
        steps = {m["step"] for m in store.metrics() if m["name"] == "reward/mean"}
        return {i: {t.adapter_version for t in store.trajectories(iteration=i)} for i in sorted(steps)}


def per_iteration(metrics, name):
    return {m["step"]: m["value"] for m in metrics if m["name"] == name}


def test_the_shadow_shares_the_base_and_copies_the_lora(tiny_peft_model):
    model = tiny_peft_model
    shadow = shadow_policy(model)
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    theirs = dict(shadow.named_parameters())
    assert frozen and lora
    assert all(theirs[n].data_ptr() == p.data_ptr() for n, p in frozen.items())  # no second copy of the base
    assert all(theirs[n].data_ptr() != p.data_ptr() for n, p in lora.items())
    ids = torch.tensor([[1, 5, 9, 4, 7]])  # (1, 5)
    with torch.no_grad():
        for p in lora.values():  # a trained adapter: LoRA B is zero at init
            p.add_(0.05 * torch.randn_like(p))
        before = shadow(ids).logits.clone()
        same = model(ids).logits
        for p in lora.values():  # the learner trains in place ...
            p.add_(0.1)
        after = shadow(ids).logits
        moved = model(ids).logits
    assert not torch.equal(before, same)  # the copy was made before the adapter was trained
    torch.testing.assert_close(after, before, rtol=0, atol=0)  # ... and the sampler's copy does not move
    assert (moved - after).abs().max() > 1e-3


def test_the_local_sampler_answers_the_swap_check(tiny_peft_model, tiny_tokenizer):
    shadow = shadow_policy(tiny_peft_model)
    local = LocalSampler(Engine(shadow, tiny_tokenizer, version=3))
    logps, version = local.prompt_logprobs([1, 5, 9, 4])
    assert version == 3 and len(logps) == 3 and all(x < 0 for x in logps)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, model_dir):
    cfg = make_cfg(model_dir, tmp_path_factory.mktemp("async") / "r")
    result = run(cfg)
    return cfg, result, read(result.run_dir)


def test_each_batch_is_sampled_one_version_behind_the_learner(async_run):
    cfg, result, (versions, events, trajs, metrics) = async_run
    assert [(v["version"], v["parent"]) for v in versions] == [(0, None), (1, 0), (2, 1), (3, 2), (4, 3)]
    assert [v["status"] for v in versions if v["version"] in (2, 4)] == ["promoted", "promoted"]
    # iteration 0 on-policy; 1 sampled by version 0 during update 0 (the learner at 1); 2 by 1; 3 by 2
    assert sampled_by(result.run_dir) == {0: {0}, 1: {0}, 2: {1}, 3: {2}}
    assert per_iteration(metrics, "async/mean_staleness") == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0}
    assert per_iteration(metrics, "async/dropped_stale") == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}
    assert per_iteration(metrics, "sampled_version") == {0: 0.0, 1: 0.0, 2: 1.0, 3: 2.0}
    mismatch = per_iteration(metrics, "mismatch_kl")  # KL(sampler || learner): 0 on-policy, > 0 one behind
    assert mismatch[0] < 1e-6 and all(mismatch[i] > 1e-4 for i in (1, 2, 3))
    tis = per_iteration(metrics, "tis_weight_mean")
    assert tis[0] == pytest.approx(1.0, abs=1e-5) and all(abs(tis[i] - 1.0) > 1e-4 for i in (1, 2, 3))


def test_every_version_the_copy_serves_passed_the_swap_check(async_run):
    cfg, result, (versions, events, trajs, metrics) = async_run
    checks = [(e["data"]["stage"], e["data"]["version"]) for e in events if e["kind"] == "swap_check"]
    assert not [e for e in events if e["kind"] == "swap_check_failed"]
    assert checks[0] == ("start", 0)
    assert [v for stage, v in checks if stage == "candidate"] == [1, 2, 3, 4]
    assert ("promote", 2) in checks and ("promote", 4) in checks
    for e in events:
        if e["kind"] == "swap_check":  # the same weights, the same numerics
            assert e["data"]["mean_abs_diff"] < 1e-6


def test_recorded_logprobs_are_the_sampling_versions(async_run):
    cfg, result, (versions, events, trajs, metrics) = async_run
    assert_sampled_by_recorded_versions(cfg, versions, [trajs[0], trajs[7], trajs[-1]], atol=1e-5)  # iterations 0, 1, 3


def test_a_batch_made_staler_by_a_rejection_is_dropped_and_sampled_again(model_dir, tmp_path, monkeypatch):
    def veto(self, it, res):  # the gate rejects every candidate: the champion (version 0) comes back
        self.s.cycle.gate(it, res.version, res.success, res.degenerate, veto="test veto")

    monkeypatch.setattr(Runner, "gate", veto)
    cfg = make_cfg(model_dir, tmp_path / "r", iterations=3)
    run(cfg)
    versions, events, trajs, metrics = read(tmp_path / "r")
    assert [(v["version"], v["parent"], v["status"]) for v in versions] == [
        (0, None, "base"), (1, 0, "candidate"), (2, 1, "rejected"), (3, 0, "rejected")]
    # iteration 2 was sampled by version 1 during update 1; version 2 was rejected and 0 serves
    # again (staleness 2 > 1): that batch is dropped and the same tasks are sampled by version 0
    assert sampled_by(tmp_path / "r") == {0: {0}, 1: {0}, 2: {0}}
    assert per_iteration(metrics, "async/dropped_stale") == {0: 0.0, 1: 0.0, 2: 2.0}
    assert per_iteration(metrics, "async/mean_staleness") == {0: 0.0, 1: 1.0, 2: 0.0}
    assert len(trajs) == 18  # 3 iterations x 6: the dropped batch was never stored
    assert [v for stage, v in [(e["data"]["stage"], e["data"]["version"]) for e in events
                               if e["kind"] == "swap_check"] if stage == "restore"] == [0, 0]  # after 2 and 3


def test_async_rollouts_is_refused_with_ray_and_set_by_the_flag(model_dir, tmp_path, monkeypatch):
    cfg = RunConfig(async_rollouts=True)
    cfg.distributed.address = "local"
    with pytest.raises(ConfigError, match=r"async_rollouts .*--ray already samples asynchronously"):
        cfg.validate()
    seen = []

    def fake_run(c, resume=False, progress=None):
        seen.append(c.async_rollouts)
        raise SystemExit(0)

    monkeypatch.setattr("selfrl.run.main.run", fake_run)
    for flags in (["--async-rollouts"], []):
        with pytest.raises(SystemExit):
            main(["run", "--model", str(model_dir), "--run-dir", str(tmp_path / "c"), *flags])
    assert seen == [True, False]
    # a config that turns it on can be overridden from the command line, both ways
    on = tmp_path / "on.toml"
    on.write_text("async_rollouts = true\n")
    for flags in (["--no-async-rollouts"], [], ["--async-rollouts"]):
        with pytest.raises(SystemExit):
            main(["run", "--config", str(on), "--model", str(model_dir), "--run-dir", str(tmp_path / "d"), *flags])
    assert seen == [True, False, False, True, True]


def test_an_async_run_on_the_slot_engine(model_dir, tmp_path):
    cfg = make_cfg(model_dir, tmp_path / "r", iterations=3)
    cfg.engine = "slots"
    run(cfg.validate())
    versions, events, trajs, metrics = read(tmp_path / "r")
    assert sampled_by(tmp_path / "r") == {0: {0}, 1: {0}, 2: {1}}
    assert not [e for e in events if e["kind"] == "swap_check_failed"]
    assert [v for stage, v in [(e["data"]["stage"], e["data"]["version"]) for e in events
                               if e["kind"] == "swap_check"] if stage == "candidate"] == [1, 2, 3]
