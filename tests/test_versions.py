"""The version ledger: one lifecycle for `selfrl run` and `selfrl serve`.

The same sequence of candidates goes through the run loop (``Runner.iteration`` and
``Runner.gate``) and through the server's background learner (``BackgroundLearner.update``),
with the held-out validation scripted: promote, reject, a collapse rollback (held-out
success far below the champion's) and a candidate whose folder is damaged before its gate.
Both ends must leave the same version rows, statuses, events and champion.
"""

import time
import copy

import torch

from selfrl.record import adapters
from selfrl.config import RunConfig
from selfrl.safety.gate import EvalResult
from selfrl.run.loop import Runner
from selfrl.run.setup import build_run
from selfrl.model.load import build_policy
from selfrl.run.progress import PlainProgress
from selfrl.envs.rewards import REWARD_FUNCS
from selfrl.rl.logprobs import per_token_logps
from selfrl.record import served as records
from selfrl.serve.service import Service
from selfrl.record.store import Store
from selfrl.core.trajectory import Trajectory
from selfrl.record.versions import EventKind, Ledger, VersionStatus
from serving import tiny_serve_config

# version -> (held-out successes out of 20, damage the folder before the gate)
SCRIPT = {0: (10, False), 1: (12, False), 2: (11, False), 3: (6, False), 4: (14, True), 5: (13, False)}
EXPECTED = {0: "base", 1: "promoted", 2: "rejected", 3: "rolled_back", 4: "rejected", 5: "promoted"}
LIFECYCLE = {EventKind.PROMOTE, EventKind.REJECT, EventKind.CORRUPT_VERSION, EventKind.COLLAPSE, EventKind.ROLLBACK}


def scripted_validate(engine, tasks, *args, **kwargs) -> EvalResult:
    """Stands in for ``selfrl.safety.gate.validate``: the score of ``SCRIPT``; damages the folder when told."""
    version = engine.version
    solved, damage = SCRIPT[version]
    if damage:
        weights = adapters.version_dir(scripted_validate.run_dir, version) / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-64])
    return EvalResult(version, [(f"t{i}", i < solved, None) for i in range(20)], 0.01, 0.0)


def same_settings(cfg) -> None:
    """Rules that must not fire at random on a tiny random model; the held-out rule stays on."""
    cfg.train.learning_rate = 1e-2
    cfg.train.beta, cfg.collapse.beta_min = 0.0, 0.0  # no KL term: no KL skip at this learning rate
    cfg.train.micro_batch_size = 4
    cfg.collapse.baseline_window = 100  # entropy and degenerate rules: never out of their baseline
    cfg.collapse.max_kl = 1e9
    cfg.collapse.reward_rise = 1e9
    cfg.gate.tolerance = 0.02


def own_logps(model, traj, temperature):
    ids, mask = torch.tensor([traj.token_ids]), torch.tensor([traj.completion_mask])  # (1, T)
    with torch.no_grad():
        return (per_token_logps(model, ids, torch.ones_like(ids), mask, temperature)[0] * mask[0]).tolist()


def run_side(model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(REWARD_FUNCS, "short", lambda traj, ctx: 1.0 - traj.num_completion_tokens / 4)
    cfg = RunConfig(run_dir=str(tmp_path / "run"), iterations=5, num_prompts=2, num_generations=2,
                    reward_weights={"short": 1.0})
    cfg.model.name, cfg.lora.r, cfg.task.num_train, cfg.gate.val_size = str(model_dir), 4, 40, 6
    same_settings(cfg)
    cfg.validate()
    scripted_validate.run_dir = cfg.run_dir
    monkeypatch.setattr("selfrl.run.loop.validate", scripted_validate)
    runner = Runner(build_run(cfg), PlainProgress())

    def rollouts(it):
        from selfrl.run.loop import iteration_tasks

        out = []
        for j, task in enumerate(iteration_tasks(runner.s.train, it, cfg.num_prompts, cfg.task.train_seed)):
            for n in (1, 3):  # completions of 1 and 3 tokens: rewards differ within the group
                t = Trajectory(task.id, f"{it}-{j}", runner.s.engine.version, prompt_len=3,
                               token_ids=[5, 6, 7] + [8 + k for k in range(n)], completion_mask=[0, 0, 0] + [1] * n)
                t.logprobs = own_logps(runner.s.engine.model, t, cfg.rollout.temperature)
                out.append(t)
        return out, 0.0

    runner.rollouts = rollouts
    runner.start()
    for it in range(5):
        runner.iteration(it)
        runner.gate(it, runner.validate())
    return runner.s.ledger, runner.s.store


def serve_side(model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    cfg = tiny_serve_config(tmp_path / "serve")
    cfg.model.name, cfg.lora.r = str(model_dir), 4
    same_settings(cfg)
    scripted_validate.run_dir = cfg.run_dir
    monkeypatch.setattr("selfrl.serve.background.validate", scripted_validate)
    model, tok = build_policy(cfg)
    service = Service(model, tok, cfg, learner_model=copy.deepcopy(model))  # the learner thread is not started
    learner = service.learner
    learner.ensure_champion_validated()
    for _ in range(5):
        batch = []
        for i, feedback in enumerate((1.0, -1.0, 1.0, -1.0)):
            t = Trajectory("g", "g", service.engine.version, prompt_len=3, token_ids=[5, 6, 7, 8 + i],
                           completion_mask=[0, 0, 0, 1], logprobs=[0.0] * 4)
            with service.store.lock:
                records.add_turn(service.store, service.run_id, t, t.id, 0, "c", "g", t.id)
            batch.append((t, {"feedback": feedback, "created_at": time.time(), "group_key": "g"}))
        learner.update(batch)
    return service


def rows(ledger: Ledger):
    keep = ("val/success", "val/degenerate", "collapse", "corrupt")
    return [(v.version, v.parent, v.status.value, {k: v.metrics[k] for k in keep if k in v.metrics})
            for v in ledger.all()]


def events(store: Store):
    return [(e["kind"], e["message"]) for e in store.events() if e["kind"] in {k.value for k in LIFECYCLE}]


def test_run_and_serve_keep_versions_the_same_way(model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    run_ledger, run_store = run_side(model_dir, tmp_path, monkeypatch)
    service = serve_side(model_dir, tiny_tokenizer, tmp_path, monkeypatch)
    try:
        assert {v.version: v.status.value for v in run_ledger.all()} == EXPECTED
        assert rows(service.ledger) == rows(run_ledger)
        assert events(service.store) == events(run_store)
        assert [k for k, _ in events(run_store)] == ["promote", "reject", "collapse", "corrupt_version", "promote"]
        assert "collapse: held-out success 0.300 < best 0.600 - 0.1" in events(run_store)[2][1]
        for ledger, side in ((run_ledger, "run"), (service.ledger, "serve")):
            champ = ledger.champion
            assert (champ.version, champ.success) == (5, 0.65), side
            saved = ledger.load_state(5)
            assert all(torch.equal(saved[k], v) for k, v in champ.state.items()), side
        # the server serves the champion; the rejected, damaged and rolled-back ones are not servable
        assert service.engine.version == 5
        assert [v.version for v in service.ledger.all() if v.status in (VersionStatus.BASE, VersionStatus.PROMOTED)] \
            == [0, 1, 5]
    finally:
        run_store.close()
        service.close()


def test_every_event_kind_written_in_selfrl_is_an_event_kind():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "selfrl"
    written = set()
    for path in root.rglob("*.py"):
        for line in path.read_text().splitlines():
            if re.search(r"(\.event|log_event)\(", line):  # the kind is the first string literal of the call
                head = line.split("(", 1)[1].split(",")[0]
                written |= set(re.findall(r'"(\w+)"', head))
    assert {"disconnect", "swap_check", "swap_check_failed"} <= written  # the scan sees the literal kinds
    assert written <= {k.value for k in EventKind}
