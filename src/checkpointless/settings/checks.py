"""Checks of one setting's value that need more than a range: the file system, the name
resolver, the port space. Each raises :class:`~checkpointless.errors.ConfigError` naming the flag,
the value and the fix; the settings' fields name them as their ``check``."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError

__all__ = [
    "check_checkpoint_dir",
    "check_control_port",
    "check_health_checks",
    "check_host",
    "check_port_base",
    "check_port_range",
    "check_run_dir",
    "check_script",
]

_HOST_LOOKUP_S = 5.0


def check_health_checks(checks: list[str]) -> None:
    """Each --health-check is a shell command, or py:MODULE:FUNCTION (agent/health.py)."""
    for c in checks:
        if not c.strip():
            raise ConfigError("--health-check is empty; give a shell command or py:MODULE:FUNCTION")
        if c.startswith("py:"):
            module, _, function = c[3:].partition(":")
            if not module or not function.isidentifier():
                raise ConfigError(
                    f"--health-check {c!r} is not py:MODULE:FUNCTION; e.g. --health-check py:mychecks:gpu_ok"
                )


def check_script(script: str) -> None:
    if not script.strip():
        raise ConfigError("the training script path is empty; pass the path of a Python file")
    path = Path(script)
    if path.is_dir():
        raise ConfigError(f"training script {script!r} is a directory; pass the path of a Python file")
    if not path.is_file():
        raise ConfigError(f"training script {script!r} not found; pass the path of a Python file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"training script {script!r} is not readable; check its permissions")


def check_checkpoint_dir(path: Path | None) -> None:
    if path is None:
        return  # the run directory's, checked with it
    if not str(path).strip():
        raise ConfigError("--checkpoint-dir is empty; name a directory, e.g. --checkpoint-dir /shared/ckpt")
    # the nearest part that exists decides: a file there, or no write access, fails at the first save
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            f"--checkpoint-dir {str(path)!r}: {str(probe)!r} is not a directory; give a directory path"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--checkpoint-dir {str(path)!r}: {str(probe)!r} is not writable by this user; give a directory you can write"
        )


def check_run_dir(run_dir: Path | None) -> None:
    run_dir = run_dir if run_dir is not None else Path("runs")  # the default's parent
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {str(run_dir)!r} exists and is not a directory; choose another path")
    # The nearest part of the path that exists must be a directory we can create entries in.
    parent = run_dir
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(
            f"--run-dir {str(run_dir)!r} is under {str(parent)!r}, which is a file, not a directory; "
            "choose another path"
        )
    if parent != run_dir and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"cannot create --run-dir {str(run_dir)!r}: {str(parent)!r} is not writable; choose another path"
        )
    if parent == run_dir and not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"--run-dir {str(run_dir)!r} is not writable; choose another path")


def check_control_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"--control-port {port} is not a port; give 0..65535 (0 picks a free one)")


def check_port_base(base: int) -> None:
    if not 1024 <= base <= 65535:
        raise ConfigError(
            f"--port-base {base} is out of range; give 1024..65535 "
            "(--port-base or CHECKPOINTLESS_PORT_BASE; ports below 1024 need privileges)"
        )


def check_port_range(span: int) -> None:
    if span < 1:
        raise ConfigError(
            f"--port-range {span} must be at least 1 (--port-range or CHECKPOINTLESS_PORT_RANGE)"
        )


def _resolve(host: str, timeout: float) -> list[Any]:
    """getaddrinfo with a deadline: a name lookup can hang on a broken resolver, a literal never does."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass
    result: list[Any] = []
    failure: list[BaseException] = []

    def lookup() -> None:
        try:
            result.extend(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as e:
            failure.append(e)

    deadline = time.monotonic() + timeout
    worker = threading.Thread(target=lookup, name="host-lookup", daemon=True)
    worker.start()
    worker.join(timeout=max(0.0, deadline - time.monotonic()))
    if worker.is_alive():
        raise ConfigError(f"--host {host!r} did not resolve within {timeout:.0f} s; give an IP address")
    if failure or not result:
        raise ConfigError(
            f"--host {host!r} is not a known address or host name ({failure[0] if failure else 'no address'}); "
            "give an address of this machine, e.g. 127.0.0.1"
        )
    return result


def check_host(host: str) -> None:
    if not host.strip():
        raise ConfigError("--host is empty; give an address of this machine, e.g. 127.0.0.1")
    family, _, _, _, sockaddr = _resolve(host, _HOST_LOOKUP_S)[0]
    # The job listens on this address: binding a throw-away socket proves it is one of ours.
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((sockaddr[0], 0))
        except OSError as e:
            raise ConfigError(
                f"--host {host!r} is not an address of this machine ({e.strerror}); "
                "give a local interface address, e.g. 127.0.0.1"
            ) from None
