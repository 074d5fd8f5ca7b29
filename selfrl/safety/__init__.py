"""What stands between an update and serving.

- :mod:`selfrl.safety.gate`: held-out validation of a candidate (pass@1 with the verifier).
- :mod:`selfrl.safety.collapse`: collapse rules over the updates, the rollback and the safer
  setting after it; :mod:`selfrl.safety.collapse_budget`: a collapse budget per window of time.
- :mod:`selfrl.safety.detectors`: reward-hacking detectors; a flagged trajectory earns no
  positive reward.
- :mod:`selfrl.safety.swap_check`: proof that a sampling backend serves the weights trained.
- :mod:`selfrl.safety.families`: the no-forgetting rule, one per family (or agent) against its
  best, with Wilson intervals and paired differences.

The promotion rule itself is the ledger's (:func:`selfrl.record.versions.passes_gate`).
"""
