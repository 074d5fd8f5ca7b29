"""Hot-swap under load: clients keep sending while adapter versions are swapped in."""

import threading
import time

import torch
from openai import OpenAI
from peft import set_peft_model_state_dict

from selfrl.record.adapters import lora_state
from selfrl.record import served as records
from serving import add_version, recomputed_logps, running_server, tiny_serve_config

TEMPERATURE = 0.8


def test_swaps_under_load_fail_nothing_and_every_response_matches_its_version(tiny_tokenizer, tiny_model_factory, tmp_path):
    model = tiny_model_factory(lora=True, eos_bias=1.0)
    cfg = tiny_serve_config(tmp_path / "run")
    states = {0: lora_state(model)}
    swap_started = {0: 0.0}  # version -> monotonic time its swap began
    served_from = {0: 0.0}  # version -> monotonic time the swap had finished
    results, failures = [], []
    with running_server(model, tiny_tokenizer, cfg) as (url, service):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stop = threading.Event()

        def user(k: int) -> None:
            i = 0
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    r = client.chat.completions.create(
                        model="selfrl", messages=[{"role": "user", "content": f"user {k} asks {i}"}],
                        max_tokens=6 + (i % 5), temperature=TEMPERATURE, stream=(i % 3 == 0))
                    if i % 3 == 0:  # streamed: the id and version come with every chunk
                        chunks = list(r)
                        r = chunks[0]
                    results.append((r.id, r.model_extra["adapter_version"], t0, time.monotonic()))
                except Exception as e:  # noqa: BLE001 - every failure is counted
                    failures.append(repr(e))
                i += 1

        threads = [threading.Thread(target=user, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for v in range(1, 7):  # six swaps while the clients keep sending
            time.sleep(0.3)
            state = {k: torch.randn_like(x) * 0.3 for k, x in states[0].items()}
            add_version(service, state, v, parent=v - 1)
            states[v] = state
            swap_started[v] = time.monotonic()
            service.publish(v, state, "test")
            served_from[v] = time.monotonic()
        time.sleep(0.4)
        stop.set()
        for t in threads:
            t.join()
        assert service.engine.version == 6
        with service.store.lock:
            trajs = {t.id: t for t in service.store.trajectories()}
            rows = {rid: records.find_response(service.store, rid) for rid, *_ in results}

    assert failures == []
    versions = {v for _, v, _, _ in results}
    assert len(results) >= 20 and len(versions) >= 4, (len(results), versions)
    ref = tiny_model_factory(lora=True, eos_bias=1.0)  # a separate copy to recompute with
    for rid, version, start, end in results:
        assert swap_started[version] <= end  # the version existed when the response was produced
        # a request sent after a swap finished never runs on an older version
        assert version >= max(v for v, t in served_from.items() if t <= start)
        traj = trajs[rows[rid]["trajectory_id"]]
        assert traj.adapter_version == version
        set_peft_model_state_dict(ref, states[version])
        sampled = torch.tensor([lp for lp, m in zip(traj.logprobs, traj.completion_mask) if m])
        assert torch.allclose(sampled, recomputed_logps(ref, traj, TEMPERATURE), atol=1e-4), (rid, version)
        other = (version + 1) % 7
        set_peft_model_state_dict(ref, states[other])
        assert not torch.allclose(sampled, recomputed_logps(ref, traj, TEMPERATURE), atol=1e-3)
