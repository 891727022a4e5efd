"""Reachability probes between harness hosts: a TCP echo server, a TCP round trip, a UDP datagram.

The helpers start ``_probe.py`` inside a host and return plain booleans so a self-test can assert "reachable" / "not reachable".
Every socket has a timeout; no probe can block a test past its deadline.
"""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

from ._common import HarnessError
from .hosts import Host

__all__ = ["start_tcp_echo", "start_udp_receiver", "tcp_roundtrip", "udp_received", "udp_send"]

_SCRIPT = str(Path(__file__).resolve().with_name("_probe.py"))


def _wait_ready(proc: subprocess.Popen[bytes], what: str, timeout: float = 20.0) -> None:
    """Wait for the child's one "ready" line, at most ``timeout`` seconds."""
    assert proc.stdout is not None
    # select first, so a child wedged before printing cannot block us; a dead child makes the
    # pipe readable with b""
    readable, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if readable else b""
    if line.strip() != b"ready":
        proc.kill()
        proc.wait(timeout=5.0)
        raise HarnessError(
            f"{what} did not start within {timeout:.0f}s (rc={proc.returncode}, said {line!r})"
        )


def start_tcp_echo(host: Host, port: int) -> subprocess.Popen[bytes]:
    """A TCP echo server bound to ``host``'s address; returns once it accepts connections."""
    proc = host.popen([sys.executable, _SCRIPT, "tcp-echo", host.address, str(port)], stdout=subprocess.PIPE)
    _wait_ready(proc, f"TCP echo server on {host.name}")
    return proc


def tcp_roundtrip(src: Host, addr: str, port: int, timeout: float = 1.5) -> bool:
    """Whether ``src`` can connect to ``addr:port`` and get its bytes echoed back in time."""
    res = src.run([sys.executable, _SCRIPT, "tcp-probe", addr, str(port), str(timeout)], timeout=timeout + 20)
    return res.returncode == 0


def start_udp_receiver(host: Host, port: int, timeout: float = 2.0) -> subprocess.Popen[bytes]:
    """A receiver that exits 0 once one datagram arrives on ``host``'s address, 1 after ``timeout``."""
    proc = host.popen(
        [sys.executable, _SCRIPT, "udp-recv", host.address, str(port), str(timeout)], stdout=subprocess.PIPE
    )
    _wait_ready(proc, f"UDP receiver on {host.name}")
    return proc


def udp_send(src: Host, addr: str, port: int, count: int = 10) -> None:
    src.run([sys.executable, _SCRIPT, "udp-send", addr, str(port), str(count)], timeout=20)


def udp_received(receiver: subprocess.Popen[bytes], timeout: float = 20.0) -> bool:
    return receiver.wait(timeout=timeout) == 0
