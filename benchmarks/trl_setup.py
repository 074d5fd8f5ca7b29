"""The TRL side of ``bench_trl.py`` and ``bench_trl_demo.py``: the model as TRL's Trainer takes it,
``GRPOConfig`` and peft's ``LoraConfig`` from a selfrl run config, the ``GRPOTrainer``, and the
callback that saves and times every optimizer step.

TRL, peft and transformers are imported inside the functions: the ``bench`` extra is needed
only by the TRL arm's process.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from common import loadavg


def load_trainable(name: str):
    """``(model, tokenizer)`` of ``name`` (:func:`selfrl.model.load.load_model`) as transformers'
    Trainer trains it: the cached conversion of the embedded GGUF keeps a GGUF
    ``quantization_config`` although its weights are plain fp32 (dequantized), and the Trainer
    refuses to train such a model, so the config is removed."""
    from selfrl.model.load import load_model

    model, tok = load_model(name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model, tok


def grpo_args(cfg, gradient_checkpointing: bool, max_steps: int):
    """``trl.GRPOConfig`` with selfrl's settings of ``cfg`` (a :class:`selfrl.config.RunConfig`):
    one optimizer step per ``num_prompts x num_generations`` completions, accumulated in
    micro-batches of ``train.micro_batch_size``; sampling at ``rollout.temperature`` without top-k
    or top-p; selfrl's learning rate (constant), weight decay, gradient clipping, ``beta``,
    ``epsilon``, loss, reward scaling and passes per batch; the dataset in its order; on the CPU
    in fp32, dropout off, nothing saved or reported by TRL itself.

    Raises:
        ValueError: ``num_prompts x num_generations`` is not a multiple of ``train.micro_batch_size``,
            or a learning-rate schedule other than a constant rate (``train.lr_scheduler_type``,
            ``warmup_ratio``), which the arm's wall-clock budget has no last step for.
    """
    micro = cfg.train.micro_batch_size
    per_update = cfg.num_prompts * cfg.num_generations
    if (cfg.train.lr_scheduler_type, cfg.train.warmup_ratio) != ("constant", 0.0):
        raise ValueError(f"train.lr_scheduler_type = {cfg.train.lr_scheduler_type!r}, warmup_ratio = "
                         f"{cfg.train.warmup_ratio:g}: the TRL arm runs for a wall-clock budget, with no last step to "
                         "decay toward; compare the two at a constant rate (lr_scheduler_type = 'constant', "
                         "warmup_ratio = 0)")
    if per_update % micro:
        raise ValueError(f"num_prompts x num_generations ({per_update}) must be a multiple of "
                         f"train.micro_batch_size ({micro}) for TRL's gradient accumulation")
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(Path(cfg.run_dir) / "trainer"), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=gradient_checkpointing, per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_update // micro, num_generations=cfg.num_generations,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, top_k=0, top_p=1.0,
        learning_rate=cfg.train.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg.train.weight_decay, max_grad_norm=cfg.train.max_grad_norm, beta=cfg.train.beta,
        epsilon=cfg.train.epsilon, loss_type=cfg.train.loss_type, scale_rewards=cfg.train.scale_rewards,
        num_iterations=cfg.train.num_iterations, max_steps=max_steps, shuffle_dataset=False,
        seed=cfg.seed, disable_dropout=True, report_to="none", logging_steps=1, save_strategy="no",
        optim="adamw_torch", dataloader_num_workers=0,
    )


def lora_config(cfg):
    """peft's ``LoraConfig`` of selfrl's adapter shape in ``cfg`` (r, alpha, dropout, target modules)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.lora_alpha, lora_dropout=cfg.lora.lora_dropout,
                      target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM")


def grpo_trainer(cfg, model, tok, reward: Callable[..., list[float]], args, data: Any, callback):
    """``trl.GRPOTrainer`` on ``data`` with the one reward function ``reward``, the LoRA of
    :func:`lora_config` and ``callback``; torch seeded with ``cfg.seed`` first (the adapter's
    initialisation)."""
    import torch
    from trl import GRPOTrainer

    torch.manual_seed(cfg.seed)
    return GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data, processing_class=tok,
                       peft_config=lora_config(cfg), callbacks=[callback])


def step_timeline(adapters_dir: Path, width: int, budget_s: float | None = None, details: bool = False):
    """A transformers ``TrainerCallback`` that saves the adapter after every optimizer step to
    ``adapters_dir/step<N>`` (N zero-padded to ``width`` digits) and appends to its ``steps``
    ``{"step", "seconds", "adapter"}``: seconds of training, since ``on_train_begin`` less the
    time spent saving. With ``details``, also ``step_s`` (this step's seconds), ``cpu_s`` (this
    process's CPU seconds since ``on_train_begin``) and ``loadavg``. With ``budget_s``, training
    stops after the first step that ends past it."""
    from transformers import TrainerCallback

    class Timeline(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []

        def on_train_begin(self, args, state, control, **kw):
            self.t0, self.saving, self.cpu0 = time.perf_counter(), 0.0, time.process_time()

        def on_step_end(self, args, state, control, model=None, **kw):
            now = time.perf_counter()
            elapsed = now - self.t0 - self.saving
            path = adapters_dir / f"step{state.global_step:0{width}d}"
            model.save_pretrained(path)
            self.saving += time.perf_counter() - now
            if details:
                prev = self.steps[-1]["seconds"] if self.steps else 0.0
                self.steps.append({"step": state.global_step, "seconds": elapsed, "step_s": elapsed - prev,
                                   "adapter": str(path), "cpu_s": time.process_time() - self.cpu0,
                                   "loadavg": loadavg()})
            else:
                self.steps.append({"step": state.global_step, "seconds": elapsed, "adapter": str(path)})
            if budget_s is not None and elapsed >= budget_s:
                control.should_training_stop = True

    return Timeline()


def constrain_generation(trainer, constraints: dict[tuple[int, ...], Any]) -> dict[str, int]:
    """Make ``trainer`` (a ``trl.GRPOTrainer`` generating with transformers, no vLLM) sample
    every completion under its prompt's grammar, as selfrl's rollout samples it.

    TRL 1.16 constrains decoding only through vLLM (``vllm_structured_outputs_regex``); this
    replaces the ``generate`` of the trainer's model (the object TRL's
    ``unwrap_model_for_generation`` yields on one CPU process) with one that passes selfrl's
    per-row logits processor (:class:`selfrl.chat.constrain.GrammarMasks`): each row's
    prompt ids (the unpadded ``input_ids``) pick its constraint in ``constraints``. TRL's
    loss is unchanged: its log-probabilities are of the unmasked distribution (as with vLLM's
    structured outputs), where selfrl's learner recomputes the masked one.

    Args:
        trainer: the trainer, already built.
        constraints: prompt token ids -> :class:`selfrl.chat.constrain.Constraint`.

    Returns:
        Counters the patched ``generate`` keeps up to date: ``calls``, ``rows`` sampled and
        ``failed`` rows (a grammar that failed mid-row ends it with an EOS, as in selfrl).

    Raises:
        RuntimeError: (at generation) a prompt whose ids are not in ``constraints``: sampling
            it unconstrained would change the arm silently.
    """
    from transformers import LogitsProcessorList

    from selfrl.chat.constrain import GrammarMasks

    model, tok = trainer.model, trainer.processing_class
    original = model.generate
    vocab = model.get_output_embeddings().weight.shape[0]
    stats = {"calls": 0, "rows": 0, "failed": 0}

    def generate(*args, input_ids, attention_mask, **kwargs):
        rows = []
        for ids, keep in zip(input_ids, attention_mask):
            key = tuple(ids[keep.bool()].tolist())
            if key not in constraints:
                raise RuntimeError(f"no grammar for a prompt of {len(key)} tokens (ending "
                                   f"{tok.decode(list(key[-12:]))!r}): the arm would sample it unconstrained")
            rows.append(constraints[key])
        masks = GrammarMasks(rows, tok, vocab, list(trainer.eos_token_ids), input_ids.shape[1])
        out = original(*args, input_ids=input_ids, attention_mask=attention_mask,
                       logits_processor=LogitsProcessorList([masks]), **kwargs)
        stats["calls"] += 1
        stats["rows"] += len(rows)
        stats["failed"] += sum(e is not None for e in masks.errors)
        return out

    model.generate = generate
    return stats
