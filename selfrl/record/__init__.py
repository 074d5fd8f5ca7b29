"""What a run keeps on disk, and nothing else writes: the store, the version ledger, the
adapter folders.

- :mod:`selfrl.record.store`: the run's SQLite store (tasks, trajectories, versions,
  metrics, events, held-out evaluations), one transaction per write.
- :mod:`selfrl.record.versions`: the version ledger: every version's lifecycle, the
  promotion rule (:func:`~selfrl.record.versions.passes_gate`, applied by ``Ledger.judge``)
  and the champion.
- :mod:`selfrl.record.adapters`: adapter versions on disk, written atomically and verified.
- :mod:`selfrl.record.served`: what ``selfrl serve`` stores beside the trajectories (served
  turns, feedback, conversations).
- :mod:`selfrl.record.runlock`, :mod:`selfrl.record.storage_errors`: one writer per run
  directory, and the storage faults a write may meet.
"""
