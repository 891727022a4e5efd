"""Keep ``torch.amp.GradScaler`` exact through faults.

A GradScaler keeps per-step bookkeeping outside its ``state_dict()``: for each optimizer, whether
this step's gradients were already unscaled (stage UNSCALED) or stepped (STEPPED), and which
devices found an inf. A fault inside ``scaler.step()`` after ``unscale_`` leaves the stage at
UNSCALED. The next attempt at the step then skips unscaling (the weights silently diverge), or, if
the script calls ``unscale_`` itself, fails on every replay. The tracked scale and growth tracker
travel with the state as usual; this module clears the bookkeeping whenever a step starts over
(a replay, or state received from a peer), and finishes a scaler ``update()`` that a fault cut off
after the optimizer step had been applied, so the scale matches the update that stands.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch.amp.grad_scaler import GradScaler, OptState, _refresh_per_optimizer_state

__all__ = ["finish_cut_off_update", "is_grad_scaler", "reset_step_state"]


def is_grad_scaler(obj: object) -> bool:
    # torch.cuda.amp.GradScaler and torch.cpu.amp.GradScaler derive from torch.amp.GradScaler
    return isinstance(obj, GradScaler)


def reset_step_state(scaler: Any) -> None:
    """Forget this step's unscale/step bookkeeping: the step is run again from its start, with
    freshly computed gradients that are still scaled."""
    # private, but it is exactly what GradScaler.update() itself resets at the end of a step
    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def finish_cut_off_update(scaler: Any) -> bool:
    """When every optimizer this step has gone through ``scaler.step()`` (stage STEPPED) but the
    fault came before ``scaler.update()``, run the update now: the step's optimizer update stands
    (it is committed), so the scale has to move as it would have. Returns whether it ran."""
    states = list(scaler._per_optimizer_states.values())
    if not scaler.is_enabled() or not states:
        return False
    if all(s["stage"] is OptState.STEPPED for s in states):
        scaler.update()
        return True
    return False
