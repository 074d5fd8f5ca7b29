"""`selfrl serve` on each sampling backend side by side: time to first token and tokens/s
at 1, 8 and 32 concurrent clients, over real HTTP.

    flock /tmp/selfrl-heavy.lock nice -n 5 .venv/bin/python benchmarks/bench_serve.py   # real model, ~5-10 min
    .venv/bin/python benchmarks/bench_serve.py --tiny                                  # seconds

One server per backend (``--engines``, default ``reference,slots``) runs in this process
on loopback, all over the same weights (no learner). At each level ``c`` concurrent
clients (threads, the real ``openai`` client) each send ``--requests`` streamed chat
requests one after the other (``max_tokens`` 32, temperature 1). The backends take turns
level by level (the order flips at every level), so that the machine's load falls on
them alike.

* **time to first token**: from sending the request to the first streamed chunk that
  carries content (what a user sees first); median and p90 (nearest rank) over requests.
* **tokens/s**: every completion token (``usage`` of the stream) over the level's wall time.
* **where the clients run** (``--client-process``): by default the client threads share
  the server's Python process (and its GIL); with ``--client-process`` each level's clients
  run in a child process, as a deployment's clients do. ``--client-process both`` measures
  both ways at each level, side by side.

The target: a median time to first token under 0.5 s at 8 clients on
the embedded SmolLM2-135M. The load average at start and end is in the JSON and printed:
on a loaded machine every figure is slower, the ratios less so.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Stats, base_parser, command_line, envelope, finish, loadavg, model_name, print_table, run_child, run_clients,
    serve_app, write_result,
)

QUESTIONS = ["What is 17 + 25?", "Name three colours.", "Write one sentence about the sea.", "What is 9 * 8?",
             "Say hello in French.", "Count from one to five.", "What is the capital of Italy?", "Add 38 and 47."]


def p90(values: list[float]) -> float:
    """The nearest-rank 90th percentile.

    >>> p90([float(i) for i in range(1, 11)])
    9.0
    """
    s = sorted(values)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)]


def start_server(engine: str, model, tok, run_dir: Path, max_tokens: int):
    """``selfrl serve``'s app for ``engine`` on a free loopback port; returns (url, uvicorn server, thread, service)."""
    from selfrl.serve.app import create_app
    from selfrl.serve.main import load_serve_config
    from selfrl.serve.service import Service

    cfg = load_serve_config(None, {"run_dir": str(run_dir), "engine": engine, "max_tokens_default": max_tokens,
                                   "learner.enabled": False})
    service = Service(model, tok, cfg)
    url, server, thread = serve_app(create_app(service, None, learn=False), f"the {engine} server")
    return url, server, thread, service


def one_request(client, content: str, max_tokens: int, extra_body: dict | None = None) -> tuple[float, float, int]:
    """(time to first content, latency, completion tokens) of one streamed request, in seconds;
    ``extra_body`` adds server-specific fields (llama-server's sampler settings)."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": content}],
                                            max_tokens=max_tokens, temperature=1.0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra_body)
    for chunk in stream:
        if first is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    t1 = time.perf_counter()
    return (first or t1) - t0, t1 - t0, tokens


def serve_level(url: str, clients: int, requests: int, max_tokens: int, extra_body: dict | None = None) -> dict:
    """TTFT, latency and tokens/s of ``clients`` concurrent streaming clients against ``url``
    (any OpenAI-compatible server; ``extra_body`` goes into every request)."""
    from openai import OpenAI

    ttft, latency, tokens, errors = [], [], [], []
    lock = threading.Lock()

    def client(c: int) -> None:
        api = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
        for k in range(requests):
            try:
                f, lat, n = one_request(api, f"({c}.{k}) {QUESTIONS[(c + k) % len(QUESTIONS)]}", max_tokens,
                                        extra_body)
            except Exception as e:  # noqa: BLE001 - counted and reported, never hidden
                with lock:
                    errors.append(repr(e)[:200])
                continue
            with lock:
                ttft.append(f)
                latency.append(lat)
                tokens.append(n)

    wall = run_clients(client, clients)
    if not ttft:
        raise RuntimeError(f"every request failed: {errors[:3]}")
    return {"clients": clients, "requests": len(ttft), "errors": errors, "ttft_s": Stats.of(ttft),
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": p90(ttft), "latency_s": Stats.of(latency),
            "latency_p90_s": p90(latency), "completion_tokens": sum(tokens), "wall_s": wall,
            "tokens_per_s": sum(tokens) / wall, "loadavg": loadavg()}


def level_in_child(url: str, clients: int, requests: int, max_tokens: int, out: Path) -> dict:
    """:func:`serve_level` run by a child process (``--against URL``): the clients do not share
    the server's process. Returns the same dict (``ttft_s`` and ``latency_s`` as :class:`Stats`)."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [str(Path(__file__).resolve()), "--against", url, "--clients", str(clients), "--requests", str(requests),
            "--max-tokens", str(max_tokens), "--out", str(out)]
    lv = run_child(argv, out / "serve_level.json")
    for key in ("ttft_s", "latency_s"):
        lv[key] = Stats(**lv[key])
    return lv


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__, repeats=False)
    p.add_argument("--engines", default="reference,slots", help="backends, comma-separated (selfrl.engines)")
    p.add_argument("--clients", default="1,8,32", help="levels: concurrent clients, comma-separated")
    p.add_argument("--requests", type=int, default=3, help="requests per client at each level")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request")
    p.add_argument("--client-process", choices=["no", "yes", "both"], default="no",
                   help="run each level's clients in a child process (yes), in this one (no), or both ways")
    p.add_argument("--against", default=None, help=argparse.SUPPRESS)  # child mode: one level against this URL
    args = p.parse_args(argv)
    if args.against:  # the child of --client-process: one level, its dict as JSON, nothing else
        lv = serve_level(args.against, int(args.clients), args.requests, args.max_tokens)
        write_result("serve_level", lv, args.out)
        return lv
    import torch

    from selfrl.model.load import build_policy
    from selfrl.serve.main import load_serve_config

    result = envelope(args, command_line("bench_serve.py", argv))
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    max_tokens = 8 if args.tiny else args.max_tokens
    cfg = load_serve_config(None, {"model.name": model_name(args, work), "run_dir": str(work / "policy")})
    model, tok = build_policy(cfg)
    names = args.engines.split(",")
    servers = {n: start_server(n, model, tok, work / n, max_tokens) for n in names}
    result.update({"model": cfg.model.name, "engines": names, "max_tokens": max_tokens,
                   "requests_per_client": args.requests, "torch_threads": torch.get_num_threads()})
    from openai import OpenAI

    for n, (url, *_) in servers.items():  # warm-up: first allocations, the grammar-free path, the prefix cache
        one_request(OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600), "Hi", 4)
    levels = [int(c) for c in args.clients.split(",")]
    ways = {"no": ["thread"], "yes": ["process"], "both": ["thread", "process"]}[args.client_process]
    result["clients_in"] = ways
    rows_of = [f"{n}/{w}" if len(ways) > 1 else n for n in names for w in ways]  # the table's engine column
    serve: dict[str, list[dict]] = {n: [] for n in rows_of}
    for i, c in enumerate(levels):
        for n in (names if i % 2 == 0 else names[::-1]):
            for w in (ways if i % 2 == 0 else ways[::-1]):
                if w == "process":
                    lv = level_in_child(servers[n][0], c, args.requests, max_tokens, work / f"child-{n}-{c}")
                else:
                    lv = serve_level(servers[n][0], c, args.requests, max_tokens)
                lv["clients_in"] = w
                key = f"{n}/{w}" if len(ways) > 1 else n
                serve[key].append(lv)
                print(f"{key} {c} clients: TTFT p50 {lv['ttft_p50_s']:.2f} s p90 {lv['ttft_p90_s']:.2f} s, "
                      f"{lv['tokens_per_s']:.1f} tokens/s, load {lv['loadavg']:.1f}", flush=True)
    names = rows_of
    for n, (_, server, thread, service) in servers.items():
        server.should_exit = True
        thread.join(timeout=60)
        service.close()
    rows = []
    for k, c in enumerate(levels):
        for n in names:
            lv = serve[n][k]
            rows.append([c, n, lv["requests"], f"{lv['ttft_p50_s']:.2f}", f"{lv['ttft_p90_s']:.2f}",
                         f"{lv['latency_s'].median:.2f}", f"{lv['tokens_per_s']:.1f}", len(lv["errors"]),
                         f"{lv['loadavg']:.1f}"])
    result["serve"] = serve
    print_table(f"selfrl serve over HTTP, streamed, max_tokens {max_tokens}, {args.requests} requests per client",
                ["clients", "engine", "requests", "TTFT p50 (s)", "TTFT p90 (s)", "latency p50 (s)", "tokens/s",
                 "errors", "load avg"], rows)
    if len(names) >= 2:
        base, other = names[0], names[1]
        ratios, rrows = [], []
        for k, c in enumerate(levels):
            a, b = serve[base][k], serve[other][k]
            r = {"clients": c, "ttft_p50": b["ttft_p50_s"] / a["ttft_p50_s"], "ttft_p90": b["ttft_p90_s"] / a["ttft_p90_s"],
                 "tokens_per_s": b["tokens_per_s"] / a["tokens_per_s"]}
            ratios.append(r)
            rrows.append([c, f"{r['ttft_p50']:.2f}", f"{r['ttft_p90']:.2f}", f"{r['tokens_per_s']:.2f}"])
        result["ratios"] = {"of": f"{other} / {base}", "levels": ratios}
        print_table(f"{other} / {base} (TTFT below 1 and tokens/s above 1 favour {other})",
                    ["clients", "TTFT p50", "TTFT p90", "tokens/s"], rrows)
    print(f"load average: {result['loadavg_start']:.1f} at start, {loadavg():.1f} at the end")
    print(f"wrote {finish(result, 'serve', args.out)}")
    return result


if __name__ == "__main__":
    main()
