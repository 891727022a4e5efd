"""Process-wide helpers of a worker: how it exits once the job is done, how it reads an
exception, and the first-use costs a spare pays while it waits.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from checkpointless.errors import CommAborted
from checkpointless.events import get_logger
from checkpointless.protocol import Fatal, Message
from checkpointless.state.codec import tensor_paths
from checkpointless.state.snapshot import collect_state

__all__ = [
    "close_at_exit",
    "end_now",
    "install_fast_exit",
    "looks_like_comm_error",
    "note_exit_code",
    "on_last_words",
    "report_config_error",
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


_last_words: Callable[[Message], None] | None = None  # the coordinator's link, once connected


def on_last_words(send: Callable[[Message], None]) -> None:
    """This worker is connected: ``send`` tells its coordinator why the process ends."""
    global _last_words
    _last_words = send


def report_config_error(text: str) -> bool:
    """The script ended on a ConfigError (``text``: its traceback): tell the coordinator, which
    ends the job at once and prints it; False when there is none to tell (the caller prints it).
    Called by the script's runner (launcher/run_script.py)."""
    if _last_words is None:
        return False
    _last_words(Fatal(error=text, kind="config"))
    return True


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


def end_now(code: int) -> NoReturn:
    """End this process at once with ``code`` (from any thread): its output flushed, no
    destructor run (they could wait on peers that are gone, see :func:`install_fast_exit`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def close_at_exit(close: Callable[[], None], timeout: float) -> None:
    """At interpreter exit, while the interpreter is still whole: run ``close`` (the job's own
    groups), then destroy torch's process groups, as torch asks every script to do before it
    exits. For a job that ends without our launcher (plain torchrun, ``python train.py``), which
    leaves through the normal exit rather than :func:`install_fast_exit`. Left to the exit, its
    gloo groups came down after the interpreter had: seen as a rare SIGABRT ("terminate called
    without an active exception") after a clean end under plain torchrun, the symptom torch
    reports for scripts that skip ``destroy_process_group`` (pytorch/pytorch#190489). Bounded by
    ``timeout`` seconds: a group that does not come down by then is left to the exit."""

    def shut() -> None:
        try:
            close()
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception as e:  # leaving anyway: say why the groups stayed
            get_logger().warning("closing the job's process groups at exit: %s", short_error(e))

    def at_exit() -> None:
        th = threading.Thread(target=shut, name="cl-close-groups", daemon=True)
        th.start()
        th.join(timeout)
        if th.is_alive():
            get_logger().warning("the job's process groups were still closing after %.0f s", timeout)

    atexit.register(at_exit)


def looks_like_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed or aborted collective, or wraps one: torch's pipeline stages
    re-raise any error of a stage's forward or backward as a ``RuntimeError`` from it (a TP
    all-reduce aborted inside a stage is then a peer's fault, not this rank's)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if isinstance(e, CommAborted) or any(
            s in text
            # "CommAborted": ours, re-raised by torch as a RuntimeError that names it (an aborted
            # all-reduce of DDP's reducer, through its future: comm/work.py)
            for s in (
                "Connection closed by peer",
                "Connection reset",
                "Gloo",
                "gloo",
                "aborted",
                "CommAborted",
            )
        ):
            return True
        e = e.__cause__
    return False


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
