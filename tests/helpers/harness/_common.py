"""What the harnesses share: the skip-or-fail rule, checked subprocess calls, owner-pid names.

A developer without root (or without iproute2/Slurm) still runs the rest of the suite: the
harness fixtures *skip* with a reason that names what is missing and how to get it. CI must
not silently skip them, so `.ci/run` sets ``CHECKPOINTLESS_REQUIRE_HARNESS=1``, which turns
each of those skips into a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from types import FrameType

__all__ = [
    "REQUIRE_ENV",
    "HarnessError",
    "HarnessUnavailable",
    "check",
    "exit_on_sigterm",
    "free_tcp_ports",
    "missing_tools",
    "owner_alive",
    "required",
]

# set to 1 by .ci/run: a harness that cannot run is then a failure, not a skip
REQUIRE_ENV = "CHECKPOINTLESS_REQUIRE_HARNESS"


class HarnessUnavailable(RuntimeError):
    """This machine cannot host the harness (no root, a tool or kernel feature missing)."""


class HarnessError(RuntimeError):
    """A harness command failed; the message carries the command and its output."""


def required() -> bool:
    """True when a missing prerequisite must fail the test instead of skipping it."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def missing_tools(tools: Sequence[str]) -> list[str]:
    # /usr/sbin is not on every non-root PATH, and the daemons live there
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [t for t in tools if shutil.which(t, path=path) is None]


def check(argv: Sequence[str], *, timeout: float = 10.0, ok_codes: Sequence[int] = (0,)) -> str:
    """Run a short administrative command; raise HarnessError with its output when it fails."""
    try:
        res = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as e:
        raise HarnessError(f"{' '.join(argv)!r} did not finish within {timeout:.0f}s") from e
    if res.returncode not in ok_codes:
        raise HarnessError(
            f"{' '.join(argv)!r} exited {res.returncode}: {(res.stderr or res.stdout).strip()[-2000:]}"
        )
    return res.stdout


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so finalizers and atexit still remove namespaces and daemons.

    Only when nobody else installed a handler, and only from the main thread (signal's rule).
    """

    def _raise(signum: int, frame: FrameType | None) -> None:
        sys.exit(128 + signum)

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
        signal.SIG_DFL,
        None,
    ):
        signal.signal(signal.SIGTERM, _raise)


def owner_alive(pid: int) -> bool:
    """Whether the process that created a resource (its pid is in the name) still runs."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_tcp_ports(n: int) -> list[int]:
    """n distinct loopback ports that were free a moment ago (all held open together, then closed)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
