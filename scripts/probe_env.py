"""Probe an environment's learning signal on a model, without training (the pre-flight check, offline).

    python scripts/probe_env.py --env function_calling --options '{"categories": ["simple"]}' \
        --tasks 16 --group 8 --preset function_calling-partial [--greedy 32] [--config configs/x.toml]

Prints, per category when the tasks have one: pass@1, pass@k, tool use and the share of
zero-signal groups (``selfrl.run.signal.probe_report``), mean reward under the preset, and greedy
pass@1 on ``--greedy`` held-out tasks. Nothing is trained or stored.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", required=True)
    p.add_argument("--options", default="{}")
    p.add_argument("--config")
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--preset")
    p.add_argument("--greedy", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="dotted config override KEY=JSON")
    a = p.parse_args()

    import torch

    from selfrl.engines.reference import Engine
    from selfrl.envs import get_env, load_run_config
    from selfrl.safety.gate import validate
    from selfrl.model.load import build_policy
    from selfrl.envs.rewards import get_preset, score_batch
    from selfrl.rollout.agent import rollout
    from selfrl.run.signal import diagnose, probe_report
    from selfrl.core.tools import resolve_tools

    overrides = {"task.source": a.env, "task.options": json.loads(a.options)}
    overrides.update({k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)})
    if a.preset:
        overrides["preset"] = a.preset
    cfg = load_run_config(a.config, overrides)
    torch.manual_seed(cfg.seed)
    env = get_env(cfg.task.source, **cfg.task.options)
    train, val = env.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    tools = resolve_tools(cfg.rollout.tools)
    model, tok = build_policy(cfg)
    engine = Engine(model, tok)
    tasks = train[: a.tasks]
    t0 = time.perf_counter()
    trajs = rollout(engine, [t for t in tasks for _ in range(a.group)],
                    [t.id for t in tasks for _ in range(a.group)], tools, cfg.rollout, env_factory=env.make_env)
    score_batch(trajs, {t.id: t for t in tasks}, env, get_preset(cfg.preset))
    by_cat = defaultdict(list)
    cat = {t.id: t.metadata.get("category", "all") for t in tasks}
    for tr in trajs:
        by_cat[cat[tr.task_id]].append(tr)
        by_cat["ALL"].append(tr) if len(set(cat.values())) > 1 else None
    print(f"{a.env} {a.options} preset {cfg.preset}: {len(tasks)} tasks x {a.group} samples, "
          f"{time.perf_counter() - t0:.0f} s")
    for c, ts in sorted(by_cat.items()):
        r = probe_report(ts)
        mean = sum(t.reward for t in ts if t.reward is not None) / max(1, sum(t.reward is not None for t in ts))
        print(f"  {c:18s} {r.line()}; mean reward {mean:.3f}")
    cause = diagnose(probe_report(trajs), cfg.rollout.temperature, a.group, True, cfg.rollout.demonstration,
                     cfg.rollout.tools_prompt, cfg.rollout.constrain)
    print("  diagnosis:", cause or "signal: yes")
    if a.greedy:
        res = validate(engine, val[: a.greedy], env, tools, cfg.rollout)
        print(f"  greedy held-out pass@1: {sum(bool(r[1]) for r in res.results)}/{len(res.results)} "
              f"({res.seconds:.0f} s)")
    for tr in trajs[: 3 * a.group: a.group]:
        print("  sample:", json.dumps(tr.messages[-2:])[:400])


if __name__ == "__main__":
    main()
