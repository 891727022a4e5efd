"""A tensor of per-step values that a test script tracks as job state (``job.track``): a
replacement that joins mid-run must receive the values of the steps before it joined, or its
final digest (which hashes them) would differ from the fault-free run's.

Imported by scripts in this folder as ``from tracked_tensor import TrackedTensor``: a script runs
with its own folder first on ``sys.path``, under ``checkpointless run`` (launcher/run_script.py),
under torchrun and run plainly alike.
"""

from __future__ import annotations

import torch


class TrackedTensor:
    """``t``, saved and restored in place under the state-dict key ``key``."""

    def __init__(self, key: str, t: torch.Tensor) -> None:
        self.key = key
        self.t = t

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {self.key: self.t}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        # in place: the script's loop keeps writing into the same tensor object
        self.t.copy_(sd[self.key])
