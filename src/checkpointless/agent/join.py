"""How an agent finds its job's coordinator and joins it: as it starts, and again after its host
was fenced (agent/remote.py serves the job once joined).

Why its own concern: the address an agent was given may be stale. After a coordinator failover
it names the lost coordinator (a recreated pod, a healed node, a fenced host's rejoin), and a job
can end while a host is out of touch. So the agent reads the run directory as well as asking the
addresses it knows: the coordinator record each coordinator writes (launcher/runfiles.py), the
secret the ending job removes, and the event log's ``job_end``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpointless.agent.failover import LOST
from checkpointless.errors import ConfigError
from checkpointless.events import get_logger
from checkpointless.launcher.control import ControlClient
from checkpointless.launcher.runfiles import recorded_coordinator
from checkpointless.protocol import AgentHello, AgentWelcome, ProtocolError, decode, encode

__all__ = ["Refused", "connect", "job_outcome", "join", "read_secret"]

log = get_logger()

_JOIN_SLICE_S = 5.0  # one try at one address; then the others, the record read anew
_TAIL_BYTES = 1 << 16  # job_end is the event log's last line or close to it


class Refused(ConnectionError):
    """The coordinator took the connection and did not welcome this agent: asking it again
    cannot help."""


def connect(
    coordinator: tuple[str, int], secret: bytes, hello: AgentHello, timeout: float
) -> tuple[ControlClient, queue.Queue[dict[str, Any]], AgentWelcome]:
    """Say hello to the coordinator at ``coordinator`` and wait for its welcome."""
    inbox: queue.Queue[dict[str, Any]] = queue.Queue()
    client = ControlClient(
        coordinator, secret, inbox.put, lambda why: inbox.put({"type": LOST, "why": why}), timeout=timeout
    )
    client.send(encode(hello))
    deadline = time.monotonic() + max(timeout, 10.0)
    while True:
        try:
            raw = inbox.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            client.close()
            raise ConnectionError("the coordinator did not welcome this agent in time") from None
        msg = decode(raw) if raw.get("type") != LOST else None
        if isinstance(msg, AgentWelcome):
            return client, inbox, msg
        client.close()
        # a coordinator refuses by hanging up (a duplicate, a job that is ending; an agent's
        # failover port that is no coordinator's), after it took the connection
        raise Refused(f"the coordinator refused this agent ({raw.get('reason') or raw.get('why')})")


def read_secret(path: Path, deadline: float) -> bytes:
    """The job's secret; a batch script may start agents before the coordinator has written it."""
    while True:
        try:
            secret = path.read_bytes().strip()
            if secret:
                return secret
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ConfigError(
                f"--secret-file {str(path)!r}: {e.strerror}; give the job's secret file"
            ) from None
        if time.monotonic() > deadline:
            raise ConfigError(
                f"--secret-file {str(path)!r} did not appear; give the coordinator's <run dir>/secret "
                "(on storage this host shares with the coordinator)"
            )
        time.sleep(0.2)


def join(
    targets: list[str],
    secret: bytes,
    hello: AgentHello,
    timeout: float,
    record: Path | None = None,
    ended: Callable[[], bool] | None = None,
) -> tuple[ControlClient, queue.Queue[dict[str, Any]], AgentWelcome] | None:
    """Join the first coordinator that welcomes this agent within ``timeout``: the one the
    run directory's ``record`` names, then each of ``targets`` in turn; None if none does, or
    once ``ended()`` says the job is over.

    In slices of a few seconds each, round after round, and the record read again every round:
    an address that is dead (a lost coordinator, a stale record) must not use up the time, and
    an agent that starts between a coordinator's loss and its successor's record sees the
    successor's address once it is written. One that refuses the agent is not asked again."""
    deadline = time.monotonic() + timeout
    refused: set[str] = set()
    while True:
        if ended is not None and ended():
            return None
        recorded = recorded_coordinator(record) if record is not None else None
        order = [recorded] if recorded is not None else []
        order += [t for t in targets if t not in order]
        order = [a for a in order if a not in refused]
        if not order:
            return None
        for address in order:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            addr, _, port = address.rpartition(":")
            try:
                return connect((addr, int(port)), secret, hello, min(_JOIN_SLICE_S, left))
            except Refused as e:
                refused.add(address)
                log.error("the coordinator at %s refused this agent: %s", address, e)
            except (ConnectionError, ProtocolError) as e:
                log.warning("cannot join the coordinator at %s yet: %s", address, e)


def job_outcome(run_dir: Path) -> str | None:
    """How the job in ``run_dir`` ended (its ``job_end`` event's status), or None while no
    coordinator has written one. Read from the event log's tail only: the log of a long job is
    large, and its end is what is asked."""
    path = run_dir / "events.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - _TAIL_BYTES))
            tail = f.read(_TAIL_BYTES)
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        if b'"job_end"' not in line:
            continue
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == "job_end":
                return str(event.get("status"))
    return None
