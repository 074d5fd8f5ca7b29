"""The warm start (selfrl.run.warm_start): its loss by hand, what rejection sampling keeps, that the
fine-tune moves the LoRA, and in a whole tiny run: gated like an update, held-out never used,
the zero-success path, and a resume that never repeats it."""

import dataclasses

import pytest
import torch
from conftest import save_tiny_phi

from selfrl.envs import rewards
from selfrl.run import warm_start
from selfrl.config import ConfigError, DetectorConfig, RunConfig, TrainConfig, WarmStartConfig, load_config
from selfrl.safety.detectors import TRAJECTORY_DETECTORS, Verdict
from selfrl.engines.reference import Engine, Generation
from selfrl.safety.gate import EvalResult
from selfrl.rl.learner import Learner
from selfrl.run.main import run
from selfrl.envs.rewards import REWARD_FUNCS
from selfrl.rollout.agent import RolloutConfig
from selfrl.record.store import Store
from selfrl.core.tasks import Task, TaskSource
from selfrl.core.trajectory import Trajectory
from selfrl.run.warm_start import (WarmStartError, fine_tune, mean_nll, sample_successes, select_successes, sft_loss,
                               warm_start_tasks)

# ---------------------------------------------------------------- the loss, by hand


def test_sft_loss_by_hand():
    logps = torch.tensor([[0.0, -1.0, -2.0, -9.0],
                          [0.0, -0.5, -7.0, 0.0]])  # (B, T); -9 and -7 sit on tool output / padding
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0],
                         [0.0, 1.0, 0.0, 0.0]])  # (B, T)
    # three sampled tokens: (1 + 2 + 0.5) / 3; the masked -9 and -7 count for nothing
    assert sft_loss(logps, mask, 3).item() == pytest.approx(3.5 / 3)
    # micro-batches with the step's normaliser add up to the step's loss
    parts = sft_loss(logps[:1], mask[:1], 3) + sft_loss(logps[1:], mask[1:], 3)
    assert parts.item() == pytest.approx(3.5 / 3)


def test_sft_loss_refuses_bad_input():
    with pytest.raises(ValueError, match="num_tokens"):
        sft_loss(torch.zeros(1, 2), torch.ones(1, 2), 0)
    with pytest.raises(ValueError, match="shape"):
        sft_loss(torch.zeros(1, 2), torch.ones(1, 3), 1)


# ---------------------------------------------------------------- what is kept


def traj(task="a", ids=(1, 2, 3), reward=1.0, correct=True, flags=None, error=None, penalty=None):
    t = Trajectory(task_id=task, group_id="g", adapter_version=0, prompt_len=1, token_ids=list(ids),
                   completion_mask=[0] + [1] * (len(ids) - 1), logprobs=[0.0] * len(ids), reward=reward,
                   correct=correct, flags=flags or {}, error=error)
    if penalty is not None:  # a detector's clamp, as apply_detectors writes it
        t.rewards["hacking_penalty"] = penalty
    return t


def test_select_keeps_only_verified_unflagged_successes():
    good = traj(ids=(1, 2, 3))
    trajs = [
        good,
        traj(ids=(1, 2, 3)),  # the same tokens again: a duplicate
        traj(ids=(1, 2, 4), reward=0.0, penalty=-1.0, flags={"repeated_action": "confirm twice"}),  # a hacked success
        traj(ids=(1, 2, 5), correct=False),  # paid but wrong
        traj(ids=(1, 2, 6), reward=0.3),  # correct, but below min_reward
        traj(ids=(1, 2, 7), reward=None, error="tool crashed"),
        traj(ids=(1, 2, 8)),  # a second distinct success of task a: over max_per_task = 1
        traj(task="b", ids=(1, 9, 9)),
    ]
    sel = select_successes(trajs, min_reward=0.5, max_per_task=1)
    assert [t.token_ids for t in sel.kept] == [[1, 2, 3], [1, 9, 9]]
    assert sel.counts() == {"samples": 8, "errors": 1, "successes": 5, "flagged_dropped": 1,
                            "duplicates_dropped": 1, "capped_dropped": 1, "kept": 2}
    assert select_successes(trajs, 0.5, 0).counts()["kept"] == 3  # no cap: [1,2,8] too
    # the flagged one is never kept, whatever the threshold
    assert all(not t.flags for t in select_successes(trajs, -10.0, 0).kept)


def test_warm_start_tasks_are_deterministic_and_capped():
    tasks = [Task.make("t", f"q{i}", str(i)) for i in range(10)]
    a, b = warm_start_tasks(tasks, 4, seed=3), warm_start_tasks(tasks, 4, seed=3)
    assert [t.id for t in a] == [t.id for t in b] and len({t.id for t in a}) == 4
    assert warm_start_tasks(tasks, 50, seed=3) == tasks


# ---------------------------------------------------------------- sampling with a scripted engine


class FortyTwo(TaskSource):
    """Every task's answer is 42."""

    name = "forty_two"

    def sample(self, n, seed):
        return [Task.make(self.name, f"Say 42 (#{seed}-{i})", "42") for i in range(n)]

    def score(self, task, answer):
        return 1.0 if answer == task.answer else 0.0


class Cycling(Engine):
    """Row ``i`` of every batch answers ``TEXTS[i % 3]``: a success, a hacked success, a failure."""

    TEXTS = ["<answer>42</answer>", "<answer>42</answer> HACK", "<answer>7</answer>"]

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.temperatures = []

    def generate(self, prompts, max_new_tokens, temperature=1.0, greedy=False):
        self.temperatures.append(temperature)
        out = []
        for i in range(len(prompts)):
            ids = self.tokenizer(self.TEXTS[i % 3], add_special_tokens=False)["input_ids"]
            ids = (ids + [self.tokenizer.eos_token_id])[:max_new_tokens]
            out.append(Generation(ids, [-0.1] * len(ids), True, self.version))
        return out


@pytest.fixture
def hack_detector(monkeypatch):
    monkeypatch.setitem(TRAJECTORY_DETECTORS, "test_hack",
                        lambda t, cfg: Verdict("HACK" in (t.final_answer or ""), "said HACK"))
    return DetectorConfig(names=["test_hack"])


def test_sampling_keeps_unflagged_successes_only(tiny_model, tiny_tokenizer, hack_detector):
    source = FortyTwo()
    train, val = source.sample(3, 1), source.sample(2, 2)
    engine = Cycling(tiny_model, tiny_tokenizer)
    cfg = WarmStartConfig(enabled=True, samples_per_task=6, temperature=1.7, max_per_task=0)
    rcfg = RolloutConfig(max_turns=1, max_new_tokens=16, tools=[])
    sel = sample_successes(engine, train, val, source, [], rcfg, {"verifier": 1.0}, hack_detector, cfg, chunk=12)
    # per task: rows 0..5 -> success, hacked, fail, success, hacked, fail (12 rows a call: 2 tasks, then 1)
    assert sel.counts() == {"samples": 18, "errors": 0, "successes": 12, "flagged_dropped": 6,
                            "duplicates_dropped": 3, "capped_dropped": 0, "kept": 3}
    assert sorted(t.task_id for t in sel.kept) == sorted(t.id for t in train)
    assert all(t.final_answer.strip() == "<answer>42</answer>" and not t.flags for t in sel.kept)
    assert engine.temperatures == [1.7, 1.7]  # the warm start's own temperature


def test_sampling_refuses_a_held_out_task(tiny_model, tiny_tokenizer):
    source = FortyTwo()
    train, val = source.sample(3, 1), source.sample(2, 1)  # the same seed: the same tasks
    with pytest.raises(ValueError, match="both train and validation"):
        sample_successes(Cycling(tiny_model, tiny_tokenizer), train, val, source, [], RolloutConfig(tools=[]),
                         {"verifier": 1.0}, DetectorConfig(), WarmStartConfig())


# ---------------------------------------------------------------- the fine-tune


def test_fine_tune_moves_the_lora_and_lowers_the_nll(tiny_model_factory, tiny_tokenizer, hack_detector):
    model = tiny_model_factory(lora=True)
    source = FortyTwo()
    sel = sample_successes(Cycling(model, tiny_tokenizer), source.sample(2, 1), [], source, [],
                           RolloutConfig(max_turns=1, max_new_tokens=16, tools=[]), {"verifier": 1.0},
                           hack_detector, WarmStartConfig(samples_per_task=3))
    learner = Learner(model, TrainConfig(micro_batch_size=1), 1.0, tiny_tokenizer.pad_token_id, 16,
                      tokenizer=tiny_tokenizer)
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = mean_nll(learner, sel.kept)
    stats = fine_tune(learner, sel.kept, epochs=3, learning_rate=1e-2, batch_size=2)
    assert stats.loss_before == pytest.approx(before)
    assert stats.loss_after < stats.loss_before - 0.1
    assert stats.steps == 3 and stats.skipped_steps == 0  # 2 trajectories, batch 2: one step an epoch
    assert stats.num_tokens == sum(t.num_completion_tokens for t in sel.kept)
    named = dict(model.named_parameters())
    assert all(not torch.equal(named[n], v) for n, v in lora.items())  # every LoRA tensor moved
    assert all(torch.equal(named[n], v) for n, v in base.items())  # the base never moves
    assert not learner.optimizer.state  # RL's optimizer was not used


def test_fine_tune_trains_on_sampled_tokens_only(tiny_model_factory, tiny_tokenizer):
    """Tokens outside completion_mask (prompt, tool output) are never scored: changing the last,
    unsampled token changes nothing; marking it as sampled does."""
    model = tiny_model_factory(lora=True)
    learner = Learner(model, TrainConfig(), 1.0, tiny_tokenizer.pad_token_id, 16)
    a = traj(ids=(5, 6, 7))
    a.completion_mask = [0, 1, 0]  # 7: tool output after the sampled 6
    b = dataclasses.replace(a, token_ids=[5, 6, 40])
    c = dataclasses.replace(a, completion_mask=[0, 1, 1])
    assert mean_nll(learner, [a]) == pytest.approx(mean_nll(learner, [b]), abs=1e-6)
    assert abs(mean_nll(learner, [a]) - mean_nll(learner, [c])) > 1e-3
    with pytest.raises(ValueError, match="sampled token"):
        fine_tune(learner, [dataclasses.replace(a, completion_mask=[0] * 3)], 1, 1e-3, 1)


# ---------------------------------------------------------------- config


def test_config_table_is_validated():
    cfg = load_config(None, {"warm_start.enabled": True, "warm_start.samples_per_task": 4})
    assert cfg.warm_start.enabled and cfg.warm_start.samples_per_task == 4
    assert cfg.warm_start.max_per_task == 4 and not cfg.warm_start.required
    with pytest.raises(ConfigError, match="unknown key 'warm_start.samples'"):
        load_config(None, {"warm_start.samples": 4})
    for key, value, msg in [("samples_per_task", 0, "samples_per_task"), ("num_tasks", 0, "num_tasks"),
                            ("temperature", 0.0, "temperature"), ("epochs", 0, "epochs"),
                            ("learning_rate", -1.0, "learning_rate"), ("max_per_task", -1, "max_per_task"),
                            ("max_per_task", True, "max_per_task"), ("batch_size", 0, "batch_size"),
                            ("kl_reference", "base", "kl_reference")]:
        with pytest.raises(ConfigError, match=f"warm_start.{msg}"):
            load_config(None, {f"warm_start.{key}": value})
    with pytest.raises(ConfigError, match="enabled must be bool"):
        load_config(None, {"warm_start.enabled": "yes"})
    with pytest.raises(ConfigError, match="--ray"):
        load_config(None, {"warm_start.enabled": True, "distributed.address": "local"})
    assert load_config(None, {"warm_start.max_per_task": 0}).warm_start.max_per_task == 0  # 0: no cap


def test_cli_flag_sets_the_table(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cfg, resume=False, progress=None):
        seen["cfg"] = cfg
        raise ValueError("stop here")

    monkeypatch.setattr("selfrl.run.main.run", fake_run)
    from selfrl.cli import main

    assert main(["run", "--warm-start", "--warm-start-samples", "5", "--run-dir", str(tmp_path / "r")]) == 2
    assert seen["cfg"].warm_start.enabled and seen["cfg"].warm_start.samples_per_task == 5
    main(["run", "--run-dir", str(tmp_path / "r2")])
    assert not seen["cfg"].warm_start.enabled


# ---------------------------------------------------------------- a whole tiny run


def short(t, ctx):
    """Test reward: 1 for an immediate EOS, 0 at the token limit (12 tokens)."""
    return 1.0 - t.num_completion_tokens / 12


def short_is_correct(t, ctx):
    """Test verifier: a completion whose first sampled token id is even 'solves' a training task."""
    return 1.0 if t.token_ids[t.prompt_len] % 2 == 0 else 0.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    return save_tiny_phi(tmp_path_factory.mktemp("model"), tiny_tokenizer)


@pytest.fixture
def patched(monkeypatch):
    """The test reward, and a verifier (used for ``correct``) that about half the completions pass."""
    monkeypatch.setitem(REWARD_FUNCS, "short", short)
    monkeypatch.setattr(rewards, "verifier", short_is_correct)
    return monkeypatch


def make_cfg(model_dir, run_dir, iterations=1, **ws) -> RunConfig:
    cfg = RunConfig(run_dir=str(run_dir), iterations=iterations, num_prompts=2, num_generations=2,
                    reward_weights={"short": 1.0})
    cfg.model.name, cfg.model.device, cfg.engine = str(model_dir), "cpu", "reference"
    cfg.lora.r = 4
    cfg.task.source, cfg.task.num_train = "chain_sum", 20
    cfg.rollout.max_new_tokens, cfg.rollout.max_turns, cfg.rollout.temperature = 12, 1, 0.7
    cfg.gate.val_size, cfg.gate.eval_every = 4, 1
    cfg.train.learning_rate = 1e-2
    cfg.warm_start = WarmStartConfig(enabled=True, num_tasks=3, samples_per_task=4, epochs=1, learning_rate=1e-2,
                                     max_per_task=2, **ws)
    return cfg.validate()


def warm_events(run_dir):
    with Store(run_dir / "selfrl.db") as store:
        return [e for e in store.events() if e["kind"] == "warm_start"], store.versions(), store.trajectories()


def test_run_warm_start_is_gated_recorded_and_reported(model_dir, patched, tmp_path):
    seen = []
    real = warm_start.sample_successes

    def spy(engine, tasks, held_out, *a, **kw):
        seen.append(([t.id for t in tasks], [t.id for t in held_out]))
        return real(engine, tasks, held_out, *a, **kw)

    class Phases:  # the progress a terminal or progress.log shows: phases and their steps
        interactive, phases = False, []

        def log(self, message):
            pass

        def phase(self, description, total):
            self.phases.append([description, total, 0])

        def advance(self, steps=1):
            self.phases[-1][2] += steps

    patched.setattr(warm_start, "sample_successes", spy)
    cfg = make_cfg(model_dir, tmp_path / "r")
    result = run(cfg, progress=Phases())
    events, versions, trajs = warm_events(result.run_dir)
    assert [e["data"]["phase"] for e in events] == ["trained", "done"]
    done = events[-1]["data"]
    assert done["tasks"] == 3 and done["samples"] == 12 and 1 <= done["kept"] <= 6
    # one bar step per optimizer step (1 epoch, batch 8), not one for the whole fine-tuning
    (tuning,) = [p for p in Phases.phases if p[0].startswith("warm start: fine-tuning")]
    assert tuning == [f"warm start: fine-tuning steps on {done['kept']} trajectories over 1 epoch", 1, 1]
    assert done["steps"] == 1
    assert done["loss_after"] < done["loss_before"] and done["seconds"] > 0
    # the candidate is version 1, from the base, and went through the gate (chain_sum: 0 = 0, promoted)
    assert done["version"] == 1 and versions[1]["parent"] == 0 and versions[1]["status"] == done["outcome"]
    assert done["outcome"] == "promoted" and "val/success" in versions[1]["metrics"]
    # the RL iteration sampled from the warm-started champion; the held-out tasks were never sampled
    assert {t.adapter_version for t in trajs} == {1}
    tasks, held_out = seen[0]
    with Store(result.run_dir / "selfrl.db") as store:
        val_ids = {r[0] for r in store.conn.execute("SELECT id FROM tasks WHERE split = 'val'")}
        train_ids = {r[0] for r in store.conn.execute("SELECT id FROM tasks WHERE split = 'train'")}
    assert set(held_out) == val_ids and set(tasks) <= train_ids and not set(tasks) & val_ids
    report = (result.run_dir / "report.md").read_text()
    assert "## Warm start" in report and "version 1 promoted" in report
    from selfrl.report.run import rebuild_report

    rebuilt = rebuild_report(result.run_dir, tmp_path / "rebuilt").read_text()  # selfrl report RUN_DIR
    assert "## Warm start" in rebuilt and events[-1]["message"] in rebuilt
    # resume: the warm start is not repeated
    cfg2 = dataclasses.replace(cfg, iterations=2)
    run(cfg2, resume=True)
    events2, versions2, _ = warm_events(result.run_dir)
    assert len(events2) == 2 and events2 == events


def test_gate_can_reject_the_warm_started_candidate(model_dir, patched, tmp_path):
    import selfrl.run.loop as loop

    real = loop.validate

    def rigged(engine, tasks, *a, **kw):  # the base solves half the held-out tasks, anything else none
        res = real(engine, tasks, *a, **kw)
        return dataclasses.replace(res, results=[(tid, engine.version == 0 and i % 2 == 0, ans)
                                                 for i, (tid, _, ans) in enumerate(res.results)])

    patched.setattr(loop, "validate", rigged)
    cfg = make_cfg(model_dir, tmp_path / "r")
    cfg.collapse.enabled = False  # 0.5 -> 0.0 is also a held-out collapse; here the plain gate decides
    result = run(cfg)
    events, versions, trajs = warm_events(result.run_dir)
    assert events[-1]["data"]["outcome"] == "rejected" and versions[1]["status"] == "rejected"
    assert {t.adapter_version for t in trajs} == {0}  # RL went on from the champion, the base


def test_no_success_goes_on_with_plain_rl_or_refuses_when_required(model_dir, patched, tmp_path):
    patched.setattr(rewards, "verifier", lambda t, ctx: 0.0)
    result = run(make_cfg(model_dir, tmp_path / "r"))
    events, versions, trajs = warm_events(result.run_dir)
    assert [e["data"]["phase"] for e in events] == ["no_successes"]
    assert "no success in 12 samples" in events[0]["message"] and "continuing with plain RL" in events[0]["message"]
    assert trajs and {t.adapter_version for t in trajs} == {0}  # RL ran
    with pytest.raises(WarmStartError, match="warm_start.samples_per_task"):
        run(make_cfg(model_dir, tmp_path / "req", required=True))
    events, versions, trajs = warm_events(tmp_path / "req")
    assert [e["data"]["phase"] for e in events] == ["no_successes"] and not trajs


def test_resume_gates_a_saved_candidate_without_training_again(model_dir, patched, tmp_path):
    def killed(*a, **kw):
        raise KeyboardInterrupt

    patched.setattr(warm_start, "gate_candidate", killed)
    cfg = make_cfg(model_dir, tmp_path / "r")
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    events, versions, _ = warm_events(tmp_path / "r")
    assert [e["data"]["phase"] for e in events] == ["trained"] and versions[1]["status"] == "candidate"
    patched.undo()
    patched.setitem(REWARD_FUNCS, "short", short)
    patched.setattr(rewards, "verifier", short_is_correct)
    trained = []
    patched.setattr(warm_start, "fine_tune", lambda *a, **kw: trained.append(1))
    run(cfg, resume=True)
    events, versions, trajs = warm_events(tmp_path / "r")
    assert [e["data"]["phase"] for e in events] == ["trained", "done"] and not trained
    assert events[-1]["data"]["version"] == 1 and versions[1]["status"] == events[-1]["data"]["outcome"]


def test_warm_start_after_rl_iterations_is_refused(model_dir, patched, tmp_path):
    cfg = make_cfg(model_dir, tmp_path / "r")
    run(dataclasses.replace(cfg, warm_start=WarmStartConfig()))
    with pytest.raises(WarmStartError, match="already ran 1 RL iteration"):
        run(dataclasses.replace(cfg, iterations=2), resume=True)


def test_a_promoted_warm_start_is_the_kl_reference_also_after_resume(model_dir, patched, tmp_path):
    from selfrl.record import adapters
    from selfrl.run.loop import Runner
    from selfrl.run.setup import build_run
    from selfrl.run.progress import PlainProgress

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    cfg = make_cfg(model_dir, tmp_path / "r")
    runner = Runner(build_run(cfg), PlainProgress())
    runner.run()
    warm = adapters.load_version_state(adapters.version_dir(tmp_path / "r", 1))
    base = adapters.load_version_state(adapters.version_dir(tmp_path / "r", 0))
    assert warm_events(tmp_path / "r")[0][-1]["data"]["outcome"] == "promoted"
    assert same(runner.s.learner.ref_state, warm) and not same(warm, base)
    resumed = Runner(build_run(dataclasses.replace(cfg, iterations=2), resume=True), PlainProgress())
    resumed.run()
    assert same(resumed.s.learner.ref_state, warm)
    initial = Runner(build_run(make_cfg(model_dir, tmp_path / "i", kl_reference="initial")), PlainProgress())
    initial.run()
    assert initial.s.learner.ref_state is None  # the base model, by disabling the adapter


def test_constrained_successes_train_with_their_grammar_masks_replayed(tiny_model_factory, tiny_tokenizer):
    """Turns sampled under rollout.constrain: before any step the NLL equals minus the sampled
    log-probs (the masks replayed, at the sampling temperature), and the fine-tune lowers it."""
    from selfrl.core.tools import Tool

    schema = {"type": "object", "properties": {"a": {"type": "integer", "enum": [17, 25, 42]}},
              "required": ["a"], "additionalProperties": False}
    tools = [Tool("pick", "Pick a number.", schema, lambda a: str(a))]
    model = tiny_model_factory(lora=True)
    torch.manual_seed(3)
    task = Task("t1", "test", "Pick 42.", "42")
    trajs = rollout_(model, tiny_tokenizer, [task] * 3, tools)
    assert all(t.constraints for t in trajs)
    learner = Learner(model, TrainConfig(micro_batch_size=2), 0.8, tiny_tokenizer.pad_token_id, 40,
                      tokenizer=tiny_tokenizer)
    sampled = -sum(sum(t.logprobs) for t in trajs) / sum(t.num_completion_tokens for t in trajs)
    assert mean_nll(learner, trajs) == pytest.approx(sampled, rel=1e-4)
    ticks = []
    stats = fine_tune(learner, trajs, epochs=2, learning_rate=1e-2, batch_size=2, on_step=lambda: ticks.append(1))
    assert stats.loss_after < stats.loss_before
    assert len(ticks) == stats.steps + stats.skipped_steps == 4  # 3 trajectories, batch 2: 2 steps an epoch
    assert warm_start.fine_tune_steps(trajs, 2, 2) == 4 and warm_start.fine_tune_steps(trajs, 3, 8) == 3
    no_tokens = dataclasses.replace(trajs[0], completion_mask=[0] * len(trajs[0].completion_mask))
    assert warm_start.fine_tune_steps([*trajs, no_tokens], 1, 1) == 3  # a trajectory without a token takes none
    no_tokenizer = Learner(model, TrainConfig(), 0.8, tiny_tokenizer.pad_token_id, 40)
    with pytest.raises(ValueError, match="grammar masks"):
        mean_nll(no_tokenizer, trajs)


def test_the_candidate_kl_probe_sees_weights_a_grammar_hides(tiny_model_factory, tiny_tokenizer):
    """A damaged adapter on turns decoded under a grammar: the probe's KL is over the whole
    vocabulary, so it exceeds what the masked KL shows (before: the masks were replayed, and a
    learning rate x1000 on such turns probed under the collapse rule's max_kl)."""
    from selfrl.core.tools import Tool
    from selfrl.rl.losses import k3_kl
    from selfrl.rl.logprobs import per_token_logps

    schema = {"type": "object", "properties": {"a": {"type": "integer", "enum": [17, 25, 42]}},
              "required": ["a"], "additionalProperties": False}
    tools = [Tool("pick", "Pick a number.", schema, lambda a: str(a))]
    model = tiny_model_factory(lora=True)
    torch.manual_seed(3)
    trajs = rollout_(model, tiny_tokenizer, [Task("t1", "test", "Pick 42.", "42")] * 3, tools)
    for t in trajs:
        t.advantage = 1.0
    learner = Learner(model, TrainConfig(micro_batch_size=2), 0.8, tiny_tokenizer.pad_token_id, 40,
                      tokenizer=tiny_tokenizer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()  # the adapter adds nothing: the policy is the reference (the base)
    assert learner.probe_kl(trajs, 3) == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)  # as an update at a learning rate x1000 would
    mb = learner._collate(trajs)
    with torch.no_grad():
        masked = per_token_logps(model, mb.input_ids, mb.attention_mask, mb.completion_mask, 0.8,
                                 vocab_masks=mb.vocab_masks)
        masked_kl = float((k3_kl(masked, learner._ref_logps(mb)) * mb.completion_mask).sum() / mb.completion_mask.sum())
    probed = learner.probe_kl(trajs, 3)
    assert probed > 0.1 and probed > 3 * masked_kl


def rollout_(model, tok, tasks, tools):
    from selfrl.rollout.agent import rollout

    cfg = RolloutConfig(max_turns=1, max_new_tokens=40, temperature=0.8, tools=[], constrain="tool_call")
    return rollout(Engine(model, tok), tasks, ["g"] * len(tasks), tools, cfg)
