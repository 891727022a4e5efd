"""A job's settings: the flags of ``checkpointless run`` and ``checkpointless coordinator``.

:class:`JobSettings` is the one place a job setting is declared: its field gives the default and
type, its :func:`~.spec.flag` the flag, help, checks and whether it travels to the agents (the
welcome carries this object, typed, through the protocol codec). The launcher and the
coordinator read it as it is; ``launcher.model.LaunchConfig`` is this class.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.faults.inject import parse_faults
from checkpointless.settings.checks import (
    check_checkpoint_dir,
    check_control_port,
    check_health_checks,
    check_host,
    check_port_base,
    check_port_range,
    check_run_dir,
    check_script,
)
from checkpointless.settings.combined import check_together
from checkpointless.settings.spec import Range, check_fields, flag, local
from checkpointless.state.checkpoint_dir import parse_every

__all__ = ["MAX_PROCESSES", "JobSettings", "checkpoint_root"]

MAX_PROCESSES = 1024  # workers plus spares: far more than one machine runs, far fewer than a typo asks

_AT_LEAST_1 = Range(1, "at least 1")
_NOT_NEGATIVE = Range(0, "0 or more")
_SECONDS = Range(0, "a positive number of seconds", above=True)


@dataclass(frozen=True)
class JobSettings:
    """Every setting of a job, in the order ``--help`` and docs/configuration.md list them."""

    script: str = flag(positional=True, help="the training script (a Python file)", check=check_script)
    script_args: list[str] = flag(  # noqa: RUF009 (flag() is dataclasses.field)
        factory=list, positional=True, help="passed to the script unchanged, options included"
    )
    nproc: int = flag(2, metavar="N", help="data-parallel workers", limit=_AT_LEAST_1)
    spares: int = flag(1, metavar="N", help="hot spare processes", limit=_NOT_NEGATIVE)
    run_dir: Path | None = flag(  # noqa: RUF009 (flag() is dataclasses.field)
        None,
        metavar="DIR",
        help="where events.jsonl and per-rank logs go",
        doc_default="`runs/<YYYYmmdd-HHMMSS>-<job id>`",
        example="runs/try1",
        check=check_run_dir,
    )
    hang_timeout: float = flag(
        10.0,
        metavar="S",
        help="seconds without progress that count as a hang",
        finite=True,
        limit=Range(0.5, "more than 0.5 s", above=True),
    )
    # a step may take this many times the slowest recent step before it is a hang
    hang_factor: float = flag(
        5.0,
        metavar="F",
        help="a step counts as hung only after this many times the slowest recent step",
        finite=True,
        limit=_AT_LEAST_1,
    )
    # the no-progress limit for a fresh process's first step (torch.compile, warm-up)
    first_step_timeout: float = flag(
        600.0,
        metavar="S",
        help="how long a fresh process's first step may run without progress (torch.compile, "
        "cache warm-up) before it counts as hung",
        finite=True,
        limit=Range(0, "a positive number of seconds", above=True, example=True),
    )
    # steps between replica digest comparisons (0: off); the worker's default is
    # recovery/divergence.py's DEFAULT_EVERY, kept equal here so the launcher never imports torch
    divergence_check: int = flag(
        100,
        metavar="N",
        help="every N steps the replicas compare a digest of their parameters and optimizer state; "
        "a rank that differs from the majority is healed from it (0: off)",
        limit=Range(0, "0 (off) or a number of steps", example=True),
    )
    spare_wait: float = flag(
        60.0, metavar="S", help="seconds to wait for a spare before failing", finite=True, limit=_SECONDS
    )
    # degraded mode (coordinator/rules/width.py, docs/fault-model.md): what a round does when a
    # lost rank has no ready spare, and the fewest replicas the job may go on with
    when_no_spare: str = flag(
        "wait",
        choices=("shrink", "wait", "fail"),
        help="when a lost rank has no ready spare: shrink (go on at once with fewer data-parallel "
        "replicas, the same global batch; a spare that becomes ready takes the slot back), wait "
        "(wait up to --spare-wait, then shrink) or fail (wait up to --spare-wait, then stop)",
    )
    min_replicas: int = flag(
        1,
        metavar="N",
        help="the fewest data-parallel replicas a degraded job goes on with; below it the job "
        "waits up to --spare-wait for spares, then stops with the reason",
        limit=_AT_LEAST_1,
    )
    recovery_timeout: float = flag(
        120.0, metavar="S", help="seconds a recovery round may take", finite=True, limit=_SECONDS
    )
    start_timeout: float = flag(
        180.0, metavar="S", help="seconds a new process may take to connect", finite=True, limit=_SECONDS
    )
    max_step_failures: int = flag(
        3,
        metavar="N",
        help="recoveries in a row that resume at the same step before the job stops",
        limit=_AT_LEAST_1,
    )
    snapshot_every: int = flag(
        50,
        metavar="K",
        help="steps between verified snapshots of the state in shared memory, used when every "
        "replica dies (0: off)",
        off=0,
        limit=Range(0, "0 (off) or a number of steps"),
    )
    # buddy copies of each rank's shard on another host (state/buddy.py)
    buddy_copies: str = flag(
        "auto",
        choices=("auto", "on", "off"),
        help="keep each rank's shard state (FSDP/HSDP) in the memory of a rank on another host, "
        "refreshed every step off the critical path, so a shard with no replica survives its "
        "owner (auto: on when the device mesh has no replica, R = 1)",
    )
    buddy_every: int = flag(
        1,
        metavar="N",
        help="steps between buddy copies (1: every step). A copy costs one pass over the rank's "
        "shard state; with N > 1 a shard recovered from its copy rolls every rank back to the "
        "copy's step and replays up to N - 1 steps (bitwise the same result)",
        limit=Range(
            1,
            "a number of steps, 1 or more",
            note="1 copies every step, and --buddy-copies off turns the copies off",
        ),
    )
    # durable DCP checkpoints: "0" (off), steps ("500") or a time ("10m"); see state/durable.py
    checkpoint_every: str = flag(
        "0",
        metavar="N|TIME",
        help="durable torch.distributed.checkpoint saves, written off the training thread by rank 0 "
        "every N steps or every TIME (90s, 10m, 1h); used when no replica and no snapshot survives",
        off="0",
        check=parse_every,
    )
    checkpoint_dir: Path | None = flag(  # noqa: RUF009 (flag() is dataclasses.field)
        None,
        metavar="DIR",
        help="where checkpoints go, in a folder per job (on a cluster, shared storage); kept after the job",
        doc_default="`<run dir>/checkpoints`",
        example="/shared/ckpt",
        check=check_checkpoint_dir,
    )
    # the fault budget (coordinator/rules/budget.py)
    max_repeat_faults: int = flag(
        3,
        metavar="N",
        help="the same rank failing the same way more often than this within --fault-window steps, "
        "or the same exception on any ranks, stops the job",
        limit=_AT_LEAST_1,
    )
    fault_window: int = flag(
        20, metavar="W", help="steps over which repeated faults count", limit=Range(0, "0 or more steps")
    )
    # after the in-process retries (coordinator/rules/respawn.py)
    fresh_process_retries: int = flag(
        16,
        metavar="N",
        help="once a rank's exception recurs past --max-repeat-faults or --max-step-failures, replace "
        "the raising rank(s) with fresh processes and try the step once more, at most N times within "
        "--fault-window steps (0: off, the job stops there): a fault that lives in a process (a wedged device context, "
        "leaked handles) is cured; a bug in the script raises again and stops the job",
        off=0,
        limit=Range(0, "0 (off) or a number of retries"),
    )
    max_start_failures: int = flag(
        3,
        metavar="N",
        help="processes in a row that die before joining as the same rank before the job stops",
        limit=_AT_LEAST_1,
    )
    fork_server: bool = flag(
        True,
        name="--no-fork-server",
        invert=True,
        help="start every worker and spare as a fresh interpreter instead of a fork of a template "
        "process that has imported torch once (slower start-up and spare refills)",
    )
    # many hosts (docs/operations.md): nproc == nnodes * nproc_per_node ranks, placed host-major,
    # and spares == spare_nodes * nproc_per_node processes on hot-spare hosts. nnodes 1 is the
    # one-machine job, where nproc_per_node is nproc.
    nnodes: int = flag(1, metavar="N", help="hosts that hold ranks (1: this machine)", limit=_AT_LEAST_1)
    nproc_per_node: int = flag(
        0,  # 0: nproc (one node)
        metavar="P",
        help="ranks per host; ranks go host-major",
        unset=True,
        doc_default="`--nproc`",
        limit=Range(1, "at least 1", off=0),
    )
    spare_nodes: int = flag(
        0, metavar="S", help="hot-spare hosts, each running a node's worth of spares", limit=_NOT_NEGATIVE
    )
    lease: float = flag(
        5.0,
        metavar="S",
        help="seconds of silence after which a host is lost and its agent fences its workers",
        limit=Range(1, "at least 1 second", example=True),
    )
    # straggler hosts (coordinator/rules/stragglers.py)
    straggler_ratio: float = flag(
        0.0,
        metavar="X",
        help="report a host whose ranks' busy step time is this many times the other hosts' "
        "(an event `straggler`; 0: off; e.g. 1.5)",
        off=0.0,
        example="1.5",
        limit=Range(1, "0 (off) or above 1", above=True, off=0, example=True),
    )
    straggler_window: int = flag(
        5,
        metavar="N",
        help="committed steps in a row a host must be that slow before it is reported",
        limit=Range(1, "at least 1 step"),
    )
    swap_stragglers: bool = flag(
        False, help="move a reported straggler host's ranks to a spare host (needs --spare-nodes)"
    )
    agent_wait: float = flag(300.0, metavar="S", help="seconds to wait for every agent to join")
    # host health (agent/health.py, coordinator/health.py): each agent checks its host, a failing
    # host is quarantined (never promoted, never given a spare or a rank) until a check passes
    health_check: list[str] = flag(  # noqa: RUF009 (flag() is dataclasses.field)
        factory=list,
        metavar="CMD",
        help="an extra host health check every agent runs (repeatable): a shell command that "
        "passes by exiting 0 (its output is the detail), or py:MODULE:FUNCTION, a function "
        "that passes by returning True",
        check=check_health_checks,
    )
    health_builtins: str = flag(
        "all",
        choices=("all", "basic", "off"),
        help="the built-in host checks: basic (memory, room in /dev/shm and the run directory), "
        "all (also a loopback gloo collective and, with CUDA, NVML and a short matmul, in a "
        "child process)",
    )
    health_interval: float = flag(
        60.0,
        metavar="S",
        help="seconds between an agent's health checks after the first (0: only when it joins); a "
        "spare host is promoted only on a passing result younger than two intervals",
        off=0.0,
        finite=True,
        limit=Range(0, "0 (only at join) or a number of seconds"),
    )
    health_timeout: float = flag(
        30.0,
        metavar="S",
        help="seconds each health check may take before it fails",
        finite=True,
        limit=_SECONDS,
    )
    health_min_free_gib: float = flag(
        1.0,
        metavar="GIB",
        help="the room /dev/shm and the run directory must each have for a host to pass",
        finite=True,
        limit=_NOT_NEGATIVE,
    )
    host_fault_limit: int = flag(
        3,
        metavar="K",
        help="a host whose ranks fault at this many steps within --fault-window steps is "
        "quarantined like a host that fails its checks (0: off; many hosts only)",
        off=0,
        limit=Range(0, "0 (off) or a number of faults"),
    )
    faults: list[str] = flag(  # noqa: RUF009 (flag() is dataclasses.field)
        factory=list, name="--inject", metavar="FAULT", help="e.g. kill:rank=1:step=20 (repeatable)"
    )
    host: str = flag("127.0.0.1", metavar="ADDR", help="interface the job listens on", check=check_host)
    control_port: int = flag(
        0, metavar="P", help="launcher control port (0: any free port)", check=check_control_port
    )
    port_base: int = flag(
        29600,
        metavar="P",
        help="first port for the rendezvous key servers",
        env="CHECKPOINTLESS_PORT_BASE",
        check=check_port_base,
    )
    port_range: int = flag(
        1000,
        metavar="N",
        help="how many ports from --port-base may be used",
        env="CHECKPOINTLESS_PORT_RANGE",
        check=check_port_range,
    )
    # "tcp": a store hosted by the launcher (not on any rank)
    rendezvous: str = flag(
        "rootless",
        choices=("rootless", "tcp"),
        help="rootless: each worker serves its own keys; tcp: one TCPStore held by the launcher",
    )
    plain: bool = flag(
        False,
        help="the script does not call checkpointless.init(): give it torchrun-style variables and a "
        "root-less env:// rendezvous, and restart all processes on a fault",
    )
    max_restarts: int = flag(
        3, metavar="N", help="with --plain: restarts before giving up", limit=_NOT_NEGATIVE
    )
    metrics_port: int | None = flag(
        None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics on --host (0: any free port)",
    )
    progress: float | None = flag(
        None, metavar="SECONDS", const=10.0, help="print a one-line summary every SECONDS"
    )
    # not flags: the interpreter of the job's processes and the command's own (they stay here),
    # and whether the workers' output is dropped (tests, benchmarks)
    python: str = local(sys.executable)
    quiet_workers: bool = False
    local_agent: bool = local(True)  # False for `checkpointless coordinator`: every host has its own agent

    @property
    def per_node(self) -> int:
        return self.nproc_per_node or self.nproc

    @property
    def agents_needed(self) -> int:
        """Agents (hosts) the job waits for before it starts: its nodes and its spare hosts."""
        return self.nnodes + self.spare_nodes

    @classmethod
    def from_flags(cls, values: dict[str, Any], *, local_agent: bool) -> JobSettings:
        """The settings of parsed flags (:func:`~.argv.values_from`): ``--nproc`` and ``--spares``
        count per host once the job has many hosts (``--nnodes``/``--spare-nodes``)."""
        per_node = values["nproc_per_node"] if values["nproc_per_node"] is not None else values["nproc"]
        if values["nnodes"] != 1 or values["spare_nodes"] != 0:
            # many hosts: spare processes live on spare hosts, a node's worth each
            values = values | {
                "nproc": values["nnodes"] * per_node,
                "spares": values["spare_nodes"] * per_node,
            }
        return cls(**(values | {"nproc_per_node": per_node}), local_agent=local_agent)

    def validate(self) -> None:
        """Refuse every bad setting with a message naming the flag, the value and the fix.

        Runs before the launcher creates anything (run dir, secret, processes), so a refused
        configuration leaves nothing behind. Each field's own rules first, then the rules that
        tie fields together.
        """
        check_fields(self)
        if self.nnodes * self.per_node != self.nproc:
            raise ConfigError(
                f"--nnodes {self.nnodes} x --nproc-per-node {self.per_node} is not --nproc {self.nproc}; "
                "give --nnodes and --nproc-per-node (the world size follows)"
            )
        # the cap is per host: a many-host job may hold any number of ranks in all
        spares_here = self.spares if self.agents_needed == 1 else 0
        if self.per_node + spares_here > MAX_PROCESSES:
            raise ConfigError(
                f"--nproc {self.per_node} plus --spares {spares_here} "
                f"is more than {MAX_PROCESSES} processes on one host, more than one machine runs; "
                "lower them, or spread the ranks with --nnodes/--nproc-per-node"
            )
        check_together(self)
        parse_faults(self.faults, self.nproc)  # a bad spec fails now, not at step 40


def checkpoint_root(cfg: JobSettings, run_dir: Path, job_id: str) -> Path:
    """Where this job's checkpoints go: a folder named after the job below --checkpoint-dir (or
    the run directory's ``checkpoints``), so another job's checkpoints in a shared directory are
    never taken for this one's."""
    return (cfg.checkpoint_dir if cfg.checkpoint_dir is not None else run_dir / "checkpoints") / job_id
