"""The ``checkpointless`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpointless.errors import CheckpointlessError, ConfigError

__all__ = ["main"]


def _placement(args: argparse.Namespace) -> tuple[int, int, int]:
    """(ranks, spare processes, ranks per node) from --nproc/--spares or the many-host flags."""
    per_node = args.nproc_per_node if args.nproc_per_node is not None else args.nproc
    if args.nnodes == 1 and args.spare_nodes == 0:
        return per_node, args.spares, per_node  # one machine, as before
    # many hosts: spare processes live on spare hosts, a node's worth each
    return args.nnodes * per_node, args.spare_nodes * per_node, per_node


def _agent(args: argparse.Namespace) -> int:
    import os

    from checkpointless.agent.remote import run_agent

    order = args.node_order
    if order is None:  # under Slurm, the node's place in the allocation
        env = os.environ.get("SLURM_NODEID", "")
        order = int(env) if env.isdigit() else -1
    return run_agent(
        args.coordinator,
        args.host,
        Path(args.secret_file),
        order=order,
        connect_timeout=args.connect_timeout,
        rejoin=not args.no_rejoin,
    )


def _run(args: argparse.Namespace, local_agent: bool = True) -> int:
    from checkpointless.launcher.launcher import LaunchConfig, Launcher
    from checkpointless.rendezvous import port_range_from_env

    if args.checkpoint_dir is not None and not args.checkpoint_dir.strip():
        raise ConfigError("--checkpoint-dir is empty; name a directory, e.g. --checkpoint-dir /shared/ckpt")
    if args.run_dir is not None and not args.run_dir.strip():
        # Path("") is ".", which would scatter the run's files over the current directory
        raise ConfigError("--run-dir is empty; name a directory, e.g. --run-dir runs/try1")
    base, span = port_range_from_env(29600, 1000)
    args.port_base = base if args.port_base is None else args.port_base
    args.port_range = span if args.port_range is None else args.port_range
    nproc, spares, per_node = _placement(args)
    cfg = LaunchConfig(
        script=args.script,
        script_args=args.script_args,
        nproc=nproc,
        spares=spares,
        nnodes=args.nnodes,
        nproc_per_node=per_node,
        spare_nodes=args.spare_nodes,
        lease=args.lease,
        local_agent=local_agent,
        agent_wait=args.agent_wait,
        straggler_ratio=args.straggler_ratio,
        straggler_window=args.straggler_window,
        swap_stragglers=args.swap_stragglers,
        run_dir=Path(args.run_dir) if args.run_dir is not None else None,
        hang_timeout=args.hang_timeout,
        hang_factor=args.hang_factor,
        spare_wait=args.spare_wait,
        recovery_timeout=args.recovery_timeout,
        start_timeout=args.start_timeout,
        max_step_failures=args.max_step_failures,
        max_repeat_faults=args.max_repeat_faults,
        fault_window=args.fault_window,
        max_start_failures=args.max_start_failures,
        fork_server=not args.no_fork_server,
        faults=args.inject,
        host=args.host,
        control_port=args.control_port,
        port_base=args.port_base,
        port_range=args.port_range,
        rendezvous=args.rendezvous,
        plain=args.plain,
        max_restarts=args.max_restarts,
        snapshot_every=args.snapshot_every,
        buddy_copies=getattr(args, "buddy_copies", "auto"),
        buddy_every=getattr(args, "buddy_every", 1),
        divergence_check=args.divergence_check,
        first_step_timeout=args.first_step_timeout,
        checkpoint_every=args.checkpoint_every,
        checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir is not None else None,
        metrics_port=args.metrics_port,
        progress=args.progress,
    )
    return Launcher(cfg).run()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="checkpointless", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="launch a training script with workers and hot spares")
    coord = sub.add_parser(
        "coordinator",
        help="run a job over many hosts: the coordinator only; every host runs `checkpointless agent`",
    )
    for p in (run, coord):
        _job_flags(p)
    agent = sub.add_parser("agent", help="run one host's processes for a coordinator elsewhere")
    agent.add_argument(
        "--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's control address"
    )
    agent.add_argument("--host", required=True, help="this host's address: its processes listen on it")
    agent.add_argument(
        "--secret-file",
        required=True,
        metavar="F",
        help="the job's secret (the coordinator's <run dir>/secret)",
    )
    agent.add_argument(
        "--node-order",
        type=int,
        default=None,
        metavar="N",
        help="placement hint: hosts with lower N become lower node ranks (default $SLURM_NODEID, else arrival)",
    )
    agent.add_argument(
        "--connect-timeout", type=float, default=60.0, help="seconds to wait for the coordinator (default 60)"
    )
    agent.add_argument(
        "--no-rejoin", action="store_true", help="exit once fenced instead of rejoining as a spare host"
    )
    data = sub.add_parser("data", help="dataset tools")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    data_sub.add_parser("prepare", help="tokenize text/JSONL into a token file", add_help=False)
    sub.add_parser("simulate", help="goodput at scale: checkpointless vs checkpoint-restart", add_help=False)
    sub.add_parser("status", help="one screen about a job, from its run directory", add_help=False)
    sub.add_parser("report", help="goodput ledger, checkpoint-restart estimate and timeline", add_help=False)
    return ap


def _job_flags(run: argparse.ArgumentParser) -> None:
    run.add_argument("--nproc", type=int, default=2, help="data-parallel workers (default 2)")
    run.add_argument("--spares", type=int, default=1, help="hot spare processes (default 1)")
    run.add_argument("--run-dir", help="where events.jsonl and per-rank logs go (default runs/<time>-<job>)")
    run.add_argument(
        "--hang-timeout", type=float, default=10.0, help="seconds without progress that count as a hang"
    )
    run.add_argument(
        "--hang-factor",
        type=float,
        default=5.0,
        help="a step counts as hung only after this many times the slowest recent step (default 5)",
    )
    run.add_argument(
        "--spare-wait", type=float, default=60.0, help="seconds to wait for a spare before failing"
    )
    run.add_argument(
        "--recovery-timeout", type=float, default=120.0, help="seconds a recovery round may take"
    )
    run.add_argument(
        "--start-timeout", type=float, default=180.0, help="seconds a new process may take to connect"
    )
    run.add_argument(
        "--max-step-failures",
        type=int,
        default=3,
        help="recoveries in a row that resume at the same step before the job stops (default 3)",
    )
    run.add_argument(
        "--max-repeat-faults",
        type=int,
        default=3,
        help="the same rank failing the same way more often than this within --fault-window steps, "
        "or the same exception on any ranks, stops the job (default 3)",
    )
    run.add_argument(
        "--fault-window", type=int, default=20, help="steps over which repeated faults count (default 20)"
    )
    run.add_argument(
        "--max-start-failures",
        type=int,
        default=3,
        help="processes in a row that die before joining as the same rank before the job stops (default 3)",
    )
    run.add_argument(
        "--no-fork-server",
        action="store_true",
        help="start every worker and spare as a fresh interpreter instead of a fork of a template "
        "process that has imported torch once (slower start-up and spare refills)",
    )
    run.add_argument(
        "--inject", action="append", default=[], metavar="FAULT", help="e.g. kill:rank=1:step=20 (repeatable)"
    )
    run.add_argument("--host", default="127.0.0.1", help="interface the job listens on (default loopback)")
    run.add_argument("--control-port", type=int, default=0, help="launcher control port (0: any free port)")
    run.add_argument(
        "--port-base",
        type=int,
        default=None,
        help="first port for the rendezvous key servers (default $CHECKPOINTLESS_PORT_BASE or 29600)",
    )
    run.add_argument(
        "--port-range",
        type=int,
        default=None,
        help="how many ports from --port-base may be used (default $CHECKPOINTLESS_PORT_RANGE or 1000)",
    )
    run.add_argument("--rendezvous", choices=["rootless", "tcp"], default="rootless")
    run.add_argument(
        "--plain",
        action="store_true",
        help="the script does not call checkpointless.init(): give it torchrun-style variables and a "
        "root-less env:// rendezvous, and restart all processes on a fault",
    )
    run.add_argument(
        "--snapshot-every",
        type=int,
        default=50,
        help="steps between verified snapshots of the state in shared memory, used when every "
        "replica dies (0: off; default 50)",
    )
    run.add_argument(
        "--buddy-copies",
        choices=["auto", "on", "off"],
        default="auto",
        help="keep each rank's shard state (FSDP/HSDP) in the memory of a rank on another host, "
        "refreshed every step off the critical path, so a shard with no replica survives its "
        "owner (auto: on when the device mesh has no replica, R = 1; default auto)",
    )
    run.add_argument(
        "--buddy-every",
        type=int,
        default=1,
        metavar="N",
        help="steps between buddy copies (default 1: every step). A copy costs one pass over the "
        "rank's shard state; with N > 1 a shard recovered from its copy rolls every rank back to "
        "the copy's step and replays up to N - 1 steps (bitwise the same result)",
    )
    run.add_argument(
        "--divergence-check",
        type=int,
        default=100,
        metavar="N",
        help="every N steps the replicas compare a digest of their parameters and optimizer state; "
        "a rank that differs from the majority is healed from it (0: off; default 100)",
    )
    run.add_argument(
        "--first-step-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long a fresh process's first step may run without progress (torch.compile, "
        "cache warm-up) before it counts as hung (default 600)",
    )
    run.add_argument(
        "--checkpoint-every",
        default="0",
        metavar="N|TIME",
        help="durable torch.distributed.checkpoint saves, written off the training thread by rank 0 "
        "every N steps or every TIME (90s, 10m, 1h); used when no replica and no snapshot survives "
        "(default 0: off)",
    )
    run.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="where checkpoints go, in a folder per job (default <run dir>/checkpoints; "
        "on a cluster, shared storage); kept after the job",
    )
    run.add_argument("--max-restarts", type=int, default=3, help="with --plain: restarts before giving up")
    run.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics on --host (0: any free port; off by default)",
    )
    run.add_argument(
        "--progress",
        nargs="?",
        type=float,
        const=10.0,
        default=None,
        metavar="SECONDS",
        help="print a one-line summary every SECONDS (default 10)",
    )
    run.add_argument("--nnodes", type=int, default=1, help="hosts that hold ranks (default 1: this machine)")
    run.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks per host (default --nproc); ranks go host-major",
    )
    run.add_argument(
        "--spare-nodes", type=int, default=0, help="hot-spare hosts, each running a node's worth of spares"
    )
    run.add_argument(
        "--lease",
        type=float,
        default=5.0,
        help="seconds of silence after which a host is lost and its agent fences its workers (default 5)",
    )
    run.add_argument(
        "--straggler-ratio",
        type=float,
        default=0.0,
        help="report a host whose ranks' busy step time is this many times the other hosts' "
        "(an event `straggler`; default 0: off; e.g. 1.5)",
    )
    run.add_argument(
        "--straggler-window",
        type=int,
        default=5,
        help="committed steps in a row a host must be that slow before it is reported (default 5)",
    )
    run.add_argument(
        "--swap-stragglers",
        action="store_true",
        help="move a reported straggler host's ranks to a spare host (needs --spare-nodes)",
    )
    run.add_argument(
        "--agent-wait",
        type=float,
        default=300.0,
        help="seconds to wait for every agent to join (default 300)",
    )
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # subcommands that own their argument parsing
    if argv[:2] == ["data", "prepare"]:
        from checkpointless.data import prepare_main

        return prepare_main(argv[2:])
    if argv[:1] == ["simulate"]:
        from checkpointless.simulate import main as simulate_main

        return simulate_main(argv[1:])
    if argv[:1] == ["status"]:
        from checkpointless.observe.status import main as status_main

        return status_main(argv[1:])
    if argv[:1] == ["report"]:
        from checkpointless.observe.report import main as report_main

        return report_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "coordinator":
            return _run(args, local_agent=False)
        if args.command == "agent":
            return _agent(args)
    except CheckpointlessError as e:
        print(f"checkpointless: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
