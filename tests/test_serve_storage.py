"""A storage fault under ``selfrl serve`` (disk full, quota spent, read-only file system, store
locked, ...): a clear 507/503 in OpenAI's error shape, never a 500 carrying SQLite's text; a
stream that ends with an error event and ``[DONE]``, never a cut body; ``/health`` degraded;
a learner that pauses and resumes by itself; and nothing acknowledged lost.

The faults are real SQLite errors on the server's own store (``PRAGMA max_page_count``: the
store cannot grow, ``SQLITE_FULL``; ``query_only``: ``SQLITE_READONLY``; a second connection
holding the write lock: ``SQLITE_BUSY``) or ``OSError(ENOSPC)`` raised where the disk would
raise it; the last test fills a real tmpfs under a ``selfrl serve`` process
(``scripts/fault_serve.py``'s ``serve:disk_full``).

Old code: a 500 ``internal_error`` "OperationalError: database or disk is full"; a stream cut
after its last token; the learner dead for good; ``/health`` answering ``ok`` throughout.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import sqlite3
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from selfrl.record import adapters
from selfrl.serve.errors import server_error
from selfrl.record import served as records
from selfrl.serve.health import health
from selfrl.serve.service import Service
from selfrl.record.storage_errors import FaultKind, StorageFaultError, classify
from serving import API_KEY, running_server, tiny_serve_config

ROOT = Path(__file__).resolve().parents[1]
USER = [{"role": "user", "content": "What is 6*7?"}]
ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def call(method: str, url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict, object]:
    """``(status, headers, body)``: the body decoded as JSON, or for a stream its ``data:``
    payloads (``[DONE]`` as the string)."""
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, None if body is None else json.dumps(body).encode(), headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as f:
            raw = f.read().decode()
            if f.headers.get("content-type", "").startswith("text/event-stream"):
                return f.status, dict(f.headers), [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
                                                   for line in raw.splitlines() if line.startswith("data: ")]
            return f.status, dict(f.headers), json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def chat(url: str, **body) -> tuple[int, dict, object]:
    return call("POST", url + "/v1/chat/completions", {"model": "selfrl", "messages": USER, "max_tokens": 6, **body})


def fill(store) -> None:
    """The store cannot grow by one page from now on: its next write that needs one fails
    with ``SQLITE_FULL`` ("database or disk is full"), as on a full disk."""
    with store.lock:
        pages = store.conn.execute("PRAGMA page_count").fetchone()[0]
        store.conn.execute(f"PRAGMA max_page_count = {pages}")


def free(store) -> None:
    with store.lock:
        store.conn.execute("PRAGMA max_page_count = 4294967294")


def stored(service) -> int:
    with service.store.lock:
        return service.store.count_trajectories()


def assert_storage_error(status: int, headers: dict, body: dict, code: str, http_status: int) -> None:
    """An OpenAI-shaped 507/503 naming the fault, with what to do and no SQLite or OS text."""
    assert status == http_status, body
    err = body["error"]
    assert (err["type"], err["code"], err["param"]) == ("server_error", code, None), err
    assert err["message"].startswith("the server cannot record this request now: "), err
    assert "Retry after" in err["message"] and "recovers by itself" in err["message"]
    for raw in ("OperationalError", "database or disk", "Errno", "sqlite", "/tmp", "pytest"):
        assert raw not in err["message"], err["message"]
    assert int(headers["retry-after"]) >= 1


@pytest.fixture
def served(tiny_tokenizer, tiny_model_factory, tmp_path):
    """``(url, service)`` of a loopback server without a learner, on its own run directory."""
    model = tiny_model_factory(lora=True, eos_bias=-5.0)  # no early EOS: every answer has tokens to stream
    with running_server(model, tiny_tokenizer, tiny_serve_config(tmp_path / "run")) as (url, service):
        yield url, service


# -- the mapping ----------------------------------------------------------------------


def test_each_os_and_sqlite_storage_error_maps_to_a_507_or_503_that_names_it(tmp_path):
    kinds = {errno.ENOSPC: ("disk_full", 507), errno.EDQUOT: ("quota_exceeded", 507),
             errno.EROFS: ("read_only", 503), errno.EACCES: ("permission_denied", 503),
             errno.EPERM: ("permission_denied", 503), errno.EMFILE: ("too_many_open_files", 503),
             errno.EIO: ("io_error", 503)}
    for code, want in kinds.items():
        fault = classify(OSError(code, "x"), "/runs/a")
        assert (fault.kind.value, fault.status) == want and "/runs/a" in fault.message
    assert classify(OSError(errno.ENOENT, "x")) is None and classify(ValueError("x")) is None
    # real SQLite errors, by their result codes
    db = tmp_path / "x.db"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(sqlite3.OperationalError) as full:
        with conn:
            conn.execute("INSERT INTO t VALUES (?)", ("x" * 10_000,))
    conn.execute("PRAGMA query_only = ON")
    with pytest.raises(sqlite3.OperationalError) as read_only:
        with conn:
            conn.execute("INSERT INTO t VALUES (1)")
    conn.execute("PRAGMA query_only = OFF")
    conn.execute("PRAGMA busy_timeout = 0")
    other = sqlite3.connect(db)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError) as locked:
        with conn:
            conn.execute("INSERT INTO t VALUES (1)")
    other.rollback()
    got = [(f.kind, f.status, f.retry_after_s) for f in (classify(e.value) for e in (full, read_only, locked))]
    assert got == [(FaultKind.DISK_FULL, 507, 30), (FaultKind.READ_ONLY, 503, 30), (FaultKind.DATABASE_LOCKED, 503, 1)]
    # a fault wrapped in another exception is still found; a raised fault is itself
    try:
        try:
            raise ENOSPC
        except OSError as e:
            raise RuntimeError("saving the adapter failed") from e
    except RuntimeError as wrapped:
        assert classify(wrapped).kind == FaultKind.DISK_FULL
    fault = classify(full.value)
    assert classify(StorageFaultError(fault)) is fault


def test_an_unclassified_os_or_sqlite_error_is_a_500_without_its_text():
    for e in (sqlite3.DatabaseError("database disk image is malformed"),
              OSError(errno.ENOENT, "No such file or directory", "/secret/runs/a/selfrl.db")):
        status, body, headers = server_error(e)
        assert (status, body["error"]["code"], headers) == (500, "storage_error", {})
        assert "malformed" not in body["error"]["message"] and "/secret" not in body["error"]["message"]
        assert type(e).__name__ in body["error"]["message"] and "server log" in body["error"]["message"]
    status, body, _ = server_error(RuntimeError("boom"))  # anything else keeps its class and text
    assert (status, body["error"]["code"], body["error"]["message"]) == (
        500, "internal_error", "internal server error: RuntimeError: boom")


# -- requests -------------------------------------------------------------------------


def test_a_completion_that_cannot_be_stored_is_a_507_that_says_what_to_do(served):
    url, service = served
    service.storage.probe_every_s = 3600.0  # the fault lasts until the test frees the store
    assert chat(url)[0] == 200 and stored(service) == 1
    fill(service.store)
    status, headers, body = chat(url, messages=[{"role": "user", "content": "a long question " * 60}])
    assert_storage_error(status, headers, body, "disk_full", 507)
    assert stored(service) == 1  # nothing of it was recorded, and nothing was acknowledged
    # health: 503 degraded, with the reason and a Retry-After a load balancer understands
    code, body, headers = health(service)
    assert (code, body["status"], body["served_version"]) == (503, "degraded", 0)
    assert [r["code"] for r in body["reasons"]] == ["disk_full"] and headers["Retry-After"] == "30"
    since = body["reasons"][0]["since"]  # seconds since the epoch, and the same in UTC ISO 8601 beside it
    assert abs(since - time.time()) < 600
    assert body["reasons"][0]["since_utc"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
    status, _, answer = call("GET", url + "/health")
    assert status == 503 and answer["reasons"][0]["code"] == "disk_full"
    # while the fault lasts, a request that records is refused before anything is generated
    batches = service.batcher.batches
    status, headers, body = chat(url)
    assert_storage_error(status, headers, body, "disk_full", 507)
    assert service.batcher.batches == batches
    assert headers["x-should-retry"] == "false"
    # the openai client raises at once (without x-should-retry it would sleep Retry-After, 30 s, twice)
    from openai import APIStatusError, OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=2)
    t0 = time.monotonic()
    with pytest.raises(APIStatusError) as raised:
        client.chat.completions.create(model="selfrl", messages=USER, max_tokens=2)
    assert raised.value.status_code == 507 and time.monotonic() - t0 < 5
    status, _, body = chat(url, record=False)  # one that records nothing is served
    assert status == 200 and body["choices"][0]["message"]["content"] is not None
    # space is back: the first probe clears the fault; requests are recorded again; health is "ok"
    free(service.store)
    service.storage.probe_every_s = 0.0
    status, _, body = chat(url)
    assert status == 200 and stored(service) == 2
    assert call("GET", url + "/health")[::2] == (200, {"status": "ok", "served_version": 0})


def test_a_response_is_stored_with_all_its_choices_or_none(served, monkeypatch):
    url, service = served
    insert, calls = service.store.insert_trajectory, []

    def second_fails(*args):  # the disk fills up between the two choices
        calls.append(1)
        if len(calls) == 2:
            raise sqlite3.OperationalError("database or disk is full")
        return insert(*args)

    monkeypatch.setattr(service.store, "insert_trajectory", second_fails)
    status, headers, body = chat(url, n=2)
    assert_storage_error(status, headers, body, "disk_full", 507)
    assert len(calls) == 2 and stored(service) == 0  # old code: the first choice stayed, unacknowledged


def test_a_stream_whose_turn_cannot_be_stored_ends_with_an_error_event_then_done(served):
    url, service = served
    fill(service.store)  # no fault is known yet: the stream starts, and its turn fails to record at the end
    status, _, events = chat(url, stream=True, max_tokens=12, messages=[{"role": "user", "content": "q " * 400}])
    assert status == 200 and events[-1] == "[DONE]"
    tokens = [e for e in events[:-2] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert tokens, events  # tokens were streamed before the record failed
    err = events[-2]["error"]
    assert (err["code"], err["type"]) == ("disk_full", "server_error") and "OperationalError" not in err["message"]
    # no chunk said the turn finished: the client is never told that an unstored turn succeeded
    assert not any(e["choices"] and e["choices"][0]["finish_reason"] for e in events[:-2])
    assert stored(service) == 0
    # the openai client raises it, as it does for any error event
    from openai import APIError, OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    service.storage.probe_every_s = 0.0  # the known fault is probed away (the file system has space) ...
    with pytest.raises(APIError, match="disk that holds the server's run directory is full"):
        for _ in client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "q " * 400}],
                                                max_tokens=12, stream=True):
            pass  # ... so the stream starts again, and fails at its end the same way


def test_feedback_and_the_responses_api_on_a_full_store_are_refused_with_507(served):
    url, service = served
    status, _, answer = chat(url)
    assert status == 200
    fill(service.store)
    feedback = {"response_id": answer["id"], "rating": 1.0, "comment": "a long comment " * 600}
    status, headers, body = call("POST", url + "/v1/feedback", feedback, key=API_KEY)
    assert_storage_error(status, headers, body, "disk_full", 507)
    with service.store.lock:
        assert records.counts(service.store)["feedback_messages"] == 0  # not acknowledged, not stored
        assert records.find_response(service.store, answer["id"])["feedback"] is None
    for stream in (False, True):  # the fault is known now: refused before generating, streamed or not
        status, headers, body = call("POST", url + "/v1/responses", {"model": "selfrl", "input": "hi",
                                                                     "max_output_tokens": 4, "stream": stream})
        assert_storage_error(status, headers, body, "disk_full", 507)
    free(service.store)
    service.storage.probe_every_s = 0.0
    status, _, body = call("POST", url + "/v1/feedback", feedback, key=API_KEY)
    assert status == 200 and body["turns_updated"] == 1


def test_a_locked_or_read_only_store_is_a_503_that_names_it(served):
    url, service = served
    service.storage.probe_every_s = 0.0
    with service.store.lock:
        service.store.conn.execute("PRAGMA busy_timeout = 0")  # the default waits 5 s for the lock
    other = sqlite3.connect(service.run_dir / "selfrl.db")
    other.execute("BEGIN IMMEDIATE")  # a backup or a sqlite3 shell holding the write lock
    try:
        status, headers, body = chat(url)
        assert_storage_error(status, headers, body, "database_locked", 503)
        assert headers["retry-after"] == "1" and "locked by another process" in body["error"]["message"]
        assert headers["x-should-retry"] == "true"  # a lock is released within seconds
    finally:
        other.rollback()
        other.close()
    assert chat(url)[0] == 200
    with service.store.lock:
        service.store.conn.execute("PRAGMA query_only = ON")
    status, headers, body = chat(url)
    assert_storage_error(status, headers, body, "read_only", 503)
    with service.store.lock:
        service.store.conn.execute("PRAGMA query_only = OFF")
    assert chat(url)[0] == 200 and stored(service) == 2


# -- the learner ----------------------------------------------------------------------


def rated(service, n: int = 4) -> list[str]:
    """``n`` stored turns of one group with feedback +1 / -1 in turn (ready for the learner)."""
    from selfrl.core.trajectory import Trajectory

    ids = []
    for i in range(n):
        t = Trajectory("arith", "arith", service.engine.version, prompt_len=3, token_ids=[5, 6, 7, 10 + i, 11],
                       completion_mask=[0, 0, 0, 1, 1], logprobs=[0.0] * 5)
        records.add_turn(service.store, service.run_id, t, t.id, 0, t.id, "arith", t.id)
        records.apply_feedback(service.store, t.id, 0, "explicit", (-1.0) ** i)
        ids.append(t.id)
    return ids


def wait_for(check, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def learning(tiny_tokenizer, tiny_model_factory, tmp_path):
    """A service whose learner trains on every 4 rated turns and retries every 0.05 to 0.2 s."""
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    cfg = tiny_serve_config(tmp_path / "run", min_batch=4, max_batch=4, feedback_wait_s=600.0, poll_s=0.05,
                            retry_s=0.05, retry_max_s=0.2)
    cfg.collapse.max_kl = 5.0
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    service.storage.probe_every_s = 0.0
    yield service
    service.close()


class SafetensorError(Exception):
    """As safetensors' native writer raises it: the OS's text, no errno."""


@pytest.mark.parametrize("refusal", [
    OSError(errno.ENOSPC, "No space left on device"),
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
], ids=["oserror", "safetensors"])
def test_the_learner_pauses_on_a_full_disk_and_resumes_by_itself(learning, monkeypatch, caplog, refusal):
    service = learning
    learner = service.learner
    served_state = adapters.lora_state(service.engine.model)
    rated(service)
    caplog.set_level(logging.WARNING, logger="selfrl.serve")
    with monkeypatch.context() as disk:  # the disk is full: the adapter's save and every probe fail
        def save_pretrained(path, *args, **kwargs):
            (Path(path) / "adapter_model.safetensors").write_bytes(b"half")
            raise refusal

        def probe(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        disk.setattr(learner.learner.model, "save_pretrained", save_pretrained)
        disk.setattr("selfrl.serve.health.probe_writable", probe)
        learner.start()
        wait_for(lambda: learner.paused is not None)
        time.sleep(0.5)  # a few retries, each refused by the probe
        assert learner.is_alive() and learner.error is None and learner.paused.kind == FaultKind.DISK_FULL
        assert learner.status()["paused"]["code"] == "disk_full"
        code, body, _ = health(service)
        assert code == 503 and [r["code"] for r in body["reasons"]] == ["disk_full", "learner_paused"]
        # the last good adapter stays served and intact; the failed save left nothing behind
        assert service.engine.version == 0 and [v.version for v in service.ledger.all()] == [0]
        now = adapters.lora_state(service.engine.model)
        assert all(now[k].equal(served_state[k]) for k in served_state)
        assert adapters.verify_version(adapters.version_dir(service.run_dir, 0)) is None
        assert sorted(p.name for p in (service.run_dir / "adapters").iterdir()) == ["v000000"]
        assert records.counts(service.store)["pending"] == 4  # the turns wait; none is lost
        assert learner.updates == 0
    # space is back: the learner resumes by itself and trains on the same turns
    wait_for(lambda: learner.updates == 1 and not learner.busy and learner.paused is None)  # resumed after the step
    assert learner.paused is None and learner.is_alive() and learner.error is None
    assert learner.last["turns"] == 4 and learner.last["version"] == 1
    assert [v.version for v in service.ledger.all()] == [0, 1]
    assert adapters.verify_version(adapters.version_dir(service.run_dir, 1)) is None
    assert records.counts(service.store)["trained"] == 4
    resumed = [e for e in service.store.events() if e["kind"] == "learner_resumed"]
    assert len(resumed) == 1 and resumed[0]["data"]["kind"] == "disk_full" and resumed[0]["data"]["paused_s"] > 0.4
    lines = [r.getMessage() for r in caplog.records if "background learner" in r.getMessage()]
    assert len(lines) == 2 and "paused: disk_full" in lines[0] and "resumed after" in lines[1], lines
    assert health(service)[:2] == (200, {"status": "ok", "served_version": service.engine.version})


def test_an_update_that_fails_after_its_save_rejects_its_candidate_and_trains_again(learning, monkeypatch):
    service = learning
    learner = service.learner
    learner.ensure_champion_validated()
    ids = rated(service)
    mark, failed = records.mark, []

    def full_once(store, trajs, status, version):  # the disk fills up right after the candidate was saved
        if status == "trained" and not failed:
            failed.append(version)
            raise sqlite3.OperationalError("database or disk is full")
        return mark(store, trajs, status, version)

    monkeypatch.setattr(records, "mark", full_once)
    assert learner.until_done(learner.tick)  # pauses, probes, undoes the failed update, trains again
    assert failed == [1] and learner.paused is None
    v1, v2 = service.ledger.get(1), service.ledger.get(2)
    assert v1.status.value == "rejected" and v1.metrics["storage_fault"] == "disk_full"
    assert v2.parent == 0 and learner.last["version"] == 2  # trained again from the champion
    reject = next(e for e in service.store.events() if e["kind"] == "reject")
    assert "version 1 rejected: its update failed on a storage fault (disk_full)" in reject["message"]
    with service.store.lock:
        assert {records.find_response(service.store, i)["trained_in"] for i in ids} == {2}


def test_a_candidate_whose_row_cannot_be_written_leaves_no_folder(learning, monkeypatch):
    service = learning
    add = service.store.add_version

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(service.store, "add_version", full)
    with pytest.raises(sqlite3.OperationalError):
        service.ledger.save_candidate(service.learner.model, 0)
    assert sorted(p.name for p in (service.run_dir / "adapters").iterdir()) == ["v000000"]
    monkeypatch.setattr(service.store, "add_version", add)
    assert service.ledger.save_candidate(service.learner.model, 0).version == 1  # the number is free again


def test_health_says_a_stopped_learner_is_degraded_but_serving(learning, monkeypatch):
    service = learning

    def broken():
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(service.learner, "tick", broken)
    service.learner.start()
    wait_for(lambda: not service.learner.is_alive())
    code, body, headers = health(service)
    assert (code, body["status"], headers) == (200, "degraded", {})  # serving works: keep it in rotation
    assert [r["code"] for r in body["reasons"]] == ["learner_stopped"]
    assert "secret" not in json.dumps(body)  # the reason is in /admin/status, behind the API key


# -- a real disk, a real server ---------------------------------------------------------


@pytest.fixture
def disk(tmp_path):
    """``(folder, fault_serve_disk)``: a 4 MB tmpfs mounted at ``folder`` (skipped without root)."""
    import subprocess

    sys.path.insert(0, str(ROOT / "scripts"))
    import fault_serve_disk

    why = fault_serve_disk.tmpfs_unavailable(tmp_path)
    if why:
        pytest.skip(f"needs a tmpfs to fill: {why}")
    folder = tmp_path / "disk"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], check=True)
    yield folder, fault_serve_disk
    subprocess.run(["umount", "-l", str(folder)], check=False)


def test_health_sees_a_full_disk_before_any_write_fails(disk, tiny_tokenizer, tiny_model_factory):
    folder, fault_serve_disk = disk
    model = tiny_model_factory(lora=True, eos_bias=-5.0)
    with running_server(model, tiny_tokenizer, tiny_serve_config(folder / "run")) as (url, service):
        service.storage.probe_every_s = 0.0
        assert chat(url)[0] == 200
        filler = fault_serve_disk.fill_disk(folder)
        status, _, body = call("GET", url + "/health")  # nothing has failed yet: statvfs says it
        assert status == 503 and [r["code"] for r in body["reasons"]] == ["disk_full"]
        batches = service.batcher.batches
        for stream in (False, True):  # refused before generating, so no stream is ever cut
            status, headers, body = chat(url, stream=stream)
            assert_storage_error(status, headers, body, "disk_full", 507)
        assert service.batcher.batches == batches and stored(service) == 1
        filler.unlink()
        assert call("GET", url + "/health")[::2] == (200, {"status": "ok", "served_version": 0})
        assert chat(url)[0] == 200 and stored(service) == 2


def test_a_read_only_file_system_is_seen_before_any_write(disk):
    import subprocess

    from selfrl.serve.health import StorageWatch

    folder, _ = disk  # (a file system with a file open for writing, as a live store's, cannot be remounted)
    watch = StorageWatch(folder, probe_every_s=0.0)
    assert watch.current() is None
    subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
    try:
        assert watch.current().kind == FaultKind.READ_ONLY
        with pytest.raises(StorageFaultError, match="is read-only"):
            watch.check()
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(folder)], check=True)
    assert watch.current() is None  # the probe write succeeds again


def test_serve_on_a_full_disk_exits_with_one_line_that_says_what_to_do(disk, model_dir):
    import os
    import socket
    import subprocess

    folder, fault_serve_disk = disk
    (folder / "run").mkdir()
    fault_serve_disk.fill_disk(folder)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "selfrl.cli", "serve", "--model", str(model_dir), "--run-dir",
                           str(folder / "run"), "--port", str(port), "--no-learn"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("selfrl: error: cannot start: the disk that holds ") and "is full" in line, line


def test_a_full_tmpfs_under_a_serve_process_is_refused_cleanly_and_the_learner_resumes(model_dir, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import fault_serve_disk

    why = fault_serve_disk.tmpfs_unavailable(tmp_path)
    if why:
        pytest.skip(f"needs a tmpfs to fill: {why}")
    out = fault_serve_disk.run_serve_disk_full(model_dir, tmp_path, timeout=300)
    assert out.recovered, (out.detail, out.notes)
    assert out.failed_requests == 0 and out.bad_versions_served == 0
    refused = [r for r in out.responses if r["status"] in (503, 507) or r["error"].startswith("stream error")]
    assert refused and all("disk_full" in r["error"] for r in refused)
    assert not [r for r in out.responses if r["status"] == 500 or "cut" in r["error"]]
