"""The online self-improvement loop: rollouts -> rewards -> advantages -> LoRA update
-> candidate version -> validation gate -> promote or roll back; all recorded.

This module only orchestrates; the math lives in ``selfrl.rl`` and the parts in
their own modules.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfrl import adapters
from selfrl.config import RunConfig
from selfrl.engine import Engine
from selfrl.gate import EvalResult, evaluate, passes_gate
from selfrl.rewards import get_preset, score_batch
from selfrl.rl.advantages import group_advantages
from selfrl.rollout import rollout
from selfrl.store import Store
from selfrl.tasks import Task, assert_disjoint, get_task_source, split_tasks
from selfrl.tools import resolve_tools
from selfrl.trainer import Learner


@dataclass
class RunResult:
    """What a run ends with (also written to ``report.md``)."""

    run_dir: Path
    base_success: float
    final_success: float
    base_version: int
    final_version: int
    stopped_early: bool = False
    summary: dict = field(default_factory=dict)


class Timer:
    """Accumulates seconds per phase (inference, training, validation)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


def build_policy(cfg: RunConfig):
    """Load the model and attach a LoRA adapter; returns ``(peft_model, tokenizer)``.

    Raises:
        selfrl.model.ModelLoadError: the model cannot be loaded.
        ValueError: the LoRA settings do not fit the model (peft's message).
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    from selfrl.model import load_model

    base, tok = load_model(cfg.model.name)
    torch.manual_seed(cfg.seed)
    if cfg.lora.init_adapter:
        model = PeftModel.from_pretrained(base, cfg.lora.init_adapter, is_trainable=True)
    else:
        lcfg = LoraConfig(
            r=cfg.lora.r, lora_alpha=cfg.lora.lora_alpha, lora_dropout=cfg.lora.lora_dropout,
            target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, lcfg)
    model.eval()
    return model, tok


class MetricsLog:
    """Writes metrics to the store, ``metrics.jsonl`` and TensorBoard (tensorboardX)."""

    def __init__(self, run_dir: Path, store: Store, run_id: int):
        from tensorboardX import SummaryWriter

        self.store, self.run_id = store, run_id
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        self.store.log_metrics(self.run_id, step, clean)
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **{
            k: (v if math.isfinite(v) else None) for k, v in clean.items()}}) + "\n")
        for k, v in clean.items():
            if math.isfinite(v):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()


def iteration_tasks(train: list[Task], iteration: int, num_prompts: int, seed: int) -> list[Task]:
    """The tasks of one iteration: a deterministic walk through a shuffled training set."""
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    start = (iteration * num_prompts) % len(order)
    idx = (order + order)[start:start + num_prompts]
    return [train[i] for i in idx]


def run(cfg: RunConfig, resume: bool = False, progress=None) -> RunResult:
    """Run (or resume) the self-improvement loop described by ``cfg``.

    With ``resume``, the store in ``cfg.run_dir`` is reopened, the last promoted
    version is loaded into the engine, and iterations continue after the last
    one stored; no stored trajectory is touched. Ctrl-C stops after the current
    phase, gates nothing new, and still writes the report.

    Raises:
        FileExistsError: ``run_dir`` already holds a run and ``resume`` is False.
        FileNotFoundError: ``resume`` but there is no run to resume.
    """
    run_dir = Path(cfg.run_dir)
    db = run_dir / "selfrl.db"
    if resume and not db.exists():
        raise FileNotFoundError(f"nothing to resume: no run at {run_dir}")
    if not resume and db.exists():
        raise FileExistsError(f"{run_dir} already holds a run; pass --resume or choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        _write_atomic(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
    say = progress.log if progress else print

    source = get_task_source(cfg.task.source, **cfg.task.options)
    train, val = split_tasks(source, cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    assert_disjoint(train, val)
    tools = resolve_tools(cfg.rollout.tools)
    weights = cfg.reward_weights or get_preset(cfg.preset)
    model, tok = build_policy(cfg)
    # the KL reference is the adapter the run started from (TrainConfig.beta, LoraSettings.init_adapter);
    # taken before a resume swaps in a later version
    ref_state = adapters.lora_state(model) if cfg.lora.init_adapter else None
    engine = Engine(model, tok)
    tasks_by_id = {t.id: t for t in train}

    store = Store(db)
    timer = Timer()
    if resume:
        run_id = store.start_run(cfg.to_dict())
        best = store.latest_promoted()
        if best["version"] != 0:
            engine.swap(adapters.load_version_state(Path(best["path"])), best["version"])
        best_success = best["metrics"].get("val/success", 0.0)
        done = [m["step"] for m in store.metrics() if m["name"] == "reward/mean"]
        start = max(done) + 1 if done else 0
        base_version = 0
        say(f"resuming at iteration {start} from version {best['version']} (held-out {best_success:.3f})")
    else:
        run_id = store.start_run(cfg.to_dict())
        store.add_tasks([_task_row(t) for t in train], "train")
        store.add_tasks([_task_row(t) for t in val], "val")
        base_path = adapters.save_version(model, run_dir, 0)
        base = evaluate(engine, val, source, tools, cfg.rollout, cfg.gate.batch_size)
        timer.add("validation", base.seconds)
        store.add_version(0, None, str(base_path), "base", {"val/success": base.success})
        store.add_evaluation(0, base.results)
        best_success, start, base_version = base.success, 0, 0
        say(f"base model: held-out success {base.success:.3f} on {len(val)} tasks ({base.seconds:.0f} s)")
    log = MetricsLog(run_dir, store, run_id)
    log.log(start, {"val/success": best_success})
    learner = Learner(model, cfg.train, cfg.rollout.temperature, tok.pad_token_id,
                      cfg.rollout.max_new_tokens * cfg.rollout.max_turns, ref_state=ref_state)
    best_version = engine.version
    best_state = adapters.lora_state(model)
    stopped = False
    try:
        for it in range(start, cfg.iterations):
            stopped = _iteration(it, cfg, engine, learner, source, train, tasks_by_id, tools, weights, store, run_id, run_dir, log, timer, say)
            if (it + 1) % cfg.gate.eval_every == 0 or it == cfg.iterations - 1:
                res = evaluate(engine, val, source, tools, cfg.rollout, cfg.gate.batch_size)
                timer.add("validation", res.seconds)
                store.add_evaluation(res.version, res.results)
                log.log(it, {"val/success": res.success})
                if res.version == best_version:
                    continue
                if passes_gate(res.success, best_success, cfg.gate.tolerance):
                    store.set_version_status(res.version, "promoted", {"val/success": res.success})
                    store.log_event(run_id, "promote", f"version {res.version} promoted: held-out {res.success:.3f} (best was {best_success:.3f})")
                    say(f"iteration {it}: version {res.version} promoted, held-out {res.success:.3f}")
                    best_success = max(best_success, res.success)
                    best_version, best_state = res.version, adapters.lora_state(model)
                else:
                    store.set_version_status(res.version, "rejected", {"val/success": res.success})
                    engine.swap(best_state, best_version)
                    store.log_event(run_id, "rollback", f"version {res.version} rejected: held-out {res.success:.3f} < best {best_success:.3f} - {cfg.gate.tolerance}; serving {best_version} again")
                    say(f"iteration {it}: version {res.version} rejected ({res.success:.3f}); back to version {best_version}")
    except KeyboardInterrupt:
        stopped = True
        say("interrupted: stored trajectories and promoted versions are kept; resume with --resume")
    if engine.version != best_version:
        engine.swap(best_state, best_version)
    final = store.evaluation(best_version)
    base_eval = store.evaluation(0)
    inference = timer.seconds.get("inference", 0.0)
    training = timer.seconds.get("training", 0.0)
    summary = {
        "base_version": 0, "final_version": best_version,
        "time_inference_s": inference, "time_training_s": training,
        "time_validation_s": timer.seconds.get("validation", 0.0),
        "cost_ratio": (inference + training) / inference if inference else float("nan"),
        "stopped_early": stopped,
    }
    log.close()
    from selfrl.report import write_report

    report = write_report(run_dir, store, run_id, summary)
    store.close()
    return RunResult(run_dir, _rate(base_eval), _rate(final), base_version, best_version, stopped, {**summary, "report": str(report)})


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rate(evaluation: dict[str, bool]) -> float:
    return sum(evaluation.values()) / len(evaluation) if evaluation else float("nan")


def _task_row(t: Task) -> dict:
    return {"id": t.id, "source": t.source, "question": t.question, "answer": t.answer, "metadata": t.metadata}


def _iteration(it, cfg, engine, learner, source, train, tasks_by_id, tools, weights, store, run_id, run_dir, log, timer, say) -> bool:
    """One rollout + update; returns False (kept for symmetry with early-stop signals)."""
    batch = iteration_tasks(train, it, cfg.num_prompts, cfg.task.train_seed)
    tasks = [t for t in batch for _ in range(cfg.num_generations)]
    groups = [f"{it}-{j}" for j, t in enumerate(batch) for _ in range(cfg.num_generations)]
    t0 = time.perf_counter()
    trajs = rollout(engine, tasks, groups, tools, cfg.rollout)
    timer.add("inference", time.perf_counter() - t0)
    score_batch(trajs, tasks_by_id, source, weights)
    adv = group_advantages([t.reward for t in trajs], [t.group_id for t in trajs], cfg.train.scale_rewards)
    for t, a in zip(trajs, adv.advantages):
        t.advantage = a
    store.add_trajectories(run_id, it, trajs)
    metrics = learner.step(trajs)
    timer.add("training", metrics.get("time_s", 0.0))
    if not metrics.get("skipped"):
        version = store.next_version()
        path = adapters.save_version(engine.model, run_dir, version)
        store.add_version(version, engine.version, str(path), "candidate", {})
        engine.version = version
    scored = [t for t in trajs if t.reward is not None]
    tool_rates = [t.tool_success_rate for t in trajs if t.tool_success_rate is not None]
    metrics.update({
        "reward/mean": sum(t.reward for t in scored) / max(len(scored), 1),
        "train/correct": sum(bool(t.correct) for t in trajs) / len(trajs),
        "train/tool_use": sum(bool(t.tool_calls) for t in trajs) / len(trajs),
        "train/tool_success": sum(tool_rates) / len(tool_rates) if tool_rates else float("nan"),
        "train/truncated": sum(t.truncated for t in trajs) / len(trajs),
        "train/completion_tokens": sum(t.num_completion_tokens for t in trajs) / len(trajs),
        "frac_reward_zero_std": adv.frac_no_signal,
        "version": float(engine.version),
    })
    log.log(it, metrics)
    say(f"iteration {it}: reward {metrics['reward/mean']:.3f} correct {metrics['train/correct']:.3f} "
        f"tool use {metrics['train/tool_use']:.2f} kl {metrics.get('kl', 0.0):.4f} "
        f"version {engine.version} ({time.perf_counter() - t0:.0f} s)")
    return False
