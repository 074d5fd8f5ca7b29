"""Cost of constrained decoding per token: computing a grammar's mask over the vocabulary
and advancing the grammar by the sampled id, per library, on this CPU.

Replays a fixed valid answer (a tool call with an integer and a string argument, as
the grammar of ``tool_choice: "required"`` sees it) token by token and times, per
token, what a decoding step adds: the allowed-id mask and the advance. The model's
forward pass is not included (it is the same with or without a grammar); the
``engine`` rows time ``Engine.generate`` on the tiny model with and without the
constraint for the end-to-end view.

    python benchmarks/bench_constrain.py            # SmolLM2's tokenizer (49,152 ids) when cached
    python benchmarks/bench_constrain.py --tiny     # the tests' 512-id tokenizer

lm-format-enforcer is measured when importable (it is not a selfrl dependency:
``pip install --target /tmp/lmfe lm-format-enforcer==0.11.3`` and ``LMFE_PATH=/tmp/lmfe``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import ROOT, Stats, base_parser, envelope, finish, print_table  # noqa: E402

ARGS_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
               "required": ["city", "days"], "additionalProperties": False}
ANSWER = '{"name":"get_weather","arguments":{"city":"Paris, France","days":14}}'


def tokenizer(tiny: bool):
    if not tiny:
        from selfrl.model.load import cache_dir

        path = cache_dir() / "smollm2-135m-instruct"
        if (path / "tokenizer.json").exists():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path), "SmolLM2-135M"
        print("SmolLM2 is not cached; using the tiny tokenizer", file=sys.stderr)
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_tokenizer

    return build_tiny_tokenizer(), "tiny (tests)"


def per_token_llguidance(tok, repeats: int) -> tuple[Stats, float, int]:
    """Seconds per token for llguidance (mask + unpack to a bool tensor + advance); and
    the one-off seconds to wrap the tokenizer; and the number of tokens replayed."""
    from selfrl.chat.constrain import grammar_tokenizer, tool_call_constraint, unpack_mask

    t = time.perf_counter()
    llt = grammar_tokenizer(tok, len(tok), [tok.eos_token_id])
    setup = time.perf_counter() - t
    import llguidance

    grammar = tool_call_constraint([("get_weather", ARGS_SCHEMA)]).grammar
    body = tok.encode("<tool_call>" + ANSWER + "</tool_call>", add_special_tokens=False) + [tok.eos_token_id]
    times = []
    for _ in range(repeats):
        m = llguidance.LLMatcher(llt, grammar, log_level=0)
        t = time.perf_counter()
        for i in body:
            allowed = unpack_mask(m.compute_bitmask(), len(tok))
            assert allowed[i], tok.decode([i])
            m.consume_token(i)
        times.append((time.perf_counter() - t) / len(body))
    return Stats.of(times), setup, len(body)


def per_token_lmfe(tok, repeats: int) -> tuple[Stats, float, int] | None:
    if os.environ.get("LMFE_PATH"):
        sys.path.insert(0, os.environ["LMFE_PATH"])
    import transformers.tokenization_utils_base as base

    # lm-format-enforcer 0.11.3 imports transformers.tokenization_utils, which transformers 5 removed
    sys.modules.setdefault("transformers.tokenization_utils", base)
    try:
        from lmformatenforcer import JsonSchemaParser, TokenEnforcer
        from lmformatenforcer.integrations.transformers import build_token_enforcer_tokenizer_data
    except ImportError:
        return None
    schema = {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                                               "arguments": ARGS_SCHEMA},
              "required": ["name", "arguments"], "additionalProperties": False}
    t = time.perf_counter()
    data = build_token_enforcer_tokenizer_data(tok)
    setup = time.perf_counter() - t
    body = tok.encode(ANSWER, add_special_tokens=False)
    prompt = tok.encode("Answer:", add_special_tokens=False)
    times = []
    for _ in range(repeats):
        te = TokenEnforcer(data, JsonSchemaParser(schema))
        seq = list(prompt)
        t = time.perf_counter()
        for i in body:
            te.get_allowed_tokens(seq)  # a TokenList (a bitmask or ids)
            seq.append(i)
        times.append((time.perf_counter() - t) / len(body))
    return Stats.of(times), setup, len(body)


def engine_rows(repeats: int) -> list[list]:
    """Engine.generate on the tiny model, 8 rows x 32 tokens, with and without the grammar."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_model, build_tiny_tokenizer

    from selfrl.chat.template import prompt_ids
    from selfrl.chat.constrain import tool_call_constraint
    from selfrl.engines.reference import Engine

    tok = build_tiny_tokenizer()
    engine = Engine(build_tiny_model(tok), tok)
    prompt = prompt_ids(tok, [{"role": "user", "content": "weather?"}])
    c = tool_call_constraint([("get_weather", ARGS_SCHEMA)])
    rows = []
    for name, cs in (("free", None), ("tool_call grammar", [c] * 8)):
        times, tokens = [], 0
        for _ in range(repeats):
            t = time.perf_counter()
            gens = engine.generate([prompt] * 8, 32, constraints=cs)
            times.append(time.perf_counter() - t)
            tokens = sum(len(g.token_ids) for g in gens)
        rows.append([f"engine, tiny model, {name}", "", Stats.of([x / tokens for x in times]).fmt(".3f", 1e3), tokens])
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = base_parser(__doc__).parse_args(argv)
    result = envelope(args, "python benchmarks/bench_constrain.py" + (" --tiny" if args.tiny else ""))
    tok, name = tokenizer(args.tiny)
    result.update(tokenizer=name, vocab=len(tok))
    rows = []
    llg, setup, n = per_token_llguidance(tok, max(args.repeats, 5))
    result["llguidance"] = {"per_token_s": llg, "tokenizer_setup_s": setup, "tokens": n}
    rows.append(["llguidance 1.9.1", f"{setup:.2f}", llg.fmt(".3f", 1e3), n])
    lmfe = per_token_lmfe(tok, args.repeats)
    if lmfe is not None:
        result["lm_format_enforcer"] = {"per_token_s": lmfe[0], "tokenizer_setup_s": lmfe[1], "tokens": lmfe[2]}
        rows.append(["lm-format-enforcer 0.11.3", f"{lmfe[1]:.2f}", lmfe[0].fmt(".3f", 1e3), lmfe[2]])
    result["engine"] = engine_rows(args.repeats)
    rows += result["engine"]
    print_table(f"Constrained decoding per token ({name}, {len(tok)} ids)",
                ["library", "setup s", "ms per token", "tokens"], rows)
    print(finish(result, "constrain", args.out))
    return result


if __name__ == "__main__":
    main()
