"""The update cycle shared by `selfrl run` and `selfrl serve`: skips are named, make no
version and are recorded (issue 17 cases 2 and 6)."""

import pytest
import torch

from selfrl.safety.collapse import CollapseGuard
from selfrl.config import CollapseConfig, TrainConfig
from selfrl.run.cycle import Observed, UpdateCycle
from selfrl.rl.logprobs import per_token_logps
from selfrl.record.store import Store
from selfrl.rl.learner import Learner, SkipReason
from selfrl.core.trajectory import Trajectory
from selfrl.record.versions import Ledger

TEMPERATURE = 0.7


def trajectories(model, shift: float, groups=("g", "g", "h", "h")) -> list[Trajectory]:
    """Four trajectories, advantages +1 / -1; their old logprobs are the model's own moved by
    ``shift`` against the sign of the advantage (ratio = exp(shift) for A > 0, exp(-shift) for A < 0)."""
    out = []
    for i, g in enumerate(groups):
        n = 2 + i
        t = Trajectory(g, g, 0, prompt_len=3, token_ids=[5, 6, 7] + [10 + k for k in range(n)],
                       completion_mask=[0, 0, 0] + [1] * n, reward=1.0 if i % 2 == 0 else 0.0)
        t.advantage = 1.0 if i % 2 == 0 else -1.0
        ids, mask = torch.tensor([t.token_ids]), torch.tensor([t.completion_mask])  # (1, T)
        with torch.no_grad():
            own = per_token_logps(model, ids, torch.ones_like(ids), mask, TEMPERATURE)[0]  # (T,)
        t.logprobs = ((own - shift * t.advantage) * mask[0]).tolist()
        out.append(t)
    return out


def make_cycle(model, tmp_path, collapse_cfg=None, clock=None, store=None, **train):
    # tis_cap 0: the PPO ratio is taken against the sampler's logprobs (the off-policy correction,
    # on by default, takes it against the learner's own, so a shifted sampler is never clipped)
    cfg = TrainConfig(**{"beta": 0.0, "learning_rate": 1e-2, "micro_batch_size": 4, "tis_cap": 0.0, **train})
    learner = Learner(model, cfg, TEMPERATURE, 0, max_completion_length=8)
    store = store or Store(tmp_path / "s.db")
    ledger = Ledger(store, store.start_run({}), tmp_path)
    ledger.ensure_base(model)
    from selfrl.record.adapters import lora_state

    ledger.set_champion(0, lora_state(model))
    cc = collapse_cfg or CollapseConfig()
    cycle = UpdateCycle(ledger, learner, CollapseGuard(cc), None, cc, 0.02, "group",
                        load=lambda state, version: None, **({"clock": clock} if clock else {}))
    return cycle, ledger, store


def test_a_batch_whose_every_token_is_clipped_is_skipped_as_no_gradient(tiny_peft_model, tmp_path):
    cycle, ledger, store = make_cycle(tiny_peft_model, tmp_path)
    before = {n: p.detach().clone() for n, p in tiny_peft_model.named_parameters() if p.requires_grad}
    step = cycle.update(0, trajectories(tiny_peft_model, shift=1.0), parent=0)  # ratios e and 1/e: all clipped
    assert step.result.skipped and step.result.reason == SkipReason.NO_GRADIENT
    assert step.result.stats["clip_ratio"] == pytest.approx(1.0) and step.result.stats["grad_norm"] == 0.0
    assert "no gradient" in step.result.note
    # no new version, the weights and AdamW untouched, and an event that says why
    assert step.candidate is None and [v.version for v in ledger.all()] == [0]
    assert all(torch.equal(before[n], p) for n, p in tiny_peft_model.named_parameters() if p.requires_grad)
    assert not cycle.learner.optimizer.state
    event = store.events()[-1]
    assert event["kind"] == "skip" and "no gradient" in event["message"] and event["data"]["reason"] == "no_gradient"
    # the same batch inside the clip range is applied and makes version 1
    step = cycle.update(1, trajectories(tiny_peft_model, shift=0.0), parent=0)
    assert not step.result.skipped and step.candidate.version == 1
    store.close()


def test_an_update_after_an_earlier_one_is_still_skipped_when_all_clipped(tiny_peft_model, tmp_path):
    # with AdamW moments from an earlier step, applying a zero gradient would still move the weights
    cycle, ledger, store = make_cycle(tiny_peft_model, tmp_path)
    cycle.update(0, trajectories(tiny_peft_model, shift=0.0), parent=0)
    before = {n: p.detach().clone() for n, p in tiny_peft_model.named_parameters() if p.requires_grad}
    step = cycle.update(1, trajectories(tiny_peft_model, shift=2.0), parent=1)
    assert step.result.reason == SkipReason.NO_GRADIENT and step.candidate is None
    assert all(torch.equal(before[n], p) for n, p in tiny_peft_model.named_parameters() if p.requires_grad)
    assert [v.version for v in ledger.all()] == [0, 1]
    store.close()


def test_no_group_with_two_samples_is_named_as_such(tiny_peft_model, tmp_path):
    from selfrl.rl.advantages import group_advantages

    cycle, ledger, store = make_cycle(tiny_peft_model, tmp_path)
    trajs = trajectories(tiny_peft_model, 0.0, groups=("a", "b", "c", "d"))  # rewards spread, one sample per group
    for t, a in zip(trajs, group_advantages([t.reward for t in trajs], [t.group_id for t in trajs]).advantages):
        t.advantage = a
    step = cycle.update(0, trajs, parent=0)
    assert step.result.reason == SkipReason.NO_GROUP
    assert "no group had two or more samples" in step.result.note and "task_key" in step.result.note
    assert "n > 1" in step.result.note
    event = store.events()[-1]
    assert event["kind"] == "skip" and event["data"]["reason"] == "no_group" and "task_key" in event["message"]
    # groups of two with equal rewards are the other cause, named as before
    same = trajectories(tiny_peft_model, 0.0)
    for t in same:
        t.reward, t.advantage = 1.0, 0.0
    assert cycle.update(1, same, parent=0).result.reason == SkipReason.NO_SIGNAL
    store.close()


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def record(step, kl=0.0):
    from selfrl.safety.collapse import UpdateRecord

    return UpdateRecord(step, 0, reward=0.5, entropy=1.0, degenerate=0.0, kl=kl)


def test_a_collapse_backs_off_recovers_and_a_second_one_in_the_window_pauses_never_stops(tiny_peft_model, tmp_path):
    # before: the learning rate only fell, and the 4th collapse of a run stopped it for good
    clock = Clock()
    cc = CollapseConfig(stable_updates=2, stable_s=600.0, window_s=3600.0, max_per_window=1, cooldown_s=900.0)
    cycle, ledger, store = make_cycle(tiny_peft_model, tmp_path, cc, clock)
    lr = lambda: (cycle.learner.cfg.learning_rate, cycle.learner.cfg.beta)  # noqa: E731
    assert cycle.observe(record(0)) == cycle.observe(record(1)) == Observed() and lr() == (1e-2, 0.0)

    observed = cycle.observe(record(2, kl=5.0))  # the kl rule fires: level 1
    msg = observed.rolled_back
    assert observed.stepped_back is None and msg == store.events()[-1]["message"]
    assert "backing off to level 1" in msg and lr() == (5e-3, 0.01) and cycle.check_budget() == 0.0
    # no candidate was trained: the champion sampled the batch, and the message says so (it said "Versions []")
    assert "No candidate since version 0 to roll back (it sampled these rollouts), serving version 0" in msg
    event = store.events()[-1]
    assert event["kind"] == "collapse" and event["data"]["action"] == "backoff" and event["data"]["level"] == 1
    assert cycle.backoff()["backing_off"] and cycle.backoff()["next_step_back_after_updates"] == 2

    clock.t += 10
    assert cycle.observe(record(3)) == Observed() and lr() == (5e-3, 0.01)
    observed = cycle.observe(record(4))  # the stable stretch: back to the configured setting
    assert lr() == (1e-2, 0.0) and observed.rolled_back is None
    event = store.events()[-1]
    assert event["kind"] == "step_back" and event["data"]["level"] == 0 and not cycle.backoff()["backing_off"]
    assert observed.stepped_back == event["message"] == ("iteration 4: stable since the last collapse or step: "
                                                         "backoff level 0, learning rate 0.01, beta 0")

    clock.t += 100  # a second collapse within the hour: more than max_per_window = 1, a cool-down
    msg = cycle.observe(record(5, kl=5.0)).rolled_back
    assert "paused for 900 s" in msg and lr() == (5e-3, 0.01)
    assert cycle.check_budget() == 900.0 and cycle.backoff()["paused_until"] == 1110.0 + 900.0
    clock.t += 899
    assert cycle.check_budget() == 1.0
    clock.t += 1
    assert cycle.check_budget() == 0.0 and not cycle.budget.stopped  # learning resumes at level 1

    # a restart rebuilds the budget from the recorded events (at their budget-clock times)
    again, _, _ = make_cycle(tiny_peft_model, tmp_path, cc, clock, store=store)
    store.log_metrics(ledger.run_id, 6, {"reward/mean": 0.5})  # one update after the last collapse
    assert again.resume(store) == 2
    b = again.backoff()
    assert (b["level"], b["collapses"], b["collapses_in_window"], b["next_step_back_after_updates"]) == (1, 2, 2, 1)
    assert (again.learner.cfg.learning_rate, again.learner.cfg.beta) == (5e-3, 0.01)
    store.close()


def test_max_rollbacks_asks_for_the_old_stop(tiny_peft_model, tmp_path):
    from selfrl.safety.collapse import CollapseStop

    cycle, _, store = make_cycle(tiny_peft_model, tmp_path, CollapseConfig(max_rollbacks=1), Clock())
    cycle.observe(record(0, kl=5.0))
    assert cycle.check_budget() == 0.0
    cycle.observe(record(1, kl=5.0))
    with pytest.raises(CollapseStop, match="2 collapse rollbacks exceed collapse.max_rollbacks = 1"):
        cycle.check_budget()
    assert store.events()[-1]["kind"] == "collapse_stop"
    store.close()
