"""The coordinator's outbox: the commands it queues for the shell, and the lasting conditions it
reports once when they begin and once when they end.

Every component that wants something done (a process started or killed, a message sent, an event
written, a line logged) asks the outbox; the shell takes the queue with :meth:`Outbox.drain`.
"""

from __future__ import annotations

from typing import Any

from checkpointless.coordinator.conditions import Conditions
from checkpointless.coordinator.state import Command, Emit, HostTable, Kill, Log, Member, Send, Spawn, Stop
from checkpointless.protocol import Message, PeerTable

__all__ = ["Outbox"]


class Outbox:
    """The queue of :class:`~checkpointless.coordinator.state.Command` for the shell."""

    def __init__(self) -> None:
        self.commands: list[Command] = []
        self.conditions = Conditions()  # lasting states, logged when they begin and end

    def drain(self) -> list[Command]:
        out, self.commands = self.commands, []
        return out

    def log(self, level: str, text: str) -> None:
        self.commands.append(Log(level, text))

    def emit(self, event: str, **fields: Any) -> None:
        self.commands.append(Emit(event, fields))

    def send(self, m: Member, msg: Message) -> None:
        """To one member, if it can still take it (a closed connection drops the message)."""
        if m.connected and not m.exited:
            self.commands.append(Send(m.worker_id, msg))

    def kill(self, m: Member, why: str) -> None:
        """Kill a member and remember why (its exit then counts as that)."""
        if not m.exited:
            m.killed_for = why
            self.commands.append(Kill(m.worker_id, why, m.host))

    def kill_unjudged(self, worker_id: int, why: str, host: int) -> None:
        """Kill a process without marking it (moved, not hung: its exit counts as killed)."""
        self.commands.append(Kill(worker_id, why, host))

    def spawn(self, worker_id: int, role: str, host: int) -> None:
        self.commands.append(Spawn(worker_id, role, host))

    def host_table(self, host: int, chunks: tuple[PeerTable, ...]) -> None:
        self.commands.append(HostTable(host, chunks))

    def stop(self, code: int, why: str) -> None:
        self.commands.append(Stop(code, why))

    def condition(self, name: str, on: bool, detail: str = "") -> None:
        """Log and emit a lasting state once when it begins and once when it ends."""
        ch = self.conditions.update(name, on, detail)
        if ch is None:
            return
        self.emit("condition", name=name, active=ch.active, detail=ch.detail)
        if ch.active:
            self.log("warning", ch.detail)
        else:
            self.log("info", f"resolved: {ch.detail}")
