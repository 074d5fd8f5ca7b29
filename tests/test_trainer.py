"""The learner on the tiny model, from trajectories really sampled by the engine.

The adapter uses peft's default initialisation (A random, B = 0), as a real run
does, so the policy starts exactly at the base model.
"""

import math

import pytest
import torch

from selfrl.record.adapters import lora_state
from selfrl.engines.reference import Engine
from selfrl.rl.batch import collate
from selfrl.rollout.agent import RolloutConfig, rollout
from selfrl.core.tasks import Task
from selfrl.core.tools import CALCULATOR
from selfrl.rl.learner import Learner, TrainConfig
from selfrl.core.trajectory import Trajectory

TEMPERATURE = 0.7
TASKS = [Task.make("test", "What is 17+25?", "42"), Task.make("test", "What is 2+2?", "4")]


@pytest.fixture
def policy(tiny_model_factory):
    return tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)


def sample(model, tok, n_per_task=3, seed=0):
    """``n_per_task`` sampled trajectories per task, advantages alternating +1 / -1."""
    engine = Engine(model, tok)
    cfg = RolloutConfig(max_turns=2, max_new_tokens=12, temperature=TEMPERATURE)
    tasks = [t for t in TASKS for _ in range(n_per_task)]
    torch.manual_seed(seed)
    trajs = rollout(engine, tasks, [t.id for t in tasks], [CALCULATOR], cfg)
    for i, t in enumerate(trajs):
        t.advantage = 1.0 if i % 2 == 0 else -1.0
    assert sum(t.num_completion_tokens for t in trajs) > len(trajs)  # not all one-token turns
    return trajs


def learner(model, tok, **kw):
    cfg = TrainConfig(**{"beta": 0.0, "micro_batch_size": 4, "learning_rate": 1e-2, **kw})
    return Learner(model, cfg, TEMPERATURE, tok.pad_token_id, max_completion_length=24)


def params(model, kind):
    """Detached copies of the named parameters: ``lora_A``, ``lora_B`` or ``base`` (all others)."""
    out = {}
    for name, p in model.named_parameters():
        is_kind = ("lora_" not in name) if kind == "base" else (f"{kind}." in name)
        if is_kind:
            out[name] = p.detach().clone()
    return out


def changed(before, model):
    now = dict(model.named_parameters())
    return {k for k, v in before.items() if not torch.equal(v, now[k])}


def test_default_init_trains_b_first_then_a_and_never_the_base(policy, tiny_tokenizer):
    a0, b0, base0 = params(policy, "lora_A"), params(policy, "lora_B"), params(policy, "base")
    assert len(a0) == len(b0) == 14  # 7 linear layers x 2 decoder layers, lm_head excluded
    assert all(not v.any() for v in b0.values())  # peft's default: B = 0, the adapter is a no-op
    trajs = sample(policy, tiny_tokenizer)
    lr = learner(policy, tiny_tokenizer)

    m1 = lr.step(trajs)
    assert not m1.skipped and m1.stats["num_sequences"] == len(trajs) and m1.stats["grad_norm"] > 0
    # dL/dA = scale * B^T dL/dy = 0 while B = 0, and AdamW moves a parameter with zero gradient
    # (and no weight decay) by exactly 0: after the first step every B has moved and no A has.
    assert changed(b0, policy) == set(b0)
    assert changed(a0, policy) == set()
    # the second step sees B != 0, so every A gets a gradient and moves
    b1 = params(policy, "lora_B")
    m2 = lr.step(trajs)
    assert not m2.skipped
    assert changed(a0, policy) == set(a0)
    assert changed(b1, policy) == set(b1)
    assert changed(base0, policy) == set()  # the base model is frozen throughout
    assert all(not p.requires_grad for n, p in policy.named_parameters() if "lora_" not in n)


def test_first_ratio_is_one_for_the_sampling_policy(policy, tiny_tokenizer):
    trajs = sample(policy, tiny_tokenizer)
    m = learner(policy, tiny_tokenizer).step(trajs)
    # the learner recomputes the sampling logprobs at the sampling temperature: ratio 1, nothing clipped
    assert m.stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m.stats["clip_ratio"] == 0.0
    assert m.stats["num_tokens"] == sum(t.num_completion_tokens for t in trajs)
    # dapo on the first step: loss = -sum_i A_i * n_i / N with ratio 1 (n_i completion tokens of i)
    expected = -sum(t.advantage * t.num_completion_tokens for t in trajs) / m.stats["num_tokens"]
    assert m.stats["loss"] == pytest.approx(expected, abs=1e-4)


def test_batch_without_signal_is_skipped_without_a_forward(policy, tiny_tokenizer, monkeypatch):
    trajs = sample(policy, tiny_tokenizer)
    for i, t in enumerate(trajs):
        t.advantage = None if i == 0 else 0.0
    before = lora_state(policy)

    def no_forward(*a, **k):
        raise AssertionError("a batch without signal must not run the model")

    monkeypatch.setattr("selfrl.rl.learner.per_token_logps", no_forward)
    m = learner(policy, tiny_tokenizer).step(trajs)
    assert m.skipped and m.reason == "no_signal" and m.stats["num_sequences"] == 0.0
    after = lora_state(policy)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_nan_in_old_logprobs_skips_the_update(policy, tiny_tokenizer):
    trajs = sample(policy, tiny_tokenizer)
    t = trajs[1]
    pos = t.completion_mask.index(1)
    original, t.logprobs[pos] = t.logprobs[pos], float("nan")
    before = lora_state(policy)
    lr = learner(policy, tiny_tokenizer)
    m = lr.step(trajs)
    assert m.skipped and m.reason == "not_finite" and math.isnan(m.stats["loss"])
    after = lora_state(policy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not policy.training
    # the learner is still usable: the same batch without the NaN trains
    t.logprobs[pos] = original
    assert not lr.step(trajs).skipped


def test_kl_to_the_base_is_zero_first_then_grows(policy, tiny_tokenizer):
    trajs = sample(policy, tiny_tokenizer)
    lr = learner(policy, tiny_tokenizer, beta=0.1)
    kls = [lr.step(trajs).stats["kl"] for _ in range(3)]
    # step 0: policy == base (B = 0), so logp == ref_logp on every token and k3 = e^0 - 0 - 1 = 0
    assert kls[0] == pytest.approx(0.0, abs=1e-7)
    assert kls[1] > 1e-5 and kls[2] > kls[1]


def test_reference_state_matches_disabled_adapter_for_the_zero_b_start(policy, tiny_tokenizer):
    start = lora_state(policy)  # B = 0: the reference is the base model
    trajs = sample(policy, tiny_tokenizer)
    lr_base = learner(policy, tiny_tokenizer, beta=0.1)
    for _ in range(2):
        lr_base.step(trajs)  # move away from the reference
    trained = lora_state(policy)
    assert any(not torch.equal(start[k], trained[k]) for k in start)
    lr_state = learner(policy, tiny_tokenizer, beta=0.1)
    lr_state.ref_state = start
    ids_before = [id(p) for p in lr_state.params]

    mb = collate(trajs, tiny_tokenizer.pad_token_id)
    ref_disabled = lr_base._ref_logps(mb)  # (B, T) via disable_adapter()
    ref_from_state = lr_state._ref_logps(mb)  # (B, T) via copying the start state in and back out
    torch.testing.assert_close(ref_from_state, ref_disabled, atol=1e-6, rtol=0)
    # the trained weights are back in place, in the same parameter objects the optimizer holds
    after = lora_state(policy)
    assert all(torch.equal(trained[k], after[k]) for k in trained)
    assert [id(p) for p in dict(policy.named_parameters()).values() if p.requires_grad] == ids_before
    # and the reference is not the current policy (the comparison above is not vacuous)
    from selfrl.rl.logprobs import per_token_logps

    with torch.no_grad():
        current = per_token_logps(policy, mb.input_ids, mb.attention_mask, mb.completion_mask, TEMPERATURE)
    assert (current - ref_disabled).abs().max() > 1e-3


def test_non_finite_second_pass_restores_the_first_passs_update(policy, tiny_tokenizer):
    # num_iterations = 2: the first pass steps the optimizer; a non-finite loss in the second
    # must not leave that half-update behind, or the weights would change with no new version.
    trajs = sample(policy, tiny_tokenizer)
    lr = learner(policy, tiny_tokenizer, num_iterations=2, micro_batch_size=len(trajs))  # one micro-batch per pass
    lr.step(trajs)  # some optimizer state to restore as well
    before = lora_state(policy)
    state_before = {k: v.clone() for k, v in lr.optimizer.state_dict()["state"][0].items()}
    aggregate, calls = lr.aggregate, []

    def nan_on_second_pass(loss, mask, norm):
        calls.append(1)
        out = aggregate(loss, mask, norm)
        return out * float("nan") if len(calls) == 2 else out

    lr.aggregate = nan_on_second_pass
    m = lr.step(trajs)
    assert len(calls) == 2 and m.skipped and m.reason == "not_finite"
    after = lora_state(policy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    state_after = lr.optimizer.state_dict()["state"][0]
    assert all(torch.equal(state_before[k], state_after[k]) for k in state_before)


def test_reset_optimizer_forgets_adam_moments():
    import torch

    from selfrl.rl.learner import Learner, TrainConfig

    model = torch.nn.Linear(2, 1)
    learner = Learner(model, TrainConfig(), temperature=1.0, pad_token_id=0, max_completion_length=4)
    model(torch.ones(1, 2)).sum().backward()
    learner.optimizer.step()
    assert len(learner.optimizer.state) == 2  # weight and bias have moments
    learner.reset_optimizer()
    assert len(learner.optimizer.state) == 0


# ---------------------------------------------------------------- anomaly skip and injected faults


def adam_state(lr):
    return {i: {k: v.clone() for k, v in s.items()} for i, s in lr.optimizer.state_dict()["state"].items()}


def assert_untouched(policy, lr, weights, state):
    """Weights and AdamW moments exactly as they were before the skipped step."""
    after = lora_state(policy)
    assert all(torch.equal(weights[k], after[k]) for k in weights)
    now = adam_state(lr)
    assert now.keys() == state.keys()
    assert all(torch.equal(state[i][k], now[i][k]) for i in state for k in state[i])
    assert not policy.training


@pytest.fixture
def fault_env(monkeypatch):
    from selfrl.core import faults

    def inject(spec, iteration):
        monkeypatch.setenv(faults.ENV, spec)
        faults.set_iteration(iteration)

    yield inject
    faults.set_iteration(-1)


def test_reward_spread_beyond_the_threshold_skips_before_the_forward(policy, tiny_tokenizer, monkeypatch):
    trajs = sample(policy, tiny_tokenizer)
    for i, t in enumerate(trajs):
        t.reward = 0.0 if i else 50.0  # a broken reward function
    weights = lora_state(policy)

    def no_forward(*a, **k):
        raise AssertionError("a skipped batch must not run the model")

    monkeypatch.setattr("selfrl.rl.learner.per_token_logps", no_forward)
    m = learner(policy, tiny_tokenizer, skip_max_reward_spread=10.0).step(trajs)
    assert m.skipped and m.reason == "reward_spread" and m.stats["reward_spread"] == 50.0
    assert all(torch.equal(weights[k], v) for k, v in lora_state(policy).items())


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_kl_beyond_the_threshold_skips_and_leaves_weights_and_adam_state(policy, tiny_tokenizer, num_iterations):
    trajs = sample(policy, tiny_tokenizer)
    lr = learner(policy, tiny_tokenizer, beta=0.1, num_iterations=num_iterations)
    first = lr.step(trajs)  # KL 0 at the start (B = 0); moves the policy and fills the Adam moments
    assert not first.skipped
    probe = lr.step(trajs)
    assert not probe.skipped and probe.stats["kl"] > 1e-5
    weights, state = lora_state(policy), adam_state(lr)
    lr.cfg.skip_max_kl = probe.stats["kl"] / 10  # the next measured KL is larger than the last one
    m = lr.step(trajs)
    assert m.skipped and m.reason == "kl" and m.stats["kl"] > lr.cfg.skip_max_kl
    assert_untouched(policy, lr, weights, state)


def test_grad_norm_beyond_the_threshold_skips(policy, tiny_tokenizer):
    trajs = sample(policy, tiny_tokenizer)
    lr = learner(policy, tiny_tokenizer)
    lr.step(trajs)
    weights, state = lora_state(policy), adam_state(lr)
    lr.cfg.skip_max_grad_norm = 1e-9
    m = lr.step(trajs)
    assert m.skipped and m.reason == "grad_norm" and m.stats["grad_norm"] > 1e-9
    assert_untouched(policy, lr, weights, state)


def test_injected_nan_loss_is_skipped_at_its_iteration_only(policy, tiny_tokenizer, fault_env):
    trajs = sample(policy, tiny_tokenizer)
    lr = learner(policy, tiny_tokenizer)
    lr.step(trajs)
    weights, state = lora_state(policy), adam_state(lr)
    fault_env("nan_loss@5", 5)
    m = lr.step(trajs)
    assert m.skipped and m.reason == "not_finite" and math.isnan(m.stats["loss"])
    assert_untouched(policy, lr, weights, state)
    fault_env("nan_loss@5", 6)
    assert not lr.step(trajs).skipped


def test_injected_lr_x1000_makes_one_step_a_thousand_times_larger(tiny_model_factory, tiny_tokenizer, fault_env):
    # AdamW's first step moves each weight by about lr (m / sqrt(v) = sign(g)), so the ratio is ~1000
    a = tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)
    b = tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)
    trajs = sample(a, tiny_tokenizer)
    start = lora_state(a)
    la, lb = learner(a, tiny_tokenizer, learning_rate=1e-5), learner(b, tiny_tokenizer, learning_rate=1e-5)
    la.step(trajs)
    fault_env("lr_x1000@2", 2)
    lb.step(trajs)
    moved_a = max((lora_state(a)[k] - start[k]).abs().max() for k in start)
    moved_b = max((lora_state(b)[k] - start[k]).abs().max() for k in start)
    assert 900 < moved_b / moved_a < 1100
    assert lb.optimizer.param_groups[0]["lr"] == 1e-5  # back to the configured rate after the step


def test_set_hyperparameters_reaches_the_optimizer(policy, tiny_tokenizer):
    lr = learner(policy, tiny_tokenizer, learning_rate=1e-3, beta=0.0)
    lr.set_hyperparameters(5e-4, 0.02)
    assert lr.cfg.learning_rate == 5e-4 and lr.cfg.beta == 0.02
    assert [g["lr"] for g in lr.optimizer.param_groups] == [5e-4]


def flat(result):
    """The flat metrics of ``Learner.step``'s result (a dict, or a typed result with ``metrics()``)."""
    return result.metrics() if hasattr(result, "metrics") else result


def test_engine_logprobs_match_the_learner_so_the_correction_is_one(policy, tiny_tokenizer):
    # the engine's sampled logprobs are the learner's own (same weights, same fp32 numerics, but other
    # batch shapes), so the off-policy weight is 1 up to float noise and the mismatch KL about 0
    trajs = sample(policy, tiny_tokenizer)
    m = flat(learner(policy, tiny_tokenizer).step(trajs))
    assert m["mismatch_kl"] < 1e-10
    assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m["tis_capped"] == 0.0


# ---------------------------------------------------------------- nothing to train on (issue 17, case 1)


def empty_copy(t, advantage=1.0):
    """``t`` with every token masked (nothing to train on), as a sample that got an advantage anyway."""
    e = Trajectory.from_dict(t.to_dict())
    e.id, e.advantage = e.id + "-empty", advantage
    e.completion_mask, e.logprobs = [0] * len(e.token_ids), [0.0] * len(e.token_ids)
    return e


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_sequence_without_trainable_tokens_never_reaches_the_loss_or_its_normaliser(tiny_model_factory, tiny_tokenizer,
                                                                                   loss_type):
    a = tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)
    b = tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)
    trajs = sample(a, tiny_tokenizer)
    ma = flat(learner(a, tiny_tokenizer, loss_type=loss_type).step(trajs))
    empties = [empty_copy(trajs[0]), empty_copy(trajs[1], -1.0)]
    mb = flat(learner(b, tiny_tokenizer, loss_type=loss_type).step(trajs + empties))
    # grpo divided by 8 sequences instead of 6 and dr_grpo by 8 * 24 instead of 6 * 24
    assert mb["num_sequences"] == ma["num_sequences"] == len(trajs)
    assert (mb["loss"], mb["grad_norm"], mb["num_tokens"]) == (ma["loss"], ma["grad_norm"], ma["num_tokens"])
    after_a, after_b = lora_state(a), lora_state(b)
    assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)


def test_signal_only_on_sequences_without_tokens_skips_with_its_own_reason(policy, tiny_tokenizer, monkeypatch):
    trajs = [empty_copy(t, 1.0 if i % 2 else -1.0) for i, t in enumerate(sample(policy, tiny_tokenizer))]

    def no_forward(*a, **k):
        raise AssertionError("nothing to train on: the model must not run")

    monkeypatch.setattr("selfrl.rl.learner.per_token_logps", no_forward)
    m = flat(learner(policy, tiny_tokenizer).step(trajs))
    assert m["skipped"] == 1.0 and m["skip_reason_no_tokens"] == 1.0 and m["num_sequences"] == 0.0


def test_logps_of_a_micro_batch_without_completion_tokens_stay_in_the_graph(policy, tiny_tokenizer):
    from selfrl.rl.logprobs import per_token_logps

    mb = collate([empty_copy(t) for t in sample(policy, tiny_tokenizer)[:2]], tiny_tokenizer.pad_token_id)
    logps = per_token_logps(policy, mb.input_ids, mb.attention_mask, mb.completion_mask, TEMPERATURE)
    assert torch.equal(logps, torch.zeros_like(logps))
    logps.sum().backward()  # used to raise: the zeros had no grad_fn
    grads = [p.grad for p in policy.parameters() if p.requires_grad]
    assert all(g is None or not g.any() for g in grads)


def test_settings_the_update_divides_by_must_be_positive(policy, tiny_tokenizer):
    from selfrl.rl.logprobs import per_token_logps

    with pytest.raises(ValueError, match="temperature must be > 0"):
        Learner(policy, TrainConfig(), 0.0, tiny_tokenizer.pad_token_id, max_completion_length=24)
    mb = collate(sample(policy, tiny_tokenizer)[:1], tiny_tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        per_token_logps(policy, mb.input_ids, mb.attention_mask, mb.completion_mask, 0.0)
    with pytest.raises(ValueError, match="tis_cap"):
        Learner(policy, TrainConfig(tis_cap=-1.0), 1.0, tiny_tokenizer.pad_token_id, max_completion_length=24)
    with pytest.raises(ValueError, match="max_completion_length"):  # dr_grpo's divisor
        Learner(policy, TrainConfig(loss_type="dr_grpo"), 1.0, tiny_tokenizer.pad_token_id, max_completion_length=0)


# ---------------------------------------------------------------- an extreme KL token (issue 17, case 3)


def test_an_extreme_kl_token_is_bounded_not_thrown_away(policy, tiny_tokenizer, monkeypatch):
    # policy logprob 100 below the reference's on one token per micro-batch (d = ref - logp = 100), beta 0.04:
    # exp(100) overflowed float32, the loss was inf and the update was skipped as not finite
    from selfrl.rl.logprobs import per_token_logps

    trajs = sample(policy, tiny_tokenizer)
    lr = learner(policy, tiny_tokenizer, beta=0.04, skip_max_kl=100.0)

    def far_reference(mb):
        with torch.no_grad():
            ref = per_token_logps(policy, mb.input_ids, mb.attention_mask, mb.completion_mask, TEMPERATURE)
        col = int(mb.completion_mask[0].nonzero()[0])
        ref[0, col] += 100.0
        return ref

    monkeypatch.setattr(lr, "_ref_logps", far_reference)
    before = lora_state(policy)
    m = flat(lr.step(trajs))
    assert m["skipped"] == 0.0 and math.isfinite(m["loss"])
    # that token's k3 is capped at 10; every other token's reference is the policy itself (k3 = 0)
    micro_batches = -(-len(trajs) // 4)
    assert m["kl"] == pytest.approx(10.0 * micro_batches / m["num_tokens"], abs=1e-5)
    assert any(not torch.equal(before[k], v) for k, v in lora_state(policy).items())


# ---------------------------------------------------------------- off-policy correction (issue 15, part 4)


def with_learner_logprobs(model, tok, trajs):
    """``trajs`` with their recorded logprobs replaced by the learner's own, computed on the one
    micro-batch that ``Learner.step`` builds (sorted by length, all in one): the same numerics, bit for bit."""
    from selfrl.rl.logprobs import per_token_logps

    trajs = sorted(trajs, key=lambda t: len(t.token_ids))
    mb = collate(trajs, tok.pad_token_id)
    with torch.no_grad():
        logps = per_token_logps(model, mb.input_ids, mb.attention_mask, mb.completion_mask, TEMPERATURE)  # (B, T)
    for j, t in enumerate(trajs):
        t.logprobs = logps[j, :len(t.token_ids)].tolist()
    return trajs


def test_correction_is_exactly_one_and_the_update_unchanged_in_the_same_numerics(tiny_model_factory, tiny_tokenizer):
    a = tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)
    b = tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)
    trajs = with_learner_logprobs(a, tiny_tokenizer, sample(a, tiny_tokenizer))
    n = len(trajs)
    ma = flat(learner(a, tiny_tokenizer, micro_batch_size=n).step(trajs))  # tis_cap 2.0, the default
    mb = flat(learner(b, tiny_tokenizer, micro_batch_size=n, tis_cap=0.0).step(trajs))  # no correction
    assert ma["tis_weight_mean"] == 1.0 and ma["tis_capped"] == 0.0 and ma["mismatch_kl"] == 0.0
    assert "tis_weight_mean" not in mb and mb["mismatch_kl"] == 0.0
    assert (ma["loss"], ma["grad_norm"]) == (mb["loss"], mb["grad_norm"])
    after_a, after_b = lora_state(a), lora_state(b)
    assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)


def test_correction_weights_the_policy_gradient_by_hand(tiny_model_factory, tiny_tokenizer):
    # the sampler gave trajectory 0 (A = +1) log-probs 1 lower than the learner: w = min(e^1, 2) = 2 (capped);
    # trajectory 1 (A = -1) 0.5 higher: w = e^-0.5 = 0.606531; the others agree: w = 1
    a = tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)
    b = tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)
    trajs = with_learner_logprobs(a, tiny_tokenizer, sample(a, tiny_tokenizer))
    for t, a_i in zip(trajs, [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]):
        t.advantage = a_i
    shifted = [Trajectory.from_dict(t.to_dict()) for t in trajs]
    for t, shift in ((shifted[0], -1.0), (shifted[1], 0.5)):
        t.logprobs = [lp + shift * m for lp, m in zip(t.logprobs, t.completion_mask)]
    n = [t.num_completion_tokens for t in trajs]
    N = sum(n)
    w = [2.0, math.exp(-0.5), 1.0, 1.0, 1.0, 1.0]
    m = flat(learner(a, tiny_tokenizer, micro_batch_size=len(trajs)).step(shifted))
    # first pass: the PPO ratio is against the learner's own log-probs, so it is 1 and nothing is clipped;
    # dapo: loss = -sum_i w_i A_i n_i / N
    assert m["ratio_mean"] == 1.0 and m["clip_ratio"] == 0.0
    assert m["loss"] == pytest.approx(-sum(wi * t.advantage * ni for wi, t, ni in zip(w, trajs, n)) / N, abs=1e-5)
    assert m["tis_weight_mean"] == pytest.approx(sum(wi * ni for wi, ni in zip(w, n)) / N, abs=1e-5)
    assert m["tis_capped"] == pytest.approx(n[0] / N, abs=1e-7)
    # KL(sampler || learner), k3 with log r = old - sampler = +1 and -0.5: e - 2 and e^-0.5 - 0.5
    assert m["mismatch_kl"] == pytest.approx(((math.e - 2) * n[0] + (math.exp(-0.5) - 0.5) * n[1]) / N, abs=1e-5)
    # the same update as no correction on unshifted data with the advantages scaled by w
    scaled = [Trajectory.from_dict(t.to_dict()) for t in trajs]
    for t, wi in zip(scaled, w):
        t.advantage *= wi
    ref = flat(learner(b, tiny_tokenizer, micro_batch_size=len(trajs), tis_cap=0.0).step(scaled))
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    after_a, after_b = lora_state(a), lora_state(b)
    assert all(torch.allclose(after_a[k], after_b[k], atol=1e-7, rtol=0) for k in after_a)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_update_through_the_packed_tree_equals_the_update_through_the_rows(tiny_model_factory, tiny_tokenizer,
                                                                         monkeypatch, beta):
    """The learner's whole update (policy pass, gradient, reference pass for the KL) is the same
    whichever way its batches are encoded (selfrl.rl.tree); on the tiny model the automatic
    choice takes the rows, so each way is forced here."""
    import selfrl.rl.learner as learner_module
    from selfrl.rl.logprobs import per_token_logps

    trajs = sample(tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True), tiny_tokenizer)
    out = {}
    for layout in ("tree", "rows"):
        model = tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)
        monkeypatch.setattr(learner_module, "per_token_logps",
                            lambda *a, layout=layout, **k: per_token_logps(*a, layout=layout, **k))
        lr = learner(model, tiny_tokenizer, beta=beta, num_iterations=2)
        first = lr.step(trajs).metrics()
        second = lr.step(trajs).metrics()  # from moved weights: the KL and the ratio are no longer trivial
        out[layout] = (first, second, lora_state(model))
    for a, b in zip(out["tree"][:2], out["rows"][:2]):
        for k in ("loss", "kl", "ratio_mean", "grad_norm", "num_tokens"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    if beta:
        assert out["tree"][1]["kl"] > 0
    for k, v in out["rows"][2].items():
        torch.testing.assert_close(out["tree"][2][k], v, atol=1e-4, rtol=0)


@pytest.mark.parametrize("takes_tree", [True, False])
def test_micro_batches_follow_token_order_for_a_tree_and_length_order_otherwise(policy, tiny_tokenizer, monkeypatch,
                                                                               takes_tree):
    import selfrl.rl.learner as learner_module
    from selfrl.rl.logprobs import per_token_logps

    trajs = sample(policy, tiny_tokenizer)
    seen = []

    def recording(model, input_ids, attention_mask, *a, **k):
        seen.append([input_ids[i, :n].tolist() for i, n in enumerate(attention_mask.sum(dim=1).tolist())])
        return per_token_logps(model, input_ids, attention_mask, *a, **k)

    monkeypatch.setattr(learner_module, "tree_by_default", lambda decoder: takes_tree)
    monkeypatch.setattr(learner_module, "per_token_logps", recording)
    learner(policy, tiny_tokenizer).step(trajs)
    rows = [r for mb in seen for r in mb]  # beta 0: one pass, micro-batches of 4 then 2
    ids = [t.token_ids for t in trajs]
    assert [len(r) for r in sorted(ids)] != sorted(map(len, ids))  # the two orders differ on this sample
    expected = sorted(ids, key=None if takes_tree else len)
    assert [len(mb) for mb in seen] == [4, 2]
    if takes_tree:
        assert rows == expected
    else:
        assert [len(r) for r in rows] == [len(r) for r in expected]


def test_a_token_budget_cuts_long_rows_into_more_micro_batches_with_the_same_update(tiny_model_factory, tiny_tokenizer):
    # train.micro_batch_tokens: the forward/backward of a batch of long turns (a web episode's
    # worked examples) held 22 GB in a soak and the kernel killed the server; the same rows in
    # micro-batches of at most N padded tokens give the same loss, gradient and weights
    a = tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)
    b = tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True)
    trajs = sample(a, tiny_tokenizer)
    longest = max(len(t.token_ids) for t in trajs)
    shapes = []

    def record(la):
        def collate(chunk):
            mb = la.__class__._collate(la, chunk)
            shapes.append(tuple(mb.input_ids.shape))
            return mb
        la._collate = collate
        return la

    la = record(learner(a, tiny_tokenizer, micro_batch_size=len(trajs)))
    ma = flat(la.step(trajs))
    whole = shapes[:]
    shapes.clear()
    lb = record(learner(b, tiny_tokenizer, micro_batch_size=len(trajs), micro_batch_tokens=2 * longest))
    mb = flat(lb.step(trajs))
    assert len(whole) == 1 and len(shapes) >= len(trajs) // 2 and all(r * t <= 2 * longest for r, t in shapes)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5) and ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-4)
    after_a, after_b = lora_state(a), lora_state(b)
    diff = max(float((after_a[k] - after_b[k]).abs().max()) for k in after_a)
    assert diff < 1e-4, diff  # AdamW's first step moves each weight by about lr = 1e-2: the same update
