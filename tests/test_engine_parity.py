"""Distribution parity: the slot engine samples from the same distribution as the reference.

The conformance suite checks that each backend *records* exact logprobs; it cannot see a
backend that samples from another distribution (a temperature or nucleus applied twice,
per-row seeds correlated within a GRPO group, a turn cut or continued differently). Here
both backends sample many completions of fixed prompts from one tiny model, and two-sample
tests (:mod:`selfrl.engines.two_sample`) compare what they drew: first tokens and later tokens per
prompt (chi-square), lengths with the finish reason, the share of distinct completions per
group, and, through :func:`selfrl.rollout.agent.rollout` with tools (the path ``selfrl run``
takes: batched turns on the reference, pipelined ``submit`` with per-row seeds on the slot
engine), turn counts, tool calls, the second turn's first token and the label-free rewards.

Every draw is seeded, so each test is deterministic; a test fails when a p-value is under
``ALPHA``. The tests that end in ``_detects_...`` show the same statistics do fail on a real
difference (a temperature of 0.8 against 1.0, a nucleus of 0.8, group members that share a
seed), so a pass means something.

The tiny model's output layer is sharpened (x3) and biased towards EOS and two added tokens,
a whole calculator call and a whole answer, so that its turns end, call the tool (which runs)
and answer, and its distributions are peaked enough for the tests to have power.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from selfrl.engines.reference import Engine
from selfrl.engines.slots import SlotEngine
from selfrl.engines.two_sample import (
    TwoSampleResult,
    chi_square_homogeneity,
    combine_chi_square,
    ks_uniform,
    mann_whitney,
    sampling_pit,
)

ALPHA = 1e-3
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
ANSWER = "<answer>3</answer>"
MAX_NEW = 8
GROUP = 8  # num_generations
QUESTIONS = ["What is 1+2?", "Add 17 and 25.", "Name a colour.", "Count to three."]


def _parity_model():
    from selfrl.testing import add_lora, build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_tokens([CALL, ANSWER])
    call_id, answer_id = tok.convert_tokens_to_ids([CALL, ANSWER])
    model = build_tiny_model(tok, seed=3, eos_bias=5.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # peakier next-token distributions
        model.lm_head.bias[call_id] = 8.0
        model.lm_head.bias[answer_id] = 6.0
    return add_lora(model, seed=4), tok


@pytest.fixture(scope="module")
def engines():
    model, tok = _parity_model()
    reference, slots = Engine(model, tok), SlotEngine(model, tok, max_slots=64)
    yield reference, slots
    slots.close()


def _prompts(tok) -> list[list[int]]:
    from selfrl.chat.template import prompt_ids

    system = {"role": "system", "content": "You are a careful assistant. Use the calculator tool for arithmetic."}
    return [prompt_ids(tok, [system, {"role": "user", "content": q}]) for q in QUESTIONS]


def _sample(engine, prompts, per_prompt: int, seed: int, temperature: float = 1.0, top_p: float = 1.0):
    """``per_prompt`` continuations of each prompt in one call: {prompt index: [Generation]}."""
    torch.manual_seed(seed)
    gens = engine.generate([p for p in prompts for _ in range(per_prompt)], MAX_NEW, temperature, top_p=top_p)
    return {k: gens[k * per_prompt:(k + 1) * per_prompt] for k in range(len(prompts))}


def _token_at(gens, pos: int) -> list[int]:
    return [g.token_ids[pos] for g in gens if len(g.token_ids) > pos]


def _per_prompt(a: dict, b: dict, feature) -> TwoSampleResult:
    """One chi-square over every prompt: ``feature(gens) -> categories``, per prompt, added up."""
    return combine_chi_square([chi_square_homogeneity(feature(a[k]), feature(b[k])) for k in a])


def _distinct_share(gens) -> list[float]:
    """Per group of ``GROUP`` consecutive rows: distinct completions / GROUP."""
    return [len({tuple(g.token_ids) for g in gens[i:i + GROUP]}) / GROUP for i in range(0, len(gens), GROUP)]


def _parity(a: dict, b: dict) -> dict[str, float]:
    """The p-values of every comparison between two engines' draws."""
    return {
        "first token": _per_prompt(a, b, lambda gs: _token_at(gs, 0)).p_value,
        "second token": _per_prompt(a, b, lambda gs: _token_at(gs, 1)).p_value,
        "fourth token": _per_prompt(a, b, lambda gs: _token_at(gs, 3)).p_value,
        "length and finish": _per_prompt(a, b, lambda gs: [(len(g.token_ids), g.finished) for g in gs]).p_value,
        "length (U test)": mann_whitney([len(g.token_ids) for k in a for g in a[k]],
                                        [len(g.token_ids) for k in b for g in b[k]]).p_value,
        "distinct per group": mann_whitney([s for k in a for s in _distinct_share(a[k])],
                                           [s for k in b for s in _distinct_share(b[k])]).p_value,
    }


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9)])
def test_generate_draws_the_reference_distribution(engines, temperature, top_p):
    reference, slots = engines
    prompts = _prompts(reference.tokenizer)
    a = _sample(reference, prompts, 256, seed=1, temperature=temperature, top_p=top_p)
    b = _sample(slots, prompts, 256, seed=2, temperature=temperature, top_p=top_p)
    p = _parity(a, b)
    assert min(p.values()) > ALPHA, p
    # the draws are diverse enough for the tests to mean something
    assert len({g.token_ids[0] for g in b[0]}) >= 10
    # (prompt 0 finishes in 9-16 % of 256 draws at temperature 0.7 on either engine, seeds 1-4)
    assert 0.05 < sum(g.finished for g in b[0]) / 256 < 0.95


def pit_p(model, prompts, drawn: dict, temperature: float) -> float:
    """KS p-value of the randomized PITs of every sampled id under ``softmax(logits / temperature)``
    recomputed by a plain forward pass (i.i.d. uniform for a correct sampler, whatever the model)."""
    gen = torch.Generator().manual_seed(0)
    pits = []
    with torch.no_grad():
        for k, gens in drawn.items():
            for g in gens[:64]:
                ids = torch.tensor([prompts[k] + g.token_ids])  # (1, L)
                logits = model(input_ids=ids).logits[0, len(prompts[k]) - 1:-1].float() / temperature  # (n, V)
                pits += sampling_pit(torch.softmax(logits, -1), torch.tensor(g.token_ids),
                                     torch.rand(len(g.token_ids), generator=gen)).tolist()
    return ks_uniform(pits).p_value


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_each_engine_samples_softmax_of_logits_over_temperature(engines, temperature):
    """Calibration of each sampler on its own (no comparison): the probability integral
    transforms of its draws are uniform, and those of draws at another temperature are not."""
    reference, slots = engines
    prompts = _prompts(reference.tokenizer)
    for engine, seed in ((reference, 5), (slots, 6)):
        drawn = _sample(engine, prompts, 64, seed=seed, temperature=temperature)
        assert pit_p(reference.model, prompts, drawn, temperature) > ALPHA, engine.name
    off = _sample(slots, prompts, 64, seed=6, temperature=temperature * 0.8)
    assert pit_p(reference.model, prompts, off, temperature) < 1e-6


def test_parity_detects_a_wrong_temperature_or_nucleus(engines):
    reference, slots = engines
    prompts = _prompts(reference.tokenizer)
    a = _sample(reference, prompts, 256, seed=1)
    hotter = _parity(a, _sample(slots, prompts, 256, seed=2, temperature=0.8))
    assert hotter["first token"] < 1e-6, hotter
    narrower = _parity(a, _sample(slots, prompts, 256, seed=2, top_p=0.8))
    assert narrower["first token"] < 1e-6, narrower


def _within_group_collisions(labels: list, groups: list[str]) -> int:
    """Pairs of rows in one group with the same label."""
    by = defaultdict(lambda: defaultdict(int))
    for lab, g in zip(labels, groups):
        by[g][lab] += 1
    return sum(c * (c - 1) // 2 for counts in by.values() for c in counts.values())


def independence_p(labels: list, groups: list[str], strata: list, permutations: int = 1999) -> float:
    """Permutation test that rows of one group are no more alike than rows of the same prompt
    in other groups (one-sided: more within-group collisions than chance). Rows are shuffled
    among the groups of their own stratum (the prompt); p = (1 + #{permuted >= observed}) / (1 + n)."""
    observed = _within_group_collisions(labels, groups)
    rng = random.Random(0)
    idx_by_stratum = defaultdict(list)
    for i, s in enumerate(strata):
        idx_by_stratum[s].append(i)
    hits = 0
    for _ in range(permutations):
        shuffled = list(labels)
        for idx in idx_by_stratum.values():
            vals = [labels[i] for i in idx]
            rng.shuffle(vals)
            for i, v in zip(idx, vals):
                shuffled[i] = v
        hits += _within_group_collisions(shuffled, groups) >= observed
    return (1 + hits) / (1 + permutations)


# ------------------------------------------------------------------ rollouts with tools


def _tool_rollouts(engine, seed: int, groups_per_task: int = 12, greedy: bool = False, stop_at_tool_call: bool = True):
    from selfrl.config import RolloutConfig
    from selfrl.envs.rewards import get_preset, score_batch
    from selfrl.rollout.agent import rollout
    from selfrl.envs import get_env
    from selfrl.core.tools import CALCULATOR

    source = get_env("chain_sum")
    tasks = source.sample(3, seed=7)
    batch = [t for t in tasks for _ in range(groups_per_task * GROUP)]
    gids = [f"{t.id}-{j // GROUP}" for t in tasks for j in range(groups_per_task * GROUP)]
    cfg = RolloutConfig(max_new_tokens=MAX_NEW, temperature=1.0, max_turns=3, stop_at_tool_call=stop_at_tool_call)
    torch.manual_seed(seed)
    trajs = rollout(engine, batch, gids, [CALCULATOR], cfg, greedy=greedy)
    score_batch(trajs, {t.id: t for t in tasks}, source, get_preset("label-free"))
    return trajs


def _second_turn_first(tr) -> int | None:
    """The first sampled id of the trajectory's second turn, or None."""
    m = tr.completion_mask
    starts = [i for i in range(tr.prompt_len, len(m)) if m[i] == 1 and m[i - 1] == 0]
    return tr.token_ids[starts[1]] if len(starts) > 1 else None


def _by_task(trajs, feature) -> dict[str, list]:
    out = defaultdict(list)
    for t in trajs:
        v = feature(t)
        if v is not None:
            out[t.task_id].append(v)
    return out


def _rollout_parity(a, b) -> dict[str, float]:
    def per_task(feature) -> float:
        fa, fb = _by_task(a, feature), _by_task(b, feature)
        return combine_chi_square([chi_square_homogeneity(fa[k], fb[k]) for k in fa if fb.get(k)]).p_value

    def spread(trajs) -> list[bool]:
        groups = defaultdict(set)
        for t in trajs:
            groups[t.group_id].add(t.reward)
        return [len(r) == 1 for r in groups.values()]

    def distinct(trajs) -> list[int]:
        groups = defaultdict(set)
        for t in trajs:
            groups[t.group_id].add(tuple(t.token_ids[t.prompt_len:]))
        return [len(s) for s in groups.values()]

    return {
        "first token": per_task(lambda t: t.token_ids[t.prompt_len]),
        "turns, truncated": per_task(lambda t: (t.num_turns, t.truncated)),
        "tool calls ok": per_task(lambda t: tuple(c.ok for c in t.tool_calls)),
        "second turn's first token": per_task(_second_turn_first),
        "completion tokens": mann_whitney([t.num_completion_tokens for t in a],
                                          [t.num_completion_tokens for t in b]).p_value,
        "label-free reward": mann_whitney([t.reward for t in a], [t.reward for t in b]).p_value,
        "zero-spread groups": chi_square_homogeneity(spread(a), spread(b)).p_value,
        "distinct per group": mann_whitney(distinct(a), distinct(b)).p_value,
    }


@pytest.fixture(scope="module", params=[True, False], ids=["stop-at-tool-call", "eos-ends-turns"])
def tool_rollouts(engines, request):
    """Both engines' rollouts of 3 tasks x 12 groups x 8 with the calculator: turns cut at
    ``</tool_call>`` (many turns) or ended by EOS only (the demo's setting: many truncations)."""
    reference, slots = engines
    return (request.param, _tool_rollouts(reference, seed=3, stop_at_tool_call=request.param),
            _tool_rollouts(slots, seed=4, stop_at_tool_call=request.param))


def test_rollouts_with_tools_draw_the_reference_distribution(tool_rollouts):
    stop, a, b = tool_rollouts
    p = _rollout_parity(a, b)
    assert min(p.values()) > ALPHA, p
    # the multi-turn path is exercised: calls that ran, second and third turns, truncations
    for trajs in (a, b):
        ran = sum(any(c.ok for c in t.tool_calls) for t in trajs)
        if stop:
            assert ran > 150 and sum(t.num_turns == 3 for t in trajs) > 100 and sum(t.num_turns == 2 for t in trajs) > 10
        else:
            truncated = sum(t.truncated for t in trajs)  # multi-turn is rare here: EOS seldom follows a call
            assert ran >= 1 and 20 < truncated < len(trajs) - 20, (ran, truncated)


def _first_turn_labels(trajs) -> tuple[list, list[str], list[str]]:
    return ([tuple(t.token_ids[t.prompt_len:t.prompt_len + 2]) for t in trajs], [t.group_id for t in trajs],
            [t.task_id for t in trajs])


def test_group_members_are_independent_draws(tool_rollouts):
    """Rows of one GRPO group (one task, per-row seeds on the slot engine) are no more alike
    than rows of the same task in other groups."""
    for trajs in tool_rollouts[1:]:
        assert independence_p(*_first_turn_labels(trajs)) > ALPHA


def test_independence_detects_group_members_that_share_a_seed(engines):
    _, slots = engines
    prompts = _prompts(slots.tokenizer)
    labels, groups, strata = [], [], []
    torch.manual_seed(0)
    futures = []
    for k, p in enumerate(prompts):
        for g in range(24):
            for i in range(GROUP):  # two members of every group share a seed
                futures.append(slots.submit(p, MAX_NEW, seed=1000 * k + g if i < 2 else None))
                groups.append(f"{k}-{g}")
                strata.append(k)
    labels = [tuple(f.result(timeout=60).token_ids[:2]) for f in futures]
    assert independence_p(labels, groups, strata) < ALPHA


def test_greedy_rollouts_with_tools_are_identical(engines):
    """The mechanics of a multi-turn rollout (tool results appended, turns continued on the
    grown prompt, truncation recorded) are the same on both engines: greedy, token for token."""
    reference, slots = engines
    a = _tool_rollouts(reference, seed=0, groups_per_task=1, greedy=True)
    b = _tool_rollouts(slots, seed=0, groups_per_task=1, greedy=True)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.completion_mask for t in a] == [t.completion_mask for t in b]
    assert [(t.num_turns, t.truncated, t.final_answer) for t in a] == [(t.num_turns, t.truncated, t.final_answer)
                                                                        for t in b]
    for ta, tb in zip(a, b):
        assert torch.allclose(torch.tensor(ta.logprobs), torch.tensor(tb.logprobs), atol=1e-5)
    assert max(t.num_turns for t in a) >= 2  # the tool path ran


def test_per_row_generators_at_a_real_vocabulary_draw_the_batch_distribution():
    """The slot engine's per-row seeded generators (seeded as the rollout seeds them), at
    SmolLM2's vocabulary size, draw what one global draw over the batch draws, and rows of a
    group are independent (``torch.multinomial`` draws exponentials per row: a seeded stream
    each; the reference draws one stream for the whole batch)."""
    from selfrl.engines.sampling import sample_tokens
    from selfrl.engines.slots import row_generator

    torch.manual_seed(0)
    vocab, rows = 49152, 48 * GROUP
    logits = (torch.randn(vocab) * 2.5).expand(rows, vocab).contiguous()  # top id about 0.35 at T 0.7
    args = (torch.full((rows,), 0.7), torch.zeros(rows, dtype=torch.bool), torch.ones(rows))
    torch.manual_seed(1)
    batch, _ = sample_tokens(logits, *args)
    torch.manual_seed(2)
    base = int(torch.randint(0, 2**62, (1,)))
    per_row, _ = sample_tokens(logits, *args, [row_generator((base + 1_000_003 * i) % 2**62) for i in range(rows)])
    assert chi_square_homogeneity(batch.tolist(), per_row.tolist()).p_value > ALPHA
    groups = [str(i // GROUP) for i in range(rows)]
    assert independence_p(per_row.tolist(), groups, [0] * rows, permutations=999) > ALPHA


def test_bench_parity_runs_on_the_tiny_model(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_parity

    bench_parity.main(["--tiny", "--seeds", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "parity.json").read_text())
    for name in ("reference", "slots"):  # --tiny: 2 tasks x 4 samples, one seed
        assert saved["pooled"][name]["rollouts"] == 8 and saved["pooled"][name]["groups"] == 2
    assert set(saved["tests"]) >= {"first_token_chi2_p", "tool_use_chi2_p", "distinct_per_group_mw_p"}
    assert all(0.0 <= p <= 1.0 for p in saved["tests"].values())
