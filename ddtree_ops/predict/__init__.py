"""Predicting a sweep's DDTree grid from one traced run (issue 43). Pure: no I/O but the
trace file reader, no clock.

- :mod:`.trace`: the trace format the bundle (and the simulator) return per request in
  ``meta_info["ddtree_trace"]``, one typed record per verify round, and the loader that
  refuses a bad trace file in one line naming the file, line and round.
- :mod:`.acceptance`: per round, the expected accepted length of any (budget, top-k) tree,
  rebuilt with the bundle's own builder from the round's draft table (path products of the
  target's probabilities, summed).
- :mod:`.estimate`: the estimator across rounds (the walk: each tree's own rounds replayed
  along the traced responses, where a naive mean over positions is biased), round times
  from probes, tok/s per cell, and the cells to measure.

It sits below ``bench`` and ``report`` (both import it) and imports neither.
"""
