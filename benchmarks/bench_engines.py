"""Sampling backends side by side: useful tokens/s against the machine's ceiling, and serving latency.

    flock /tmp/selfrl-heavy.lock nice -n 5 .venv/bin/python benchmarks/bench_engines.py   # real model, ~20 min
    .venv/bin/python benchmarks/bench_engines.py --tiny                                    # seconds

* **rollouts**: one ``selfrl run`` iteration's rollouts (``num_prompts x num_generations``
  multi-turn trajectories with the calculator, the demo's temperature and limits) on each
  backend (:mod:`selfrl.engines`), the backends taking turns repeat by repeat so that the
  machine's load falls on all of them alike. Useful tokens are the sampled ones (the
  completion tokens of the trajectories); the bound is ``bench_ceiling``'s
  matmul FLOP/s / (2 x P).
* **serve**: ``c`` concurrent clients (1, 8, 32) each send ``--requests`` chat requests one
  after the other through the server's :class:`selfrl.serve.batcher.Batcher` (what the HTTP
  layer calls; no HTTP here), ``max_tokens`` 32, temperature 1, streamed. Time to first
  token is from the request's submission to its first sampled id; tokens/s counts every
  completion token over the wall time of the whole level.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ceiling import CONFIG, matmul_flops, matmul_params  # noqa: E402
from common import (  # noqa: E402
    Stats, base_parser, command_line, bench_config, envelope, finish, first_batch, print_table, run_clients,
)

QUESTIONS = ["What is 17 + 25?", "Name three colours.", "Write one sentence about the sea.", "What is 9 * 8?",
             "Say hello in French.", "Count from one to five.", "What is the capital of Italy?", "Add 38 and 47."]


def rollout_once(engine, tasks, tools, rollout_cfg, num_generations: int, seed: int) -> tuple[float, int]:
    """(seconds, sampled tokens) of one iteration's rollouts."""
    import torch

    from selfrl.rollout.agent import rollout

    torch.manual_seed(seed)
    t = time.perf_counter()
    trajs = rollout(engine, tasks, [f"g{i // num_generations}" for i in range(len(tasks))], tools, rollout_cfg)
    return time.perf_counter() - t, sum(tr.num_completion_tokens for tr in trajs)


def policy_with_adapter(cfg, adapter: Path | None, result: dict):
    """``(model, tokenizer)`` of run config ``cfg``, with the saved adapter version ``adapter`` (a
    run's ``adapters/vNNNNNN``: a trained policy) loaded when given (recorded in ``result``)."""
    from selfrl.model.load import build_policy

    model, tok = build_policy(cfg)
    if adapter is not None:
        from peft import set_peft_model_state_dict

        from selfrl.record.adapters import load_version_state

        set_peft_model_state_dict(model, load_version_state(adapter))
        result["adapter"] = str(adapter)
    return model, tok


def alternating_rollouts(engines: dict, cfg, repeats: int, bound: float) -> tuple[dict, list, dict, dict]:
    """One iteration's rollouts of run config ``cfg`` on each of ``engines`` (name -> engine),
    alternating repeat by repeat after a small warm-up; returns (per engine: seconds, tokens,
    tokens/s, share of ``bound`` tokens/s; table rows; the seconds; the tokens)."""
    tasks, tools = first_batch(cfg)
    times, toks = {n: [] for n in engines}, {n: [] for n in engines}
    for e in engines.values():  # warm-up: allocations, the first stored prefix
        rollout_once(e, tasks[: max(2, len(tasks) // 8)], tools, cfg.rollout, cfg.num_generations, 99)
    for rep in range(repeats):
        for n, e in engines.items():
            s, k = rollout_once(e, tasks, tools, cfg.rollout, cfg.num_generations, rep)
            times[n].append(s)
            toks[n].append(k)
            print(f"rollouts {n} repeat {rep}: {k} tokens in {s:.1f} s", flush=True)
    roll, rows = {}, []
    for n in engines:
        tps = Stats.of([k / s for k, s in zip(toks[n], times[n])])
        roll[n] = {"seconds": Stats.of(times[n]), "tokens": toks[n], "tokens_per_s": tps,
                   "fraction_of_bound": tps.median / bound}
        rows.append([n, Stats.of(times[n]).fmt(".1f"), ", ".join(map(str, toks[n])), tps.fmt(".1f"),
                     f"{tps.median / bound:.1%}"])
    return roll, rows, times, toks


def serve_level(engine, tok, clients: int, requests: int, max_tokens: int, max_batch: int) -> dict:
    """TTFT (s) and tokens/s of ``clients`` concurrent streaming clients through a Batcher."""
    from selfrl.chat.template import prompt_ids
    from selfrl.serve.batcher import Batcher, Job

    batcher = Batcher(engine, lambda version, fn: fn(), max_batch=max_batch)
    ttft, latency, tokens = [], [], []
    lock = threading.Lock()

    def client(c: int) -> None:
        for k in range(requests):
            q = QUESTIONS[(c + k) % len(QUESTIONS)]
            prompt = prompt_ids(tok, [{"role": "user", "content": f"({c}.{k}) {q}"}])
            first: list[float] = []
            t0 = time.perf_counter()
            job = Job(prompt, max_tokens, temperature=1.0,
                      on_tokens=lambda ids, first=first: first or first.append(time.perf_counter()))
            gen = batcher.submit(job).result(timeout=1800)
            t1 = time.perf_counter()
            with lock:
                ttft.append((first[0] if first else t1) - t0)
                latency.append(t1 - t0)
                tokens.append(len(gen.token_ids))

    wall = run_clients(client, clients)
    batcher.close()
    return {"clients": clients, "requests": clients * requests, "ttft_s": Stats.of(ttft),
            "ttft_p50_s": statistics.median(ttft), "latency_s": Stats.of(latency),
            "completion_tokens": sum(tokens), "wall_s": wall, "tokens_per_s": sum(tokens) / wall}


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--engines", default="reference,slots", help="backends, comma-separated (selfrl.engines)")
    p.add_argument("--clients", default="1,8,32", help="serve levels: concurrent clients, comma-separated")
    p.add_argument("--requests", type=int, default=2, help="requests per client at each serve level")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each serve request")
    p.add_argument("--skip-serve", action="store_true", help="rollouts only")
    p.add_argument("--skip-rollouts", action="store_true", help="serve levels only")
    args = p.parse_args(argv)
    import torch

    from selfrl.engines import make_engine
    from selfrl.model.load import build_policy

    result = envelope(args, command_line("bench_engines.py", argv))
    cfg = bench_config(args, CONFIG, "bench-engines-")
    names = args.engines.split(",")
    flops = matmul_flops(256 if args.tiny else 4096, max(1, args.repeats))
    model, tok = build_policy(cfg)
    engines = {n: make_engine(n, model, tok) for n in names}
    P = matmul_params(model)
    bound = flops.median / (2 * P)
    result.update({"model": cfg.model.name, "engines": names, "matmul_flops_per_s": flops, "matmul_params": P,
                   "generation_bound_tokens_per_s": bound, "torch_threads": torch.get_num_threads()})

    if not args.skip_rollouts:
        tasks, tools = first_batch(cfg)
        times = {n: [] for n in names}
        toks = {n: [] for n in names}
        for n in names:  # warm-up (allocations, first prefix)
            rollout_once(engines[n], tasks[: max(2, len(tasks) // 8)], tools, cfg.rollout, cfg.num_generations, 99)
        for r in range(args.repeats):
            for n in names:
                s, k = rollout_once(engines[n], tasks, tools, cfg.rollout, cfg.num_generations, r)
                times[n].append(s)
                toks[n].append(k)
                print(f"rollouts {n} repeat {r}: {k} tokens in {s:.1f} s ({k / s:.1f} tokens/s)", flush=True)
        rows, roll = [], {}
        for n in names:
            tps = [k / s for k, s in zip(toks[n], times[n])]
            st = Stats.of(tps)
            roll[n] = {"seconds": Stats.of(times[n]), "tokens": toks[n], "tokens_per_s": st,
                       "fraction_of_bound": st.median / bound}
            rows.append([n, f"{len(tasks)} x <= {cfg.rollout.max_turns} turns", Stats.of(times[n]).fmt(".1f"),
                         st.fmt(".1f"), f"{bound:.0f}", f"{st.median / bound:.1%}"])
        result["rollouts"] = roll
        print_table(f"one iteration's rollouts, median [min, max] of {args.repeats}",
                    ["engine", "batch", "seconds", "useful tokens/s", "bound (2P)", "fraction"], rows)

    if not args.skip_serve:
        levels = [int(c) for c in args.clients.split(",")]
        serve, rows = {n: [] for n in names}, []
        for c in levels:
            for n in names:
                lv = serve_level(engines[n], tok, c, args.requests, 8 if args.tiny else args.max_tokens, 32)
                serve[n].append(lv)
                print(f"serve {n} {c} clients: TTFT p50 {lv['ttft_p50_s']:.2f} s, {lv['tokens_per_s']:.1f} tokens/s",
                      flush=True)
                rows.append([n, c, lv["requests"], lv["ttft_s"].fmt(".2f"), lv["latency_s"].fmt(".2f"),
                             f"{lv['tokens_per_s']:.1f}"])
        result["serve"] = serve
        print_table("serving through the batcher (streamed, max_tokens 32): median [min, max] over requests",
                    ["engine", "clients", "requests", "time to first token (s)", "latency (s)", "tokens/s"], rows)
    for e in engines.values():
        if callable(getattr(e, "close", None)):
            e.close()
    print(f"wrote {finish(result, 'engines', args.out)}")
    return result


if __name__ == "__main__":
    main()
