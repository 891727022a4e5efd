"""Which ranks a spare on a spare host may take, so that it can prefetch their batches.

A lost host's ranks go to one spare host together, in order (``placement.pick_spares`` takes the
spare host's spares by worker id for the lost ranks sorted): the i-th spare of a spare host
becomes local rank i of whichever node was lost. It may therefore become any of ranks
``i, P + i, 2P + i, ...``; those are the batches worth having in its host's cache
(``data/spare_cache.py``). Pure functions; the coordinator sends the result as ``Prefetch``.
"""

from __future__ import annotations

__all__ = ["MAX_CANDIDATES", "slot_ranks"]

# a spare builds ``ahead`` batches for each candidate at every step: past a few dozen nodes that
# is more work than a waiting process should do, so the candidates are capped (the lowest nodes)
MAX_CANDIDATES = 32


def slot_ranks(index: int, per_node: int, nnodes: int, limit: int = MAX_CANDIDATES) -> list[int]:
    """The ranks the ``index``-th spare (0-based, by worker id) of a spare host may take."""
    if not 0 <= index < per_node:
        return []  # more spares than a node's ranks: this one only covers single-rank faults
    return [node * per_node + index for node in range(min(nnodes, limit))]
