"""Tiny models and a tiny tokenizer built in memory from a config, for tests, benchmarks and
the fault suite (``tests/conftest.py``, ``benchmarks/common.py``, ``scripts/fault_runs.py``).

Nothing here downloads anything. The tokenizer is a byte-level BPE trained on a
small corpus with SmolLM2's special tokens and ChatML template (no tool
support), EOS ``<|im_end|>`` and pad = EOS (same id, as in SmolLM2). The model
is a 2-layer Llama (or Phi, :func:`save_tiny_phi`) with random weights; LoRA
adapters are initialised with ``init_lora_weights=False`` (A and B both random) so
that the adapter changes the logits from the first step and a test of the LoRA path
is not vacuous; ``default_init=True`` gives peft's default (B = 0), the start of a
real run.
"""

from __future__ import annotations

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "You are a careful assistant. Use the calculator tool for any arithmetic, "
    "then give the final answer as <answer>NUMBER</answer>.",
    "You are a helpful AI assistant",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "17+25"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "(3+4)*5"}}</tool_call>',
    "<tool_response>\n42\n</tool_response>",
    "<tool_response>\nerror: expected one JSON object, found extra data\n</tool_response>",
    "<answer>42</answer> <answer>-7</answer> <answer>3.5</answer>",
    '<tools>\n{"type": "function", "function": {"name": "calculator", "description": '
    '"Evaluate an arithmetic expression", "parameters": {"type": "object", "properties": '
    '{"expression": {"type": "string"}}, "required": ["expression"]}}}\n</tools>',
    "What is 12 + 30? Let me compute this step by step. The sum of the numbers is 42.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 17 25 42 100 256 1234 3.14 -5 + - * / // % ** ( )",
    "The quick brown fox jumps over the lazy dog. Numbers, words and JSON: "
    '{"a": [1, 2, 3], "b": {"c": true, "d": null}}',
    "system user assistant tool\n",
]


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with SmolLM2's specials and ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text round-trips
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_model(tokenizer, seed: int = 0, eos_bias: float | None = None, **config_overrides):
    """A random 2-layer ``LlamaForCausalLM`` (fp32, eval mode) sized to ``tokenizer``.

    Args:
        seed: seeds the weight initialisation.
        eos_bias: when set, the output layer gets a bias that is 0 everywhere but
            ``eos_bias`` at the EOS id, so sampled turns end early (the output
            layer of a random model is near uniform over ~500 ids otherwise).
        config_overrides: replace the tiny defaults of the ``LlamaConfig`` (``hidden_size``,
            ``num_attention_heads``, ...): vLLM's CPU attention, say, needs a head size of 32 or more.

    Raises:
        TypeError: an override is not a ``LlamaConfig`` field this function sets.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    eos = tokenizer.eos_token_id
    fields = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        eos_token_id=eos, pad_token_id=eos, bos_token_id=None, tie_word_embeddings=False,
        initializer_range=0.1,  # peakier than the default 0.02, so logprobs vary across ids
    )
    unknown = sorted(set(config_overrides) - set(fields))
    if unknown:
        raise TypeError(f"build_tiny_model: unknown config override(s) {unknown}; valid: {sorted(fields)}")
    config = LlamaConfig(**{**fields, **config_overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    if eos_bias is not None:
        old = model.lm_head
        head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(old.weight)
            head.bias.zero_()
            head.bias[eos] = eos_bias
        model.lm_head = head
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    return model.eval()


def add_lora(model, seed: int = 0, r: int = 4, default_init: bool = False, cpu_matmul: str = "auto"):
    """Wrap ``model`` with a rank-``r`` LoRA on every linear layer but the output one.

    ``init_lora_weights=False`` makes both A and B random, so the adapter is not a
    no-op: the LoRA path contributes to every logit from the start. With
    ``default_init`` peft's own initialisation is used instead (A random, B = 0:
    the adapter starts as a no-op), as in ``selfrl run``. The frozen layers then compute as
    ``selfrl run``'s do on the CPU (``cpu_matmul``: :func:`selfrl.model.matmul.route_frozen_linears`).
    """
    from peft import LoraConfig, get_peft_model

    from selfrl.model.matmul import route_frozen_linears

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                     init_lora_weights=True if default_init else False)
    model = get_peft_model(model, cfg)
    route_frozen_linears(model, cpu_matmul)
    return model.eval()


def save_tiny_phi(path, tokenizer, seed=0, eos_bias=2.0, **config_overrides):
    """Save a random 2-layer Phi (output bias ``eos_bias`` at EOS, so turns end) and
    ``tokenizer`` to ``path``, as a local model folder for ``selfrl run --model``; returns ``path``.

    ``config_overrides`` replace the tiny defaults of the ``PhiConfig`` (``hidden_size``,
    ``num_hidden_layers``, ...); the benchmarks use them for their larger sizes.

    Raises:
        TypeError: an override is not a ``PhiConfig`` field this function sets.
    """
    from transformers import PhiConfig, PhiForCausalLM

    eos = tokenizer.eos_token_id
    fields = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        eos_token_id=eos, pad_token_id=eos, bos_token_id=None, tie_word_embeddings=False, initializer_range=0.1,
    )
    unknown = sorted(set(config_overrides) - set(fields))
    if unknown:
        raise TypeError(f"save_tiny_phi: unknown config override(s) {unknown}; valid: {sorted(fields)}")
    config = PhiConfig(**{**fields, **config_overrides})
    torch.manual_seed(seed)
    model = PhiForCausalLM(config)
    with torch.no_grad():
        model.lm_head.bias.zero_()
        model.lm_head.bias[eos] = eos_bias
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
