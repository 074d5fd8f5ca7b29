"""The attention the slot engine's own masks express (selfrl.engines.slotattention): eager attention
exact with an additive mask, a sliding window refused past the window plus one (and the reference
engine exact for such a model), any other implementation refused."""

from __future__ import annotations

import pytest
import torch

from selfrl.engines.slots import SlotEngine
from tests.test_engine_conformance import assert_matches_model
from tests.test_slot_engine import prompts_with_system


def test_eager_attention_samples_exactly(tiny_tokenizer):
    # eager attention adds its mask to the scores: the engine hands it 0 / -inf, not True / False
    from selfrl.testing import add_lora, build_tiny_model

    model = build_tiny_model(tiny_tokenizer, eos_bias=1.0)
    model.config._attn_implementation = "eager"
    model = add_lora(model, seed=1)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    assert (engine.attention, engine.sliding_window) == ("eager", None)
    prompts = prompts_with_system(tiny_tokenizer, ["What is 17+25?", "Hi"])
    torch.manual_seed(1)
    gens = engine.generate(prompts, 8, temperature=0.9)
    assert engine.merged.shared_prefix_layers == 0  # (the shared-prefix attention is for SDPA)
    assert_matches_model(gens, prompts, model, 0.9, tiny_tokenizer.eos_token_id, 8)
    engine.close()


def test_attention_the_masks_cannot_express_is_refused(tiny_tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    from selfrl.engines import make_engine
    from selfrl.testing import build_tiny_model

    # a sliding window: requests that could outgrow it are refused; auto samples with the reference engine
    cfg = MistralConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=40,
                        eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.eos_token_id)
    cfg._attn_implementation = "sdpa"
    windowed = MistralForCausalLM(cfg).eval()
    engine = SlotEngine(windowed, tiny_tokenizer, driver="caller")
    assert engine.sliding_window == 40 and engine.context == 41  # (the last id is never fed back)
    with pytest.raises(ValueError, match="sliding window"):
        engine.generate([[5] * 35], 7)
    with pytest.raises(ValueError, match="sliding window"):
        engine.submit([5] * 30, 12)
    torch.manual_seed(0)
    prompts = [[5 + i for i in range(30)], [7] * 35]
    gens = engine.generate(prompts, 6, temperature=1.0)  # within window + 1: sampled exactly
    assert_matches_model(gens, prompts, windowed, 1.0, tiny_tokenizer.eos_token_id, 6)
    engine.close()
    # auto: the reference engine, exact also for rows that share a prefix and outgrow the window
    # (it packs no shared prefix for a windowed model: the padding would count in the window)
    reference = make_engine("auto", windowed, tiny_tokenizer)
    assert reference.name == "reference" and not reference.share_prefix
    shared = [9 + (i % 50) for i in range(32)]
    prompts = [shared + [3, 4], shared + [11 + i for i in range(36)]]
    torch.manual_seed(1)
    assert_matches_model(reference.generate(prompts, 6, temperature=1.0), prompts, windowed, 1.0,
                         tiny_tokenizer.eos_token_id, 6)
    # an attention implementation other than SDPA or eager
    other = build_tiny_model(tiny_tokenizer)
    other.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="SDPA or eager"):
        SlotEngine(other, tiny_tokenizer)
    assert make_engine("auto", other, tiny_tokenizer).name == "reference"
    assert make_engine("auto", build_tiny_model(tiny_tokenizer), tiny_tokenizer, driver="caller").name == "slots"
