"""What a rank's training state is, and how to take it from and put it into live objects.

The state that makes a replica: every registered object's ``state_dict()`` (model parameters and
buffers, optimizers, schedulers, scalers, the user's own objects), the random number generators
as they stood when the next step begins, and the step counter (which is also the data position:
the data pipeline derives its samples from the step).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from checkpointless.errors import ConfigError, StateTransferError
from checkpointless.state.rng_read import numpy_state, python_state

__all__ = [
    "RngState",
    "Stateful",
    "capture_rng",
    "collect_state",
    "host_copy",
    "land",
    "landing_zone",
    "restore_from",
    "restore_rng",
    "restore_state",
]


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any, /) -> Any: ...


RngState = dict[str, Any]


def capture_rng() -> RngState:
    """The generators a training step may draw from: Python, NumPy, torch CPU and CUDA."""
    # read from the generators' memory (state/rng_read.py: the public getters build a tuple of
    # 625 ints and fill 624 words one at a time, most of this capture's cost), the same values
    version, words, gauss = python_state()
    state: RngState = {
        # Python's 625 state words as one tensor, not a list: the state is laid out, encoded and
        # checked as every step begins when buddy copies are on, and a list of 625 numbers was
        # most of that tree's walk (~1 ms a step, both ranks)
        "python": [version, torch.from_numpy(words), gauss],
        "numpy": list(numpy_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: RngState) -> None:
    version, words, gauss = state["python"]
    if isinstance(words, torch.Tensor):
        words = words.tolist()
    random.setstate((int(version), tuple(int(w) for w in words), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(gauss)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def collect_state(objects: dict[str, Stateful], step: int, rng: RngState) -> dict[str, Any]:
    return {
        "step": step,
        "rng": rng,
        "objects": {name: obj.state_dict() for name, obj in objects.items()},
    }


def landing_zone(objects: dict[str, Stateful], step: int, rng: RngState) -> dict[str, Any]:
    """The objects' current state, as the place a received or stored state lands in: tensors of
    the same path, dtype and shape are overwritten in place. An object whose ``load_state_dict``
    may keep its own state (``lands_in_place = False``: Lightning's callbacks on a rank that has
    trained) is left out, so what arrives for it lands in fresh memory instead."""
    kept = {n: o for n, o in objects.items() if getattr(o, "lands_in_place", True)}
    return collect_state(kept, step, rng)


def host_copy(tree: Any) -> Any:
    """A copy of a state tree whose tensors are copied to host memory (nothing aliases the live
    state, and a device holding the training state needs no room for a second one)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: host_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [host_copy(v) for v in tree]
    if type(tree) is tuple:
        return tuple(host_copy(v) for v in tree)
    return copy.deepcopy(tree)


def land(tree: Any, own: Any) -> Any:
    """``tree`` with each tensor that ``own`` (a :func:`landing_zone`) holds at the same path with
    the same dtype and shape copied into ``own``'s tensor and put in its place: loading the result
    keeps the live tensors (an optimizer's ``load_state_dict`` would otherwise move a host copy to
    the device as new tensors, the old ones still alive, two copies of its state at once)."""
    if isinstance(tree, torch.Tensor):
        if isinstance(own, torch.Tensor) and own.shape == tree.shape and own.dtype == tree.dtype:
            with torch.no_grad():
                own.copy_(tree)
            return own
        return tree
    if isinstance(tree, dict):
        at: dict[Any, Any] = own if isinstance(own, dict) else {}
        return {k: land(v, at.get(k)) for k, v in tree.items()}
    if type(tree) in (list, tuple):
        same = type(own) is type(tree) and len(own) == len(tree)
        landed = [land(v, own[i] if same else None) for i, v in enumerate(tree)]
        return landed if type(tree) is list else tuple(landed)
    return tree


def restore_state(objects: dict[str, Stateful], state: dict[str, Any]) -> tuple[int, RngState]:
    """Load every registered object's state; return (step, rng state to resume with)."""
    sent = state["objects"]
    missing = sorted(set(objects) - set(sent))
    extra = sorted(set(sent) - set(objects))
    if missing or extra:
        raise StateTransferError(
            f"registered objects differ between sender and receiver: missing {missing}, unexpected {extra}"
        )
    for name, obj in objects.items():
        obj.load_state_dict(sent[name])
    return int(state["step"]), state["rng"]


def restore_from(
    objects: dict[str, Stateful],
    step: int,
    load: Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]],
    what: str,
) -> dict[str, Any]:
    """Load a stored replica of ``step`` (a snapshot, a checkpoint) into ``objects`` and the RNGs.

    ``load(own)`` reads and verifies it, landing tensors in ``own`` (the objects' current state, so
    the objects' own tensors are the landing zone, as when a peer sends the state), and returns
    (state, stats). Returns the stats.
    """
    own = landing_zone(objects, step, capture_rng())
    state, stats = load(own)
    del own
    got, rng = restore_state(objects, state)
    if got != step:
        raise StateTransferError(f"the {what} holds step {got}, the plan says {step}")
    restore_rng(rng)
    return stats


def check_stateful(name: str, obj: object) -> Stateful:
    if not isinstance(obj, Stateful):
        raise ConfigError(
            f"cannot track {name!r} ({type(obj).__name__}): it needs state_dict() and "
            "load_state_dict(); wrap plain values in an object that has them"
        )
    return obj
