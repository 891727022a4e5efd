"""The launcher's settings (``checkpointless run``'s flags), validated before anything starts."""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.faults.inject import parse_faults
from checkpointless.state.checkpoint_dir import parse_every

__all__ = ["MAX_PROCESSES", "LaunchConfig", "checkpoint_root", "config_from_json", "config_to_json"]

MAX_PROCESSES = 1024  # workers plus spares: far more than one machine runs, far fewer than a typo asks
_HOST_LOOKUP_S = 5.0


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
    # the fault budget (coordinator/rules/budget.py): the same rank failing the same way more than this
    # many times within fault_window steps ends the job; so does a rank whose replacements die
    # before joining max_start_failures times in a row
    max_repeat_faults: int = 3
    fault_window: int = 20
    max_start_failures: int = 3
    fork_server: bool = True  # start processes as forks of a template that imported torch once
    # steps between replica digest comparisons (0: off); the worker's default is
    # recovery/divergence.py's DEFAULT_EVERY, kept equal here so the launcher never imports torch
    divergence_check: int = 100
    # the no-progress limit for a fresh process's first step (torch.compile, warm-up); policy.py
    first_step_timeout: float = 600.0
    # buddy copies of each rank's shard on another host (state/buddy.py): auto (on when the
    # mesh has no replica, R = 1), on, off; see docs/configuration.md
    buddy_copies: str = "auto"
    buddy_every: int = 1  # steps between buddy copies; a recovery from one replays up to N - 1
    snapshot_every: int = 50  # steps between shared-memory snapshots (0: off); see docs/configuration.md
    # durable DCP checkpoints: "0" (off), steps ("500") or a time ("10m"); see state/durable.py
    checkpoint_every: str = "0"
    checkpoint_dir: Path | None = None  # default <run dir>/checkpoints; the job's id is added below it
    metrics_port: int | None = None  # serve Prometheus /metrics on --host (0: any free port)
    progress: float | None = None  # seconds between one-line progress summaries
    # many hosts (docs/operations.md): nproc == nnodes * nproc_per_node ranks, placed host-major,
    # and spares == spare_nodes * nproc_per_node processes on hot-spare hosts. nnodes 1 is the
    # one-machine job, where nproc_per_node is nproc.
    nnodes: int = 1
    nproc_per_node: int = 0  # 0: nproc (one node)
    spare_nodes: int = 0
    lease: float = 5.0  # seconds of silence after which an agent and the coordinator fence each other
    local_agent: bool = True  # False for `checkpointless coordinator`: every host has its own agent
    agent_wait: float = 300.0  # seconds the coordinator waits for its agents to join
    # straggler hosts (coordinator/rules/stragglers.py): report a host whose ranks' busy time is this
    # many times the other hosts' for straggler_window steps in a row (0: off); with
    # swap_stragglers, move its ranks to a spare host as if it were lost
    straggler_ratio: float = 0.0
    straggler_window: int = 5
    swap_stragglers: bool = False

    @property
    def per_node(self) -> int:
        return self.nproc_per_node or self.nproc

    @property
    def agents_needed(self) -> int:
        """Agents (hosts) the job waits for before it starts: its nodes and its spare hosts."""
        return self.nnodes + self.spare_nodes

    def validate(self) -> None:
        """Refuse every bad setting with a message naming the flag, the value and the fix.

        Runs before the launcher creates anything (run dir, secret, processes), so a refused
        configuration leaves nothing behind.
        """
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1 (got {self.nproc})")
        _check_hosts(self)
        if self.spares < 0:
            raise ConfigError(f"--spares must be 0 or more (got {self.spares})")
        # the cap is per host: a many-host job may hold any number of ranks in all
        on_one_host = self.per_node + (self.spares if self.agents_needed == 1 else 0)
        if on_one_host > MAX_PROCESSES:
            raise ConfigError(
                f"--nproc {self.per_node} plus --spares {self.spares if self.agents_needed == 1 else 0} "
                f"is more than {MAX_PROCESSES} processes on one host, more than one machine runs; "
                "lower them, or spread the ranks with --nnodes/--nproc-per-node"
            )
        _check_script(self.script)
        for name, value, example in (
            ("--hang-timeout", self.hang_timeout, 10),
            ("--hang-factor", self.hang_factor, 5),
            ("--spare-wait", self.spare_wait, 60),
            ("--recovery-timeout", self.recovery_timeout, 120),
            ("--start-timeout", self.start_timeout, 180),
            ("--first-step-timeout", self.first_step_timeout, 600),
        ):
            # nan passes every "<= limit" test below and inf waits forever: refuse both first
            if not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number (got {value}); e.g. {name} {example}")
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
        if self.max_repeat_faults < 1:
            raise ConfigError(f"--max-repeat-faults must be at least 1 (got {self.max_repeat_faults})")
        if self.fault_window < 0:
            raise ConfigError(f"--fault-window must be 0 or more steps (got {self.fault_window})")
        if self.max_start_failures < 1:
            raise ConfigError(f"--max-start-failures must be at least 1 (got {self.max_start_failures})")
        if self.first_step_timeout <= 0:
            raise ConfigError(
                f"--first-step-timeout must be a positive number of seconds (got {self.first_step_timeout}); "
                "e.g. --first-step-timeout 600"
            )
        if self.divergence_check < 0:
            raise ConfigError(
                f"--divergence-check must be 0 (off) or a number of steps (got {self.divergence_check}); "
                "e.g. --divergence-check 100"
            )
        if self.buddy_copies not in ("auto", "on", "off"):
            raise ConfigError(f"--buddy-copies must be auto, on or off (got {self.buddy_copies!r})")
        if self.buddy_every < 1:
            raise ConfigError(
                f"--buddy-every must be a number of steps, 1 or more (got {self.buddy_every}); 1 copies "
                "every step, and --buddy-copies off turns the copies off"
            )
        if self.snapshot_every < 0:
            raise ConfigError(
                f"--snapshot-every must be 0 (off) or a number of steps (got {self.snapshot_every})"
            )
        parse_every(self.checkpoint_every)
        if self.checkpoint_dir is not None:
            _check_checkpoint_dir(self.checkpoint_dir)
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more (got {self.max_restarts})")
        if self.plain and (self.agents_needed > 1 or not self.local_agent):
            raise ConfigError("--plain runs on one machine; drop --nnodes/--spare-nodes or --plain")
        if self.plain and self.rendezvous != "rootless":
            raise ConfigError("--plain gives the script a root-less env:// rendezvous; drop --rendezvous tcp")
        if self.rendezvous not in ("rootless", "tcp"):
            raise ConfigError(f"--rendezvous must be rootless or tcp (got {self.rendezvous!r})")
        _check_stragglers(self)
        _check_ports(self.control_port, self.port_base, self.port_range)
        _check_host(self.host)
        _check_run_dir(self.run_dir if self.run_dir is not None else Path("runs"))
        parse_faults(self.faults, self.nproc)  # a bad spec fails now, not at step 40


def _check_hosts(cfg: LaunchConfig) -> None:
    if cfg.nnodes < 1:
        raise ConfigError(f"--nnodes must be at least 1 (got {cfg.nnodes})")
    if cfg.spare_nodes < 0:
        raise ConfigError(f"--spare-nodes must be 0 or more (got {cfg.spare_nodes})")
    if cfg.nproc_per_node < 0:
        raise ConfigError(f"--nproc-per-node must be at least 1 (got {cfg.nproc_per_node})")
    if cfg.nnodes * cfg.per_node != cfg.nproc:
        raise ConfigError(
            f"--nnodes {cfg.nnodes} x --nproc-per-node {cfg.per_node} is not --nproc {cfg.nproc}; "
            "give --nnodes and --nproc-per-node (the world size follows)"
        )
    if not math.isfinite(cfg.lease) or cfg.lease < 1.0:
        raise ConfigError(f"--lease must be at least 1 second (got {cfg.lease}); e.g. --lease 5")


def _check_stragglers(cfg: LaunchConfig) -> None:
    if not math.isfinite(cfg.straggler_ratio) or (cfg.straggler_ratio and cfg.straggler_ratio <= 1.0):
        raise ConfigError(
            f"--straggler-ratio must be 0 (off) or above 1 (got {cfg.straggler_ratio}); "
            "e.g. --straggler-ratio 1.5"
        )
    if cfg.straggler_window < 1:
        raise ConfigError(f"--straggler-window must be at least 1 step (got {cfg.straggler_window})")
    if cfg.swap_stragglers and not cfg.straggler_ratio:
        raise ConfigError("--swap-stragglers needs --straggler-ratio (e.g. --straggler-ratio 1.5)")
    if cfg.swap_stragglers and cfg.spare_nodes < 1:
        raise ConfigError("--swap-stragglers needs a spare host to move to; add --spare-nodes 1")


def checkpoint_root(cfg: LaunchConfig, run_dir: Path, job_id: str) -> Path:
    """Where this job's checkpoints go: a folder named after the job below --checkpoint-dir (or
    the run directory's ``checkpoints``), so another job's checkpoints in a shared directory are
    never taken for this job's."""
    return (cfg.checkpoint_dir if cfg.checkpoint_dir is not None else run_dir / "checkpoints") / job_id


def config_to_json(cfg: LaunchConfig) -> dict[str, Any]:
    """The job's settings as JSON, for the agents that may take the coordinator over."""
    return {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in asdict(cfg).items()
        if k not in ("python", "local_agent")
    }


def config_from_json(raw: dict[str, Any]) -> LaunchConfig:
    """The settings :func:`config_to_json` sent; fields this side does not know are dropped."""
    known = {f.name for f in fields(LaunchConfig)}
    kwargs = {k: v for k, v in raw.items() if k in known}
    for k in ("run_dir", "checkpoint_dir"):
        if kwargs.get(k) is not None:
            kwargs[k] = Path(kwargs[k])
    return LaunchConfig(**kwargs)


def _check_checkpoint_dir(path: Path) -> None:
    if not str(path).strip():
        raise ConfigError("--checkpoint-dir is empty; name a directory, e.g. --checkpoint-dir /shared/ckpt")
    # the nearest part that exists decides: a file there, or no write access, fails at the first save
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            f"--checkpoint-dir {str(path)!r}: {str(probe)!r} is not a directory; give a directory path"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--checkpoint-dir {str(path)!r}: {str(probe)!r} is not writable by this user; give a directory you can write"
        )


def _check_script(script: str) -> None:
    if not script.strip():
        raise ConfigError("the training script path is empty; pass the path of a Python file")
    path = Path(script)
    if path.is_dir():
        raise ConfigError(f"training script {script!r} is a directory; pass the path of a Python file")
    if not path.is_file():
        raise ConfigError(f"training script {script!r} not found; pass the path of a Python file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"training script {script!r} is not readable; check its permissions")


def _check_ports(control_port: int, port_base: int, port_range: int) -> None:
    if not 0 <= control_port <= 65535:
        raise ConfigError(f"--control-port {control_port} is not a port; give 0..65535 (0 picks a free one)")
    if not 1024 <= port_base <= 65535:
        raise ConfigError(
            f"--port-base {port_base} is out of range; give 1024..65535 "
            "(--port-base or CHECKPOINTLESS_PORT_BASE; ports below 1024 need privileges)"
        )
    if port_range < 1:
        raise ConfigError(
            f"--port-range {port_range} must be at least 1 (--port-range or CHECKPOINTLESS_PORT_RANGE)"
        )
    if port_base + port_range - 1 > 65535:
        raise ConfigError(
            f"--port-base {port_base} plus --port-range {port_range} ends at port "
            f"{port_base + port_range - 1}, past 65535; lower either (or CHECKPOINTLESS_PORT_BASE / "
            "CHECKPOINTLESS_PORT_RANGE)"
        )


def _resolve(host: str, timeout: float) -> list[Any]:
    """getaddrinfo with a deadline: a name lookup can hang on a broken resolver, a literal never does."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass
    result: list[Any] = []
    failure: list[BaseException] = []

    def lookup() -> None:
        try:
            result.extend(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as e:
            failure.append(e)

    deadline = time.monotonic() + timeout
    worker = threading.Thread(target=lookup, name="host-lookup", daemon=True)
    worker.start()
    worker.join(timeout=max(0.0, deadline - time.monotonic()))
    if worker.is_alive():
        raise ConfigError(f"--host {host!r} did not resolve within {timeout:.0f} s; give an IP address")
    if failure or not result:
        raise ConfigError(
            f"--host {host!r} is not a known address or host name ({failure[0] if failure else 'no address'}); "
            "give an address of this machine, e.g. 127.0.0.1"
        )
    return result


def _check_host(host: str) -> None:
    if not host.strip():
        raise ConfigError("--host is empty; give an address of this machine, e.g. 127.0.0.1")
    family, _, _, _, sockaddr = _resolve(host, _HOST_LOOKUP_S)[0]
    # The job listens on this address: binding a throw-away socket proves it is one of ours.
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((sockaddr[0], 0))
        except OSError as e:
            raise ConfigError(
                f"--host {host!r} is not an address of this machine ({e.strerror}); "
                "give a local interface address, e.g. 127.0.0.1"
            ) from None


def _check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {str(run_dir)!r} exists and is not a directory; choose another path")
    # The nearest part of the path that exists must be a directory we can create entries in.
    parent = run_dir
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(
            f"--run-dir {str(run_dir)!r} is under {str(parent)!r}, which is a file, not a directory; "
            "choose another path"
        )
    if parent != run_dir and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"cannot create --run-dir {str(run_dir)!r}: {str(parent)!r} is not writable; choose another path"
        )
    if parent == run_dir and not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"--run-dir {str(run_dir)!r} is not writable; choose another path")
