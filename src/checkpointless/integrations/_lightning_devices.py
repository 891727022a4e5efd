"""What the strategy says about Lightning's ``devices`` flag, as a pure function.

Under checkpointless the processes come from the launcher (``checkpointless run --nproc N``),
not from Lightning, so ``Trainer(devices=...)`` cannot add any. Run plainly (``python
train.py``) the job is one process, and ``devices=2`` used to be ignored in silence: the user
believed two ranks were training. The strategy now warns, once, with the fix.
"""

from __future__ import annotations

__all__ = ["devices_warning"]


def devices_warning(devices: int, world_size: int, launched: bool) -> str | None:
    """The warning for Lightning's ``devices`` (``devices`` of them) in a job of ``world_size``
    ranks, or None.

    ``launched``: a launcher started the process (``checkpointless run`` or torchrun), which
    decides the ranks; Lightning's ``devices`` there may be every GPU of the host ("auto"),
    whatever ``--nproc`` is, so it says nothing. Otherwise the process is the whole job of
    ``python train.py``, and more than one device is a request it cannot honour."""
    if launched or devices <= world_size:
        return None
    return (
        f"Trainer(devices={devices}) is ignored: run plainly, the job is this one process "
        f"(CheckpointlessStrategy starts no processes itself). For {devices} ranks, run the "
        f"script under the launcher: `checkpointless run --nproc {devices} SCRIPT`"
    )
