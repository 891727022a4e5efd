"""Process-wide helpers of a worker: how it exits once the job is done, how it reads an
exception, and the first-use costs a spare pays while it waits.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

import torch
from torch import nn

from checkpointless.state.codec import tensor_paths
from checkpointless.state.snapshot import collect_state

__all__ = ["install_fast_exit", "looks_like_comm_error", "short_error", "state_bytes", "warm_up"]


def state_bytes(objects: dict[str, Any]) -> int:
    state = collect_state(objects, 0, {})
    return sum(t.numel() * t.element_size() for t in tensor_paths(state).values())


_failed_after_loop = False


def install_fast_exit() -> None:
    """Leave without running destructors once the job's work is done. Process groups of aborted
    generations may still hold gloo threads waiting on peers that are gone, and tearing them
    down at interpreter exit can abort the process. An uncaught exception after the loop still
    makes the exit code 1."""
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        global _failed_after_loop
        _failed_after_loop = True
        previous(tp, value, tb)

    def exit_now() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if _failed_after_loop else 0)

    sys.excepthook = hook
    atexit.register(exit_now)


def looks_like_comm_error(exc: BaseException) -> bool:
    text = str(exc)
    return any(
        s in text for s in ("Connection closed by peer", "Connection reset", "Gloo", "gloo", "aborted")
    )


def short_error(exc: BaseException) -> str:
    s = f"{type(exc).__name__}: {exc}"
    return s if len(s) < 300 else s[:297] + "..."


def warm_up() -> None:
    """Pay the lazy first-use costs now, while we wait as a spare, not after a fault:
    the first optimizer construction imports torch._dynamo (seconds on this machine)."""
    p = nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(4)
    opt.step()
