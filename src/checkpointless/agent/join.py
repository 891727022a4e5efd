"""How an agent finds its job's coordinator and joins it: as it starts, and again after its host
was fenced (agent/remote.py serves the job once joined).

Why its own concern: the address an agent was given may be stale. After a coordinator failover
it names the lost coordinator (a recreated pod, a healed node, a fenced host's rejoin), and a job
can end while a host is out of touch. So the agent reads the run directory as well as asking the
addresses it knows: the coordinator record each coordinator writes (launcher/runfiles.py), the
secret the ending job removes, and the event log's ``job_end``.

What ends a join at once, with one error (exit 2): a wrong secret (every address's greeting
failed its seal: asking again cannot fix the secret, and an agent that kept asking made 17k
connections in 6 s) and a refusal for good (another agent serves this host). Everything else
is retried, each round after an exponential, jittered pause, with the run directory's record
first and the addresses the agent was given after it: a replayed greeting or a dead record costs
one try, never the join.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import random
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpointless.agent.failover import LOST
from checkpointless.errors import ConfigError
from checkpointless.events import get_logger
from checkpointless.launcher.runfiles import recorded_coordinator
from checkpointless.protocol import (
    AgentHeartbeat,
    AgentHello,
    AgentRefused,
    AgentWelcome,
    ProtocolError,
    decode,
    encode,
)
from checkpointless.protocol.agent_link import SHM_KEY_LABEL
from checkpointless.protocol.control_channel import WrongSecret
from checkpointless.protocol.control_client import ControlClient
from checkpointless.wire import FrameError, open_value

__all__ = ["Refused", "RefusedForGood", "backoff", "connect", "job_outcome", "join", "read_secret"]

log = get_logger()

_JOIN_SLICE_S = 5.0  # one try at one address; then the others, the record read anew
_WELCOME_WAIT_S = 10.0  # a coordinator that greeted us may be busy a while before it welcomes
_TAIL_BYTES = 1 << 16  # job_end is the event log's last line or close to it
_BACKOFF_S = (0.02, 2.0)  # the pause after the first failed round, and the most it grows to
MAX_SECRET_BYTES = 4096  # a job secret is 64 hex digits; a larger file is not one
_EMPTY_GRACE_S = 2.0  # the launcher creates the secret file, then writes it: a moment empty


class Refused(ConnectionError):
    """The coordinator took the connection and did not welcome this agent: asking it again
    cannot help."""


class RefusedForGood(Refused):
    """The coordinator said why it will never take this agent (``AgentRefused``): no other
    address can help either."""


def backoff(failed_rounds: int) -> float:
    """The pause before the next round of tries: doubling from 20 ms up to 2 s, each drawn from
    the upper half of its range (jitter: agents that lost their coordinator together do not
    come back in step)."""
    base, cap = _BACKOFF_S
    step = min(cap, base * 2.0 ** min(failed_rounds, 16))
    return step * random.uniform(0.5, 1.0)


def connect(
    coordinator: tuple[str, int], secret: bytes, hello: AgentHello, timeout: float
) -> tuple[ControlClient, queue.Queue[dict[str, Any]], AgentWelcome]:
    """Say hello to the coordinator at ``coordinator`` and wait for its welcome, ``timeout`` in
    all; reaching it and its greeting take at most :data:`_JOIN_SLICE_S` of that (a dead
    address must not hold the agent up), the rest is for a busy coordinator's welcome.

    Raises:
        WrongSecret: its greeting failed the seal. ``ReplayedGreeting`` (a ConnectionError):
            it answered another connection's nonce.
        RefusedForGood: it said why it never takes this agent. Refused: it hung up.
        ConnectionError, ProtocolError: anything else; worth another try."""
    deadline = time.monotonic() + timeout
    inbox: queue.Queue[dict[str, Any]] = queue.Queue()
    client = ControlClient(
        coordinator,
        secret,
        inbox.put,
        lambda why: inbox.put({"type": LOST, "why": why}),
        timeout=min(timeout, _JOIN_SLICE_S),
    )
    try:
        client.send(encode(hello))
        msg: object = None
        # a lease heartbeat can come before the welcome (from a coordinator that registered the
        # connection first): it is no answer to the hello
        while msg is None or isinstance(msg, AgentHeartbeat):
            raw = inbox.get(timeout=max(0.01, deadline - time.monotonic()))
            if raw.get("type") == LOST:
                msg = None
                break
            msg = decode(raw)
        if isinstance(msg, AgentWelcome):
            shm_key = open_value(secret, SHM_KEY_LABEL, msg.shm_key).decode("ascii")
            return client, inbox, dataclasses.replace(msg, shm_key=shm_key)
    except queue.Empty:
        client.close()
        raise ConnectionError("the coordinator did not welcome this agent in time") from None
    except (FrameError, UnicodeDecodeError) as e:
        client.close()
        raise ProtocolError(f"the welcome's sealed shm_key does not open: {e}") from None
    except BaseException:  # a malformed message (ProtocolError), a send that failed (OSError)
        client.close()
        raise
    client.close()
    if isinstance(msg, AgentRefused):
        raise RefusedForGood(msg.reason)
    # a coordinator refuses by hanging up (a duplicate, a job that is ending; an agent's
    # failover port that is no coordinator's), after it took the connection
    why = raw.get("reason") or raw.get("why") or f"it answered with {raw.get('type')!r}, not a welcome"
    raise Refused(f"the coordinator refused this agent ({why})")


def read_secret(path: Path, deadline: float) -> bytes:
    """The job's secret; a batch script may start agents before the coordinator has written it.

    Read as what it must be: a regular file (a symlink to one is fine: Kubernetes mounts
    secrets so), opened without blocking, so a FIFO or a device is refused instead of hanging
    the agent, and of at most :data:`MAX_SECRET_BYTES`. A missing file is waited for until
    ``deadline``; an empty one for a moment (the launcher creates it, then writes it)."""
    hint = "give the job's <run dir>/secret (on storage this host shares with the coordinator)"
    empty_since: float | None = None
    while True:
        now = time.monotonic()
        raw = _read_small_file(path, "--secret-file", MAX_SECRET_BYTES, hint)
        secret = raw.strip() if raw is not None else b""
        if secret:
            return secret
        if raw is not None:
            empty_since = now if empty_since is None else empty_since
            if now - empty_since >= _EMPTY_GRACE_S or now > deadline:
                raise ConfigError(f"--secret-file {str(path)!r} is empty; {hint}")
        elif now > deadline:
            raise ConfigError(f"--secret-file {str(path)!r} did not appear; {hint}")
        time.sleep(0.2)


def _read_small_file(path: Path, what: str, limit: int, hint: str) -> bytes | None:
    """A small regular file's bytes, None while it does not exist; ConfigError for anything
    else (never blocks: O_NONBLOCK, and only a regular file is read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"{what} {str(path)!r}: {e.strerror}; {hint}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a file"
            raise ConfigError(f"{what} {str(path)!r} is {kind}, not a regular file; {hint}")
        raw = os.read(fd, limit + 1)
    except OSError as e:
        raise ConfigError(f"{what} {str(path)!r}: {e.strerror}; {hint}") from None
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise ConfigError(f"{what} {str(path)!r} holds more than {limit} bytes: not a job secret; {hint}")
    return raw


def join(
    targets: list[str],
    secret: bytes,
    hello: AgentHello,
    timeout: float,
    record: Path | None = None,
    ended: Callable[[], bool] | None = None,
    secret_file: Path | None = None,
) -> tuple[ControlClient, queue.Queue[dict[str, Any]], AgentWelcome] | None:
    """Join the first coordinator that welcomes this agent within ``timeout``: the one the
    run directory's ``record`` names, then each of ``targets`` in turn; None if none does, or
    once ``ended()`` says the job is over.

    In slices of a few seconds each, round after round, and the record read again every round:
    an address that is dead (a lost coordinator, a stale record) must not use up the time, and
    an agent that starts between a coordinator's loss and its successor's record sees the
    successor's address once it is written. One that refuses the agent, or whose greeting fails
    its seal, is not asked again; rounds are paced by :func:`backoff`, and one warning is logged
    per address and kind of failure, not per try.

    Raises:
        ConfigError: every address left failed authentication (a wrong ``secret_file``), or a
            coordinator refused this agent for good (another agent serves its host)."""
    deadline = time.monotonic() + timeout
    refused: set[str] = set()
    forged: list[str] = []  # addresses whose greeting failed its seal
    warned: set[tuple[str, str]] = set()
    rounds = 0
    while True:
        if ended is not None and ended():
            return None
        recorded = recorded_coordinator(record) if record is not None else None
        order = [recorded] if recorded is not None else []
        order += [t for t in targets if t not in order]
        order = [a for a in order if a not in refused and a not in forged]
        if not order:
            _wrong_secret(forged, secret_file)
            return None
        for address in order:
            left = deadline - time.monotonic()
            if left <= 0:
                _wrong_secret(forged, secret_file)
                return None
            addr, _, port = address.rpartition(":")
            try:
                return connect((addr, int(port)), secret, hello, min(_WELCOME_WAIT_S, left))
            except RefusedForGood as e:
                raise ConfigError(f"the coordinator at {address} refused this agent: {e}") from None
            except Refused as e:
                refused.add(address)
                log.error("the coordinator at %s refused this agent: %s", address, e)
            except WrongSecret as e:
                forged.append(address)
                log.debug("%s", e)
            except (ConnectionError, ProtocolError) as e:
                if (address, type(e).__name__) not in warned:
                    warned.add((address, type(e).__name__))
                    log.warning("cannot join the coordinator at %s yet (retrying quietly): %s", address, e)
        pause = min(backoff(rounds), deadline - time.monotonic())
        rounds += 1
        if pause > 0:
            time.sleep(pause)


def _wrong_secret(forged: list[str], secret_file: Path | None) -> None:
    """Raise the one error of an agent whose secret no coordinator it reached holds."""
    if not forged:
        return
    named = f"--secret-file {str(secret_file)!r}" if secret_file is not None else "this agent's secret"
    raise ConfigError(
        f"wrong job secret: the greeting of the coordinator at {', '.join(forged)} failed "
        f"authentication with {named}; give that job's <run dir>/secret (the file its "
        "coordinator wrote), or the --coordinator of the job this secret belongs to"
    )


def job_outcome(run_dir: Path) -> str | None:
    """How the job in ``run_dir`` ended (its ``job_end`` event's status), or None while no
    coordinator has written one. Read from the event log's tail only: the log of a long job is
    large, and its end is what is asked."""
    path = run_dir / "events.jsonl"
    try:
        # no symlink, and never block: a FIFO planted as the log would hold the agent's exit
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None
        try:
            f.seek(max(0, st.st_size - _TAIL_BYTES))
            tail = f.read(_TAIL_BYTES)
        except OSError:
            return None
    for line in reversed(tail.splitlines()):
        if b'"job_end"' not in line:
            continue
        with contextlib.suppress(ValueError, RecursionError):  # a hostile line is no outcome
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == "job_end":
                return str(event.get("status"))
    return None
