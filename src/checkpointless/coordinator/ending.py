"""The job's end: every rank finished its loop and exited, or the job is stopped.

Either way the end is written once (a ``job_end`` event with the job's account of faults,
recoveries and inexact resumes), a recovery still waiting for its first step is reported, and
every process is told to shut down with the reason; the shell then stops with the exit code.
"""

from __future__ import annotations

from checkpointless.coordinator.ledger import FaultLedger
from checkpointless.coordinator.members import Members
from checkpointless.coordinator.outbox import Outbox
from checkpointless.coordinator.rounds import Rounds
from checkpointless.protocol import Shutdown

__all__ = ["JobEnd"]


class JobEnd:
    """Whether and why the job is ending, and the commands that end it."""

    def __init__(self, members: Members, outbox: Outbox, ledger: FaultLedger, rounds: Rounds) -> None:
        self.members = members
        self.outbox = outbox
        self.ledger = ledger
        self.rounds = rounds
        self.stopping: str | None = None  # why the job is ending (None while it runs)
        self.exit_code = 0

    def check_done(self) -> None:
        """End the job once every rank has finished its loop and exited."""
        if not self.members.ranks or not all(m.done and m.exited for m in self.members.ranks.values()):
            return
        if self.rounds.round is not None:
            # Every rank finished its loop and exited while a round was open: a coordinator that
            # took over as the last steps ran (its election and rebuild took longer than they
            # did). Training is complete everywhere and no process is left to recover; waiting
            # for reports that cannot come would fail a finished job at --recovery-timeout.
            self.outbox.log(
                "warning",
                f"every rank finished its last step while recovery round {self.rounds.round.target} was "
                "open; the round is dropped and the job ends",
            )
            self.rounds.round = None
        failed = sorted(r for r, m in self.members.ranks.items() if m.exit_code != 0)
        if failed:
            # training finished everywhere, but the script failed after its loop (saving?)
            self.outbox.log(
                "error",
                f"training finished, but rank(s) {failed} failed after the loop; see their output",
            )
        self.rounds.first_steps.flush("the job ended before every rank committed a step after it")
        faults, recoveries, startup = (
            len(self.ledger.history),
            len(self.ledger.recoveries),
            self.ledger.startup_faults,
        )
        self.outbox.emit(
            "job_end",
            status="failed" if failed else "ok",
            recoveries=recoveries,
            faults=faults,
            startup_faults=startup,
            inexact=self.ledger.inexact_account(),
        )
        during = f" ({startup} during start-up)" if startup else ""
        self.outbox.log("info", f"job finished: {recoveries} recoveries from {faults} faults{during}")
        if self.ledger.inexact:
            ranks = sorted({x.rank for x in self.ledger.inexact if x.rank is not None})
            self.outbox.log(
                "warning",
                f"rank(s) {ranks} resumed without their own per-rank state, replayed a step to another "
                "loss or redid a section a lost rank may have passed "
                f"{len(self.ledger.inexact)} time(s): the result may differ from the run without "
                "the faults (job_end's 'inexact')",
            )
        self._end("done", 1 if failed else 0)

    def stop(self, why: str, code: int) -> None:
        """End the job now, as failed (``code``): a fault no recovery can mend, a signal, the
        shell's own failure. A stop after an earlier failed one keeps the first reason."""
        if self.stopping is not None and self.exit_code:
            return
        self.rounds.first_steps.flush("the job stopped")
        self.outbox.log("error", why)
        self.outbox.emit(
            "job_end",
            status="failed",
            error=why,
            code=code,
            recoveries=len(self.ledger.recoveries),
            faults=len(self.ledger.history),
            inexact=self.ledger.inexact_account(),
        )
        self._end(why, code)

    def _end(self, why: str, code: int) -> None:
        self.stopping = why
        self.exit_code = code
        for m in self.members.procs.values():
            # each process logs the reason: its first line (a traceback is printed once, above)
            self.outbox.send(m, Shutdown(code=0 if code == 0 else 1, reason=why.partition("\n")[0]))
        self.outbox.stop(code, why)
