"""Where the step loop ends, as state a replacement receives.

A script may leave ``job.steps()`` before its total: ``break`` after a committed step, or
``job.stop()`` inside one. Every rank takes that decision at the same step (it must be computed
from replicated values, such as an all-reduced loss). The end travels with the tracked state, so a
replacement that joins while the others wait at the final barrier ends its loop there too, rather
than running steps nobody else runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LOOP_STATE_NAME", "LoopControl"]

# the name under which the loop's own state travels next to the user's tracked objects
LOOP_STATE_NAME = "checkpointless.loop"


class LoopControl:
    """The step count at which the loop ends early (``-1``: run to the total)."""

    def __init__(self) -> None:
        self.stop_at = -1
        # protected sections (recovery/sections.py) finished at the current step boundary: a
        # replacement that receives this skips them, one that does not runs them with the others
        self.sections_done: dict[str, int] = {}
        # job.epochs(): the last epoch whose per-epoch work (the code after its inner loop) has
        # run on this rank; a replacement that receives a state sent before its peers ran one
        # runs it too (recovery/epochs.py)
        self.epochs_done = -1

    def closed_at(self, boundary: int) -> list[str]:
        """The sections completed at the boundary after ``boundary`` steps (their closing barrier
        passed here, or settled without running), as this rank reports them in a recovery."""
        return sorted(name for name, at in self.sections_done.items() if at == boundary)

    def agree(self, closed: list[str], boundary: int) -> None:
        """A recovery's plan to resume at ``boundary``: the sections some rank completed there
        are done on this rank too, also where its own closing barrier failed as its peers passed
        it (coordinator/rules/sections.py); the step loop then ends them here without redoing
        them (recovery/driver.py)."""
        for name in closed:
            self.sections_done[name] = boundary

    def end(self, total: int) -> int:
        """The number of committed steps after which the loop ends."""
        return total if self.stop_at < 0 else min(total, self.stop_at)

    def request_stop(self, after: int) -> None:
        # the earliest request wins: a replay asking again must not move the end later
        self.stop_at = after if self.stop_at < 0 else min(self.stop_at, after)

    def state_dict(self) -> dict[str, Any]:
        return {
            "stop_at": self.stop_at,
            "sections_done": dict(self.sections_done),
            "epochs_done": self.epochs_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stop_at = int(state["stop_at"])
        self.sections_done = {str(k): int(v) for k, v in state.get("sections_done", {}).items()}
        self.epochs_done = int(state.get("epochs_done", -1))
