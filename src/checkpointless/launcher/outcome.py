"""How a coordinator's term is ending, as its shell, its decision loop and its agent hosts see it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Outcome"]


@dataclass
class Outcome:
    """The end of one coordinator's term, written by whichever part learns it first.

    One object, shared by the parts that run on the shell's thread: the shell's signal handler
    sets :attr:`signal`, the decision loop sets :attr:`stopping` and :attr:`code` when the
    coordinator stops the job, the agent hosts set :attr:`stepped_down` when this coordinator
    loses its majority, and the shell reads all of it at the end.
    """

    signal: int | None = None  # the signal that ends the job, once one arrived
    stopping: str | None = None  # why the loop stops (None while it runs)
    code: int = 0  # the exit code of the shell's process
    # this coordinator gave up its term without a majority: the job goes on under a successor,
    # so its processes, run directory and secret are left to the agents
    stepped_down: bool = False

    def stop(self, why: str, code: int) -> None:
        self.stopping = why
        self.code = code
