"""Prometheus metrics of a running job, served by the launcher on ``--metrics-port``.

The launcher's own logic is not touched: :class:`JobMetrics` listens to its event log (faults,
recoveries, spares, generations) and follows ``rank-0.jsonl`` for step commits (rank 0 commits
every step the job commits, whichever process holds it). A private registry keeps the output to
this job's metrics; the goodput gauge is computed from the ledger when Prometheus scrapes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from checkpointless.errors import ConfigError
from checkpointless.observe.ledger import build_ledger

__all__ = ["PHASES", "JobMetrics"]

# the recovery event's phase fields, as the ``phase`` label values
PHASES = ("detect", "collect", "rebuild", "transfer", "first_batch", "first_step")
_RECOVERY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class JobMetrics:
    """Metric families for one job, fed by launcher events and rank 0's commits."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.steps = Counter("checkpointless_steps_committed", "Steps the job committed (rank 0)", registry=r)
        self.step_time = Histogram(
            "checkpointless_step_duration_seconds",
            "Wall time of one committed step on rank 0, recoveries excluded",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.faults = Counter("checkpointless_faults", "Detected faults by kind", ["kind"], registry=r)
        self.recoveries = Counter("checkpointless_recoveries", "Finished recoveries", registry=r)
        self.downtime = Histogram(
            "checkpointless_recovery_downtime_seconds",
            "From detection until every rank committed a step again",
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            "checkpointless_recovery_phase_seconds",
            "One phase of a recovery (detect, collect, rebuild, transfer, first_batch, first_step)",
            ["phase"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.spares_ready = Gauge(
            "checkpointless_spares_ready", "Hot spares ready to take a rank", registry=r
        )
        self.generation = Gauge("checkpointless_generation", "Current communicator generation", registry=r)
        self.state_bytes = Counter(
            "checkpointless_state_transferred_bytes",
            "Training state sent to receivers in recoveries",
            registry=r,
        )
        goodput = Gauge(
            "checkpointless_goodput_ratio", "Productive share of the wall time so far (0-1)", registry=r
        )
        goodput.set_function(self._goodput)
        self.generation.set(-1)
        self._events: list[dict[str, Any]] = []
        self._commits: list[dict[str, Any]] = []
        self._ready: set[int] = set()
        self._receivers: dict[int, int] = {}  # generation -> receivers in its plan
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._offset = 0
        self._partial = b""
        self._last_commit: dict[str, Any] | None = None
        self._tail = threading.Thread(target=self._follow, name="cl-metrics-tail", daemon=True)
        self._server: Any = None

    # -- inputs ------------------------------------------------------------------------------
    def on_event(self, e: dict[str, Any]) -> None:
        """Listener for the launcher's EventLog: keep counters in step with the events."""
        kind = e.get("event")
        with self._lock:
            self._events.append(e)
        if kind == "fault":
            self.faults.labels(kind=str(e.get("kind"))).inc()
        elif kind == "spare_ready":
            self._ready.add(int(e["worker"]))
        elif kind in ("spare_assigned", "spare_lost"):
            self._ready.discard(int(e["worker"]))
        elif kind == "plan":
            self._receivers[int(e["generation"])] = len(e.get("receivers") or [])
        elif kind == "started":
            self.generation.set(int(e["generation"]))
        elif kind == "recovery":
            gen = int(e["generation"])
            self.generation.set(gen)
            self.recoveries.inc()
            self.downtime.observe(float(e["downtime_s"]))
            for p in PHASES:
                if f"{p}_s" in e:
                    self.phase.labels(phase=p).observe(float(e[f"{p}_s"]))
            self.state_bytes.inc(float(e.get("state_bytes") or 0.0) * self._receivers.get(gen, 1))
        self.spares_ready.set(len(self._ready))

    def _on_commit(self, c: dict[str, Any]) -> None:
        self.steps.inc()
        prev = self._last_commit
        if (
            prev is not None
            and prev.get("generation") == c.get("generation")
            and c.get("step") == prev.get("step", -2) + 1
            and not c.get("rolled_forward")
        ):
            self.step_time.observe(float(c["time"]) - float(prev["time"]))
        self._last_commit = c
        with self._lock:
            self._commits.append(c)

    def _follow(self) -> None:
        import json

        path = self.run_dir / "rank-0.jsonl"
        while not self._stop.wait(0.25):
            self.poll_commits(path, json.loads)

    def poll_commits(self, path: Path, parse: Any) -> None:
        """Read the complete lines appended to ``path`` since the last call."""
        try:
            with open(path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self._offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")  # a line being written waits for its newline
        for line in lines:
            if line.strip():
                rec = parse(line)
                if rec.get("event") == "commit":
                    self._on_commit(rec)

    def _goodput(self) -> float:
        with self._lock:
            events, commits = list(self._events), list(self._commits)
        if not any(e.get("event") == "job_start" for e in events):
            return 0.0
        return build_ledger(events, commits, now=time.time()).goodput

    # -- serving -----------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port); the port actually bound."""
        if not 0 <= port <= 65535:
            raise ConfigError(f"--metrics-port must be 0-65535 (got {port})")
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port} ({e.strerror}); choose another --metrics-port"
            ) from None
        self._tail.start()
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._stop.set()
        if self._tail.is_alive():
            self._tail.join(timeout=2.0)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
