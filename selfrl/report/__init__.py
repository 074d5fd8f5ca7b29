"""Reports read from the store alone: a run's, a server's, and several runs side by side.

- :mod:`selfrl.report.run`: ``report.md`` of a run, and ``selfrl report`` for any run directory.
- :mod:`selfrl.report.serve`: the serving report of a ``selfrl serve`` run directory.
- :mod:`selfrl.report.compare`: ``selfrl compare``, with paired held-out differences.
- :mod:`selfrl.report.cost`: what a run spent: rollouts, seconds, (inference + training) / inference.
- :mod:`selfrl.report.figures`, :mod:`selfrl.report.timeline`: the overview figure and the
  timeline it is drawn from.
- :mod:`selfrl.core.stats` (below every floor): the confidence intervals for success rates the
  reports use.

It imports only the record, so both recipes below write with it.
"""
