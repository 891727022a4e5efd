"""The fault-free run of a job: what a faulted run of the same job must end bitwise equal to.

A reference run costs as much as the test that uses it, and every test of the same job needs the
same one, so each is run once per test session and kept (``ReferenceRuns``, the ``reference``
fixture of tests/conftest.py). Two calls share a run only when everything that can change its
result is the same: world size, data, script, the script's arguments, the launcher's flags and the
environment added. The spares are always 0 and no fault is injected: that is what makes it the
reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .jobs import JobResult, run_job
from .paths import EXAMPLE
from .shared import SharedDir

__all__ = ["ReferenceRuns"]


@dataclass(frozen=True)
class _Job:
    """What decides a fault-free run's result (the key its run is kept under)."""

    nproc: int
    data: Path
    script: Path
    script_args: tuple[str, ...] | None  # None: the job helpers' default (jobs.TINY)
    extra: tuple[str, ...]
    env: tuple[tuple[str, str], ...]


class ReferenceRuns:
    """Fault-free runs, each run once and kept for the session.

    ``make_dir()`` gives a new empty folder for each run; ``data`` is the token file a call uses
    when it names none. With ``shared``, each run is made once for all the run's xdist workers
    (the first to need it runs it, the others read its result).
    """

    def __init__(self, make_dir: Callable[[], Path], data: Path, shared: SharedDir | None = None) -> None:
        self._make_dir = make_dir
        self._data = data
        self._shared = shared
        self._runs: dict[_Job, JobResult] = {}

    def __call__(
        self,
        nproc: int = 3,
        *,
        data: Path | None = None,
        script: Path = EXAMPLE,
        script_args: Sequence[str] | None = None,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = 150,
        replicated: bool = True,
    ) -> JobResult:
        """The fault-free run of ``script`` on ``nproc`` ranks without spares.

        Every rank must have ended well and written its final digest. ``replicated``: every rank
        holds the whole model, so the digests must all be equal; a sharded job's (FSDP) differ
        between shards, and its test checks their layout itself.
        """
        job = _Job(
            nproc,
            self._data if data is None else data,
            script,
            None if script_args is None else tuple(script_args),
            tuple(extra),
            tuple(sorted((env or {}).items())),
        )
        if job not in self._runs:
            self._runs[job] = self._run_once(job, timeout)
        res = self._runs[job]
        if replicated:
            assert res.digest, f"the fault-free run's ranks disagree: {res.digests}"
        return res

    def _run_once(self, job: _Job, timeout: float) -> JobResult:
        if self._shared is None:
            return self._run(job, timeout)

        def make() -> dict[str, Any]:
            res = self._run(job, timeout)
            return {"rc": res.rc, "output": res.output, "run_dir": str(res.run_dir), "digests": res.digests}

        # another worker may be running this very job: wait for it as long as the run may take
        rec = self._shared.record(SharedDir.key(job), make, timeout=2 * timeout + 60)
        return JobResult(
            rec["rc"], rec["output"], Path(rec["run_dir"]), {int(r): d for r, d in rec["digests"].items()}
        )

    def _run(self, job: _Job, timeout: float) -> JobResult:
        res = run_job(
            self._make_dir() / "run",
            job.data,
            nproc=job.nproc,
            spares=0,
            extra=list(job.extra),
            script_args=None if job.script_args is None else list(job.script_args),
            timeout=timeout,
            script=job.script,
            env=dict(job.env) if job.env else None,
        )
        assert res.rc == 0, res.output[-4000:]
        assert sorted(res.digests) == list(range(job.nproc)), (
            f"ranks of the fault-free run without a final digest: {res.digests}"
        )
        return res
