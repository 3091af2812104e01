"""Parallel generation above the engine: aggregators, beam search, fork/join.

Built on the engine's fork primitive (`Engine.spawn` / `fork` / `pause` / `resume`) and its
n > 1 / best_of groups (`loom.engine.groups`). Modules: `aggregators` (best-of-N, voting,
early stopping; a registry), `beam` (beam and diverse beam search), `program` (spawn / join of
generation threads). See docs/parallel.md.
"""
