"""One logger version for the whole job, whichever process is rank 0.

Lightning's ``CSVLogger`` and ``TensorBoardLogger`` write into ``<root>/<name>/version_<n>``, and
without an explicit ``version=`` rank 0 takes the next free ``n`` when it first logs. A
replacement that becomes rank 0 would find the job's own directory taken and start a new one,
leaving the run's metrics split over two. So the first rank 0 writes the versions it took into
the job's private shared memory (the directory the launcher removes at the job's end), before
its loggers make any directory, and a replacement of rank 0 takes them from there before its
loggers make theirs. A replacement on another host finds no record and takes the next free
version, as before.

``CSVLogger`` also deletes a ``metrics.csv`` it finds when it opens its directory. A replacement
moves the file aside until it knows the step it resumes training at, then puts back the rows
of the steps before it (it logs the later ones itself: each step is in the file once) and
continues the file under the same columns.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from checkpointless.data.shm_cache import job_cache_dir
from checkpointless.events import get_logger
from checkpointless.integrations._lightning_internals import set_logger_version
from checkpointless.state.shm_dir import private_dir

__all__ = ["LoggerVersions"]

log = get_logger()
_KEPT = ".metrics.csv.checkpointless-kept"  # a name CSVLogger neither reads nor deletes


def _versioned(loggers: list[Any]) -> list[tuple[int, CSVLogger | TensorBoardLogger]]:
    # only these two: another logger's `version` may start a remote run just to be read
    return [(i, lg) for i, lg in enumerate(loggers) if isinstance(lg, CSVLogger | TensorBoardLogger)]


class LoggerVersions:
    """Rank 0's logger versions, kept for the job (see the module's docstring)."""

    def __init__(self, job_id: str | None, rank: int, is_replacement: bool) -> None:
        self._active = job_id is not None and rank == 0
        self._replacement = is_replacement
        self._path = job_cache_dir(job_id) / "lightning" / "logger_versions.json" if job_id else None
        self._kept: list[tuple[CSVLogger, Path]] = []

    def fix(self, loggers: list[Any]) -> None:
        """Before the loggers make their directories (``Strategy.setup``)."""
        if not self._active or self._path is None:
            return
        versioned = _versioned(loggers)
        if not versioned:
            return
        if not self._replacement:
            versions = {str(i): lg.version for i, lg in versioned}
            private_dir(self._path.parent)
            tmp = self._path.with_name(f".{self._path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(versions))
            os.replace(tmp, self._path)
            return
        try:
            versions = json.loads(self._path.read_text())
        except (OSError, ValueError):
            log.warning("no logger version kept for this job: rank 0's replacement logs into a new version")
            return
        for i, lg in versioned:
            version = versions.get(str(i))
            if not isinstance(version, int | str):
                continue
            set_logger_version(lg, version)
            if isinstance(lg, CSVLogger):
                metrics = Path(lg.log_dir) / "metrics.csv"
                aside = metrics.with_name(_KEPT)
                if metrics.is_file():
                    os.replace(metrics, aside)
                if aside.is_file():  # also one a replacement lost before it resumed left aside
                    self._kept.append((lg, aside))

    def resume(self, step: int) -> None:
        """A replacement of rank 0, its state received for ``step``: its predecessor's rows of
        the steps before ``step`` go back into each CSV file, which it then continues."""
        for lg, aside in self._kept:
            with aside.open(newline="") as f:
                reader = csv.DictReader(f)
                columns = list(reader.fieldnames or [])
                rows = [r for r in reader if r.get("step", "").isdigit() and int(r["step"]) < step]
            metrics = aside.with_name("metrics.csv")
            with metrics.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns)
                writer.writeheader()
                writer.writerows(rows)
            aside.unlink()
            lg.experiment.metrics_keys = columns  # its writer appends under these columns
        self._kept = []
