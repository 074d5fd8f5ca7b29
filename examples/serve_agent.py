"""An agent written against the OpenAI API learns from its users through `selfrl serve`.

    python examples/serve_agent.py                 # starts `selfrl serve` on the embedded model
    python examples/serve_agent.py --url http://127.0.0.1:8000/v1   # use a server you started

The agent is plain `openai` client code with a calculator tool that runs on the
client: it sends the user's arithmetic question with `tools=[calculator]`, runs the
tool calls it gets back, and returns the final answer. Nothing in it knows about
selfrl except `base_url` (and an optional `task_key`, sent with `extra_body`, that
tells the learner which requests belong together).

A simulated user checks each final answer: a right one gets a thumbs-up
(`rating: 1`), a wrong one a correction (`corrected: true` with the right answer) via
`POST /v1/feedback`. The server turns that into rewards, trains in the background,
validates each candidate on its own held-out set and swaps promoted versions in.

Held-out success is measured from the client side, on tasks neither the agent's
traffic nor the server's gate ever saw, greedy, with `record: false`, before the
session and after each round. Prints a table (each round's success with its 95 % Wilson
interval, and its paired difference from the base on the same tasks) and writes it as JSON,
with the per-task outcomes.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

from selfrl.rollout.agent import DEFAULT_SYSTEM_PROMPT
from selfrl.core.stats import paired_difference_ci, wilson_interval
from selfrl.core.tasks import Task, assert_disjoint, split_tasks
from selfrl.envs import get_env
from selfrl.core.tools import get_tool

CALCULATOR = get_tool("calculator")
TOOLS = [CALCULATOR.openai_schema()]
# The same worked example `selfrl run` shows, written as OpenAI messages.
EXAMPLE = [
    {"role": "user", "content": "State the final answer to the following arithmetic problem: 38 - 5 + 14 ="},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_example", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": "38 - 5 + 14"})}}]},
    {"role": "tool", "tool_call_id": "call_example", "content": "47"},
    {"role": "assistant", "content": "<answer>47</answer>"},
]


def solve(client: OpenAI, task: Task, temperature: float, record: bool, max_turns: int = 3) -> tuple[str | None, str | None]:
    """The agent: returns (final answer text, id of the response that gave it)."""
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *EXAMPLE,
                {"role": "user", "content": task.question}]
    for _ in range(max_turns):
        r = client.chat.completions.create(model="selfrl", messages=messages, tools=TOOLS, temperature=temperature,
                                           max_tokens=48, extra_body={"task_key": "arithmetic", "record": record})
        msg = r.choices[0].message
        if not msg.tool_calls:
            return msg.content, r.id
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            try:
                result = CALCULATOR.fn(**json.loads(call.function.arguments))
            except Exception as e:  # the tool's error goes back to the model, as a real agent would do
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None, r.id


def post(url: str, body: dict, key: str) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as f:
        return json.loads(f.read())


def get(url: str, key: str) -> dict:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as f:
        return json.loads(f.read())


def held_out(client: OpenAI, source, tasks: list[Task], workers: int) -> list[bool]:
    """Greedy, unrecorded answers to ``tasks``: whether each is right, in the order of ``tasks``."""
    with ThreadPoolExecutor(workers) as pool:
        answers = list(pool.map(lambda t: solve(client, t, 0.0, record=False)[0], tasks))
    return [bool(source.correct(t, source.extract_answer(a or ""))) for t, a in zip(tasks, answers)]


def scored(correct: list[bool], base: list[bool] | None) -> dict:
    """A row's held-out fields: success, its Wilson 95 % interval, and the paired difference
    from ``base`` (the same tasks before any update) with its normal-approximation 95 % interval."""
    k, n = sum(correct), len(correct)
    row = {"held_out": k / n, "held_out_correct": correct, "held_out_ci": list(wilson_interval(k, n))}
    if base is not None:
        row["minus_base"] = list(paired_difference_ci(base, correct))
    return row


def start_server(run_dir: str, key: str, args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "selfrl.cli", "serve", "--run-dir", run_dir, "--port", str(port),
           "--min-batch", str(args.min_batch), "--feedback-wait", "600", "--val-size", str(args.gate_size),
           "--learning-rate", str(args.learning_rate)] + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, env={**os.environ, "SELFRL_API_KEY": key})
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"selfrl serve exited with code {proc.returncode}")
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return proc, base
        except OSError:
            time.sleep(0.5)
    raise SystemExit("selfrl serve did not start within 5 minutes")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="base URL of a running server (…/v1); default: start one")
    p.add_argument("--model", help="model for the started server (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--run-dir", default=f"runs/serve-demo-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--rounds", type=int, default=4, help="rounds of user traffic")
    p.add_argument("--tasks-per-round", type=int, default=48)
    p.add_argument("--held-out", type=int, default=96, help="client-side held-out tasks")
    p.add_argument("--gate-size", type=int, default=64, help="the server's own validation tasks")
    p.add_argument("--min-batch", type=int, default=48, help="turns with feedback per update")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=0.8, help="the agent's sampling temperature")
    p.add_argument("--workers", type=int, default=16, help="concurrent users")
    p.add_argument("--out", default=None, help="JSON results (default: <run-dir>/serve_agent.json)")
    args = p.parse_args()

    key = os.environ.get("SELFRL_API_KEY") or secrets.token_hex(16)
    proc = None
    if args.url:
        base = args.url.removesuffix("/v1")
    else:
        proc, base = start_server(args.run_dir, key, args)
    client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=600)
    source = get_env("chain_sum")
    n_train = args.rounds * args.tasks_per_round
    traffic, held = split_tasks(source, n_train, args.held_out, train_seed=5000, val_seed=6000)
    assert_disjoint(traffic, held)
    rows = []
    t0 = time.time()
    try:
        before = held_out(client, source, held, args.workers)
        rows.append({"round": 0, **scored(before, None), "served_version": None,
                     "traffic_correct": None, "elapsed_s": time.time() - t0})
        print(f"before: held-out {rows[0]['held_out']:.3f}", flush=True)
        for rnd in range(1, args.rounds + 1):
            batch = traffic[(rnd - 1) * args.tasks_per_round: rnd * args.tasks_per_round]
            with ThreadPoolExecutor(args.workers) as pool:
                outs = list(pool.map(lambda t: solve(client, t, args.temperature, record=True), batch))
            right = 0
            for task, (answer, rid) in zip(batch, outs):
                ok = source.correct(task, source.extract_answer(answer or ""))
                right += ok
                body = {"response_id": rid, "rating": 1.0} if ok else {
                    "response_id": rid, "corrected": True, "correction": task.answer}
                post(base + "/v1/feedback", body, key)
            # wait until the learner has used this round's feedback (an update and its gate)
            while True:
                st = get(base + "/admin/status", key)
                learner = st["learner"] or {}
                if st["turns"]["pending_with_feedback"] < args.min_batch and not learner.get("busy"):
                    break
                time.sleep(2)
            rows.append({"round": rnd, "traffic_correct": right / len(batch), "traffic_right": right,
                         "served_version": st["served_version"],
                         **scored(held_out(client, source, held, args.workers), before), "elapsed_s": time.time() - t0,
                         "updates": st["learner"]["updates"] if st["learner"] else 0})
            print(f"round {rnd}: traffic correct {right}/{len(batch)}, served version {st['served_version']}, "
                  f"held-out {rows[-1]['held_out']:.3f} ({rows[-1]['elapsed_s']:.0f} s)", flush=True)
        status = get(base + "/admin/status", key)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    out = Path(args.out or Path(args.run_dir) / "serve_agent.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "versions": status["versions"], "swap_ms": status["swap_ms"],
                               "args": vars(args)}, indent=2))
    print("\n| round | traffic correct | served version | held-out success [95 % CI] | minus the base, paired [95 % CI] | elapsed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        tc = "" if r["traffic_correct"] is None else f"{r['traffic_right']}/{args.tasks_per_round}"
        lo, hi = r["held_out_ci"]
        diff = "" if "minus_base" not in r else "{:+.1f} [{:+.1f}, {:+.1f}]".format(*(100 * x for x in r["minus_base"]))
        print(f"| {r['round']} | {tc} | {r['served_version'] if r['served_version'] is not None else 0} | "
              f"{sum(r['held_out_correct'])}/{len(r['held_out_correct'])} = {100 * r['held_out']:.1f} % "
              f"[{100 * lo:.1f}, {100 * hi:.1f}] | {diff} | {r['elapsed_s'] / 60:.1f} min |")
    print(f"versions: {[(v['version'], v['status'], v['val_success']) for v in status['versions']]}")
    print(f"swap times (ms): {status['swap_ms']}\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
