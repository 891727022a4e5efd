"""Key-server ports: a configurable base and range, and clear errors when a port is taken.

Ports come from ``[base, base + span)``. The base and span are the job's settings (the launcher's
``--port-base`` / ``CHECKPOINTLESS_PORT_BASE`` and ``--port-range`` / ``CHECKPOINTLESS_PORT_RANGE``);
every error here names them, because the only fix for a busy port is to pick another range.

Probing a port and binding it later leaves a window in which another program can take it. Where
that matters, bind the socket once with :func:`open_listener` and hand its descriptor to the
process that serves it (``KeyServer(..., listen_fd=...)``); the port then never changes hands.
"""

from __future__ import annotations

import errno
import os
import socket

from checkpointless.errors import ConfigError

__all__ = [
    "PORT_BASE_SETTING",
    "PORT_RANGE_SETTING",
    "allocate_ports",
    "open_listener",
    "port_range_from_env",
]

PORT_BASE_SETTING = "--port-base / CHECKPOINTLESS_PORT_BASE"
PORT_RANGE_SETTING = "--port-range / CHECKPOINTLESS_PORT_RANGE"
_BACKLOG = 4096  # the kernel caps it at somaxconn; a large job connects to a key server at once


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def open_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; ConfigError naming the port when it is taken.

    SO_REUSEADDR lets a restarted participant take its port back while connections of the
    process it replaces linger in TIME_WAIT; on Linux it does not allow two listeners on one port.
    """
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is already in use, so the rendezvous key server cannot "
                f"listen there; choose a free range with {PORT_BASE_SETTING}"
            ) from e
        if e.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
            raise ConfigError(
                f"cannot listen on {host}:{port} ({e.strerror}); check the host address and "
                f"{PORT_BASE_SETTING} (ports below 1024 need privileges)"
            ) from e
        raise ConfigError(f"cannot listen on {host}:{port}: {e}") from e
    return sock


def _free(host: str, port: int) -> bool:
    try:
        open_listener(host, port).close()
    except ConfigError:
        return False
    return True


def _ranges(ports: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"`` (a busy range reads better than a list of numbers)."""
    parts: list[str] = []
    start = prev = ports[0]
    for p in [*ports[1:], -2]:
        if p != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = p
        prev = p
    return ", ".join(parts)


def allocate_ports(base: int, count: int, host: str = "127.0.0.1", span: int = 1000) -> list[int]:
    """``count`` ports that are free now on ``host``, the lowest ones in ``[base, base + span)``."""
    if count < 1:
        raise ConfigError(f"need at least one port, asked for {count}")
    if span < count:
        raise ConfigError(
            f"port range of {span} ports cannot hold {count} ports; raise {PORT_RANGE_SETTING} to at least {count}"
        )
    if base < 1024 or base + span > 65536:
        raise ConfigError(
            f"port range {base}-{base + span - 1} must lie within 1024-65535; "
            f"change {PORT_BASE_SETTING} or {PORT_RANGE_SETTING}"
        )
    found: list[int] = []
    busy: list[int] = []
    for port in range(base, base + span):
        (found if _free(host, port) else busy).append(port)
        if len(found) == count:
            return found
    raise ConfigError(
        f"only {len(found)} of the {count} ports needed are free in {base}-{base + span - 1} on "
        f"{host} (busy: {_ranges(busy)}); choose another range with {PORT_BASE_SETTING} "
        f"or widen it with {PORT_RANGE_SETTING}"
    )


def port_range_from_env(default_base: int, default_span: int) -> tuple[int, int]:
    """``(base, span)`` from CHECKPOINTLESS_PORT_BASE / CHECKPOINTLESS_PORT_RANGE, else the defaults."""
    values: list[int] = []
    for name, default in (
        ("CHECKPOINTLESS_PORT_BASE", default_base),
        ("CHECKPOINTLESS_PORT_RANGE", default_span),
    ):
        text = os.environ.get(name, "").strip()
        if not text:
            values.append(default)
            continue
        try:
            values.append(int(text))
        except ValueError as e:
            raise ConfigError(f"{name}={text!r} is not an integer") from e
    return values[0], values[1]
