"""Parallel generation above the scheduler: fan-out (n, best_of), aggregators, beam search, fork/join.

Modules: `fanout` (children sharing KV blocks through `Scheduler.fork`), `aggregators`
(best-of-N, voting, early stopping; a registry), `beam` (beam and diverse beam search),
`program` (spawn / join of generation threads). See docs/parallel.md.
"""
