"""The one place where CheckpointlessStrategy reaches into Lightning's loop objects.

Everything else uses the hooks Lightning documents for strategies. A replayed step runs
Lightning's closure again, and the closure counts its ``zero_grad`` call in the optimization
progress that Lightning saves into every checkpoint; without putting that progress back, a
checkpoint written after a recovery would differ from the fault-free run's in those counters.
The attribute path below is Lightning 2.6's (tests/test_lightning_unit.py pins the version).
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["ProgressMark"]


class ProgressMark:
    """The automatic-optimization progress as a step began, to be put back before a replay."""

    def __init__(self, trainer: Any) -> None:
        self._progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
        self._state = copy.deepcopy(self._progress.state_dict())

    def restore(self) -> None:
        self._progress.load_state_dict(copy.deepcopy(self._state))
