"""Fixtures the recovery tests share: key servers standing for hosts, and routes over them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from checkpointless.rendezvous.server import KeyServer
from checkpointless.state.stream import StreamRoute

SECRET = b"s" * 32


@pytest.fixture
def servers() -> Iterator[list[KeyServer]]:
    """Three key servers on three loopback addresses: three hosts."""
    made = [KeyServer(f"127.0.0.{i + 1}", 0, SECRET) for i in range(3)]
    for s in made:
        s.start()
    yield made
    for s in made:
        s.stop()


def stream_route(server: KeyServer, peers: list[str]) -> StreamRoute:
    """A stream route from ``server`` over ``peers`` (the job's key-server addresses)."""
    return StreamRoute(server, peers, SECRET, "unused")
