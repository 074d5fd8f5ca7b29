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
- :mod:`selfrl.record.rundir`, :mod:`selfrl.record.runlock`, :mod:`selfrl.record.retention`:
  the run directory's layout (it may be moved), its one writer, what to prune after weeks.
- :mod:`selfrl.record.storage_errors`, :mod:`selfrl.record.write_errors`: the storage faults a
  write may meet (the server's answers), and a refused write said in one line (the console's).
"""
