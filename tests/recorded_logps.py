"""Test helper: a run's stored trajectories carry the logprobs of the adapter version they record."""

from __future__ import annotations

import torch
from peft import set_peft_model_state_dict

from selfrl.record import adapters
from selfrl.model.load import build_policy
from selfrl.rl.logprobs import per_token_logps


def assert_sampled_by_recorded_versions(cfg, versions: list[dict], trajs: list, atol: float) -> None:
    """Assert that each of ``trajs``' stored logprobs equal, to ``atol`` (rtol 0), the per-token
    logprobs at ``cfg.rollout.temperature`` recomputed by a policy of run config ``cfg`` holding the
    adapter of the version the trajectory records (``versions``: the store's version rows)."""
    states = {v["version"]: adapters.load_version_state(v["path"]) for v in versions}
    model, _ = build_policy(cfg)
    for t in trajs:
        set_peft_model_state_dict(model, states[t.adapter_version])
        ids, mask = torch.tensor([t.token_ids]), torch.tensor([t.completion_mask])  # (1, T)
        with torch.no_grad():
            got = per_token_logps(model, ids, torch.ones_like(ids), mask, cfg.rollout.temperature)[0]  # (T,)
        torch.testing.assert_close(got, torch.tensor(t.logprobs), atol=atol, rtol=0)
