"""When an agent checks its host, and to whom it reports: the first run as soon as it joins a job,
then every ``--health-interval`` seconds, on a thread of its own (a check may take seconds; the
agent's loop starts and watches processes meanwhile). Each result goes to the coordinator as a
:class:`~checkpointless.protocol.HealthReport`; a coordinator that takes over gets the newest
result again at once (:meth:`HealthWatch.set_sender`), so that it never waits an interval to
learn that a spare host is healthy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from checkpointless.agent.health import HealthConfig, HostHealth, NvmlCheck, run_checks
from checkpointless.events import get_logger
from checkpointless.protocol import HealthReport

__all__ = ["HealthWatch"]

log = get_logger()
Sender = Callable[[HealthReport], bool]


class HealthWatch:
    def __init__(
        self,
        cfg: HealthConfig,
        send: Sender,
        nvml: NvmlCheck | None = None,
        run: Callable[[HealthConfig, NvmlCheck | None], HostHealth] = run_checks,
    ) -> None:
        self.cfg = cfg
        self.nvml = nvml
        self._run = run
        self._send = send
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.latest: HostHealth | None = None
        self.runs = 0
        self._thread = threading.Thread(target=self._loop, daemon=True, name="cl-agent-health")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def set_sender(self, send: Sender) -> None:
        """A new coordinator (a failover): report to it from now on, the newest result at once."""
        with self._lock:
            self._send = send
            latest = self.latest
        if latest is not None:
            send(latest.report(time.monotonic()))

    def run_once(self) -> HostHealth:
        """Check now and report the result."""
        h = self._run(self.cfg, self.nvml)
        with self._lock:
            self.latest = h
            self.runs += 1
            send = self._send
        if h.ok:
            log.info("host health checks passed (%d checks)", len(h.results))
        else:
            log.warning("host health checks failed: %s", h.summary())
        send(h.report(time.monotonic()))
        return h

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:  # a bug in a check must not end the agent's reports
                log.exception("host health checks raised")
            if self.cfg.interval <= 0 or self._stop.wait(self.cfg.interval):
                return
