"""What the launcher starts for ``--metrics-port`` and ``--progress``, and stops at the end.

The launcher imports nothing of this optional layer: the command line (``cli.py``) hands it
:func:`start_observers`, and the launcher knows only what it returns, something to close.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from checkpointless.errors import ConfigError
from checkpointless.events import EventLog, get_logger

__all__ = ["Observers", "progress_line", "start_observers"]

log = get_logger()


def progress_line(run_dir: Path) -> str:
    """One line about the job: generation, steps, step time, faults, spares and goodput."""
    from checkpointless.observe.status import snapshot

    st = snapshot(run_dir)
    times = [r.step_time_s for r in st.ranks if r.step_time_s is not None]
    step_ms = f"{1e3 * max(times):.0f} ms/step" if times else "- ms/step"
    ready = sum(1 for s in st.spares if s.state == "ready")
    return (
        f"progress: {st.state}, generation {st.generation}, {st.steps_committed} steps, {step_ms}, "
        f"{st.faults} faults, {st.recoveries} recoveries, {ready} spare(s) ready, "
        f"goodput {100 * st.goodput:.1f}% over {st.elapsed_s:.0f} s"
    )


@dataclass
class Observers:
    """What :func:`start_observers` started; :meth:`close` stops all of it."""

    metrics: object | None = None  # a JobMetrics, imported only when asked for
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def report_progress(self, run_dir: Path, every_s: float) -> None:
        """Log :func:`progress_line` every ``every_s`` seconds, on a thread of its own, until closed."""

        def loop() -> None:
            while not self._stop.wait(every_s):
                try:
                    log.info("%s", progress_line(run_dir))
                except (ConfigError, OSError, ValueError) as e:  # a job still starting
                    log.info("progress: not available yet (%s)", e)

        self._thread = threading.Thread(target=loop, name="cl-progress", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.metrics is not None:
            from checkpointless.observe.metrics import JobMetrics

            assert isinstance(self.metrics, JobMetrics)
            self.metrics.close()


def start_observers(
    run_dir: Path, events: EventLog, host: str, metrics_port: int | None, progress_s: float | None
) -> Observers:
    """Start the metrics server and the progress thread that were asked for (neither by default)."""
    if progress_s is not None and progress_s <= 0:
        raise ConfigError(f"--progress needs a positive number of seconds (got {progress_s})")
    obs = Observers()
    if metrics_port is not None:
        from checkpointless.observe.metrics import JobMetrics

        m = JobMetrics(run_dir)
        port = m.serve(host, metrics_port)
        events.add_listener(m.on_event)
        obs.metrics = m
        log.info("metrics on http://%s:%d/metrics", host, port)
        events.emit("metrics_listening", host=host, port=port)
    if progress_s is not None:
        obs.report_progress(run_dir, progress_s)
    return obs
