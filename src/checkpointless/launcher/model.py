"""What the launcher knows: its settings, each process it started, and each recovery round."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.faults.inject import parse_faults
from checkpointless.launcher.control import Connection
from checkpointless.recovery.decisions import MemberReport

__all__ = ["LaunchConfig", "Proc", "Round"]


@dataclass
class LaunchConfig:
    script: str
    script_args: list[str] = field(default_factory=list)
    nproc: int = 2
    spares: int = 1
    run_dir: Path | None = None
    hang_timeout: float = 10.0
    hang_factor: float = 5.0  # a step may take this many times the slowest recent step before it is a hang
    spare_wait: float = 60.0
    recovery_timeout: float = 120.0
    start_timeout: float = 180.0
    max_step_failures: int = 3  # recoveries in a row that resume at the same step before giving up
    faults: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    control_port: int = 0
    port_base: int = 29600
    port_range: int = 1000
    rendezvous: str = "rootless"  # or "tcp": a store hosted by the launcher (not on any rank)
    python: str = sys.executable
    quiet_workers: bool = False
    plain: bool = False  # tier 0: an unchanged script; a fault restarts the whole group
    max_restarts: int = 3
    metrics_port: int | None = None  # serve Prometheus /metrics on --host (0: any free port)
    progress: float | None = None  # seconds between one-line progress summaries

    def validate(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1 (got {self.nproc})")
        if self.spares < 0:
            raise ConfigError(f"--spares must be 0 or more (got {self.spares})")
        if not Path(self.script).is_file():
            raise ConfigError(f"training script {self.script!r} not found; pass the path of a Python file")
        if self.hang_timeout <= 0.5:
            raise ConfigError(f"--hang-timeout must be more than 0.5 s (got {self.hang_timeout})")
        for name, value in (
            ("--spare-wait", self.spare_wait),
            ("--recovery-timeout", self.recovery_timeout),
            ("--start-timeout", self.start_timeout),
        ):
            if value <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds (got {value})")
        if self.hang_factor < 1:
            raise ConfigError(f"--hang-factor must be at least 1 (got {self.hang_factor})")
        if self.max_step_failures < 1:
            raise ConfigError(f"--max-step-failures must be at least 1 (got {self.max_step_failures})")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more (got {self.max_restarts})")
        if self.plain and self.rendezvous != "rootless":
            raise ConfigError("--plain gives the script a root-less env:// rendezvous; drop --rendezvous tcp")
        if self.rendezvous not in ("rootless", "tcp"):
            raise ConfigError(f"--rendezvous must be rootless or tcp (got {self.rendezvous!r})")
        parse_faults(self.faults, self.nproc)  # a bad spec fails now, not at step 40


@dataclass
class Proc:
    worker_id: int
    role: str  # worker | spare
    popen: subprocess.Popen[bytes]
    store_port: int
    rank: int | None = None
    conn: Connection | None = None
    ready: bool = False  # a spare that finished warming up
    done: bool = False
    last_message: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    progress_known: bool = False
    in_collective: bool = False
    step: int | None = None
    step_time: float | None = None  # the last committed step's duration, as the worker measured it
    killed_for: str | None = None
    spawned: float = field(default_factory=time.monotonic)
    assigned_at: float = field(default_factory=time.monotonic)


@dataclass
class Round:
    target: int
    initial: bool
    started: float
    abort_sent: float = field(default_factory=time.monotonic)
    faults: list[dict[str, Any]] = field(default_factory=list)
    reports: dict[int, MemberReport] = field(default_factory=dict)
    report_times: dict[int, float] = field(default_factory=dict)
    replace: set[int] = field(default_factory=set)
    waiting_since: float | None = None
    phase: str = "collect"  # collect -> rebuild
    plan_sent: float = 0.0
    recovered: dict[int, dict[str, Any]] = field(default_factory=dict)
