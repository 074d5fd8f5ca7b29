"""The serving report's "gate result" of each version says what happened to it: the gate's
verdict, or what rolled it back or rejected it before or after the gate (selfrl.report.serve).

The store is written through the version ledger's own steps (selfrl.record.versions.Ledger,
selfrl.serve.chain.CandidateChain), so each version carries the reason the server records."""

from __future__ import annotations

from selfrl.record import served as records
from selfrl.record.store import Store
from selfrl.record.versions import Champion, Ledger
from selfrl.report.serve import write_serve_report
from selfrl.serve.chain import CandidateChain


def gate_results(text: str) -> dict[int, str]:
    """``{version: gate result}`` of the report's versions table."""
    table = text.split("## Versions and gate results")[1].split("\n## ")[0]
    rows = [r.strip("|").split("|") for r in table.splitlines() if r.startswith("| ") and r[2].isdigit()]
    return {int(r[0]): r[-1].strip() for r in rows}


def test_each_version_s_gate_result_says_what_happened_to_it(tmp_path):
    s = Store(tmp_path / "selfrl.db")
    records.init(s)
    run = s.start_run({"serve": {}})
    ledger = Ledger(s, run, tmp_path)
    ledger.load_state = lambda version: {}  # an admin's rollback loads the tensors: none in this store
    add = lambda v, parent, status="candidate", metrics=None: s.add_version(v, parent, f"/a/{v}", status, metrics or {})
    add(0, None, "base", {"val/success": 0.2})
    add(1, 0, "promoted", {"val/success": 0.5})
    add(2, 1, "promoted", {"val/success": 0.6})
    ledger.champion = Champion(2, 0.6, {})
    assert ledger.roll_back_to(1) == [2]  # an admin: 2 served, then rolled back
    add(3, 1, "candidate", {"val/success": 0.4})  # validated, then a collapse rule fired before the gate decided
    assert ledger.roll_back_collapse("kl_spike") == [3]
    add(4, 1)  # a chain (gate.eval_every = 2): 4 never validated, 5 validated and promoted
    add(5, 4, "promoted", {"val/success": 0.55})
    ledger.champion = Champion(5, 0.55, {})
    chain = CandidateChain(ledger, 3)
    add(6, 5)
    add(7, 6)
    chain.pending = [6, 7]
    add(8, 7, "rejected", {"val/success": 0.1})  # the chain's last: failed the gate, its chain rejected unvalidated
    assert chain.end("the chain's last version 8 was not promoted") == [6, 7]
    add(9, 5, "rejected", {"corrupt": "adapter_model.safetensors is missing"})
    add(10, 5)
    assert ledger.reject_unverified(10, "logprobs differ", 0.4)
    add(11, 5, "promoted", {"val/success": 0.7})
    s.set_version_status(11, "rolled_back", {"corrupt": "checksum mismatch"})  # as Ledger.latest_servable marks it
    add(12, 2, "rejected", {"parent_rolled_back": 2})
    add(13, 5, "promoted", {"val/success": 0.8})
    assert ledger.roll_back_to(5) == [13]
    assert ledger.roll_back_to(13) == []  # served again
    add(14, 13)
    s.close()
    with Store(tmp_path / "selfrl.db", readonly=True) as s:
        got = gate_results(write_serve_report(tmp_path / "out", s, "serve").read_text())
    assert got == {
        0: "base model",
        1: "passed the gate; served",
        2: "passed the gate; served, then rolled back by an admin (to version 1)",
        3: "rolled back by the collapse rules (kl_spike) before the gate decided; never served",
        4: "never validated (a gate.eval_every chain went on from it); never served",
        5: "passed the gate; served",
        6: "never validated (a gate.eval_every chain); rejected with its chain: the chain's last version 8 was "
           "not promoted",
        7: "never validated (a gate.eval_every chain); rejected with its chain: the chain's last version 8 was "
           "not promoted",
        8: "failed the gate; never served",
        9: "not promoted: its folder is damaged (adapter_model.safetensors is missing); never served",
        10: "rejected: its swap check failed (logprobs differ); never served",
        11: "passed the gate; served; its folder was found damaged at a restart (checksum mismatch) and it is "
            "not served again",
        12: "rejected: trained from version 2, which was rolled back meanwhile; never served",
        13: "passed the gate; served, rolled back by an admin, then served again (an admin rolled back to it)",
        14: "saved; not yet decided",
    }
    assert not any("passed the gate" in got[v] for v in (3, 4, 6, 7))  # the gate never passed them
