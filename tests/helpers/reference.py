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

from .jobs import JobResult, run_job
from .paths import EXAMPLE

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
    when it names none.
    """

    def __init__(self, make_dir: Callable[[], Path], data: Path) -> None:
        self._make_dir = make_dir
        self._data = data
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
            self._runs[job] = self._run(job, timeout)
        res = self._runs[job]
        if replicated:
            assert res.digest, f"the fault-free run's ranks disagree: {res.digests}"
        return res

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
