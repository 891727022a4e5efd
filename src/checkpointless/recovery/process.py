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

__all__ = [
    "install_fast_exit",
    "looks_like_comm_error",
    "note_exit_code",
    "short_error",
    "state_bytes",
    "warm_up",
]


def state_bytes(objects: dict[str, Any]) -> int:
    state = collect_state(objects, 0, {})
    return sum(t.numel() * t.element_size() for t in tensor_paths(state).values())


_exit_code = 0  # what the process must exit with once its work is done (see install_fast_exit)


def note_exit_code(code: int) -> None:
    """The script ended with ``code`` (its ``SystemExit``, or 1 for an uncaught exception). The
    fork server's child calls this before the exit functions run, since the fast exit below
    would otherwise turn every ending into 0."""
    global _exit_code
    if code and not _exit_code:
        _exit_code = code


def install_fast_exit() -> None:
    """Leave without running destructors once the job's work is done. Process groups of aborted
    generations may still hold gloo threads waiting on peers that are gone, and tearing them
    down at interpreter exit can abort the process. An uncaught exception after the loop still
    makes the exit code 1, and a script's own ``sys.exit(n)`` under the fork server keeps n."""
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        note_exit_code(1)
        previous(tp, value, tb)

    def exit_now() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_code)

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
