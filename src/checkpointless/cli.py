"""The ``checkpointless`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpointless.errors import CheckpointlessError
from checkpointless.settings import AgentSettings, JobSettings, add_flags, values_from

__all__ = ["main"]

# Each command's flags, help and checks are generated from its settings class
# (checkpointless.settings): JobSettings for run and coordinator, AgentSettings for agent.


def _agent(args: argparse.Namespace) -> int:
    from checkpointless.agent.remote import run_agent

    a = AgentSettings(**values_from(AgentSettings, args))
    return run_agent(
        a.coordinator,
        a.host,
        Path(a.secret_file),
        order=a.order(),
        connect_timeout=a.connect_timeout,
        rejoin=a.rejoin,
    )


def _run(args: argparse.Namespace, local_agent: bool = True) -> int:
    from checkpointless.launcher.launcher import Launcher
    from checkpointless.observe.hooks import start_observers

    cfg = JobSettings.from_flags(values_from(JobSettings, args), local_agent=local_agent)
    # the launcher imports no optional tool: the observers (metrics, progress) are given to it
    return Launcher(cfg, start_observers).run()  # which validates cfg before it creates anything


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="checkpointless", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="launch a training script with workers and hot spares")
    coord = sub.add_parser(
        "coordinator",
        help="run a job over many hosts: the coordinator only; every host runs `checkpointless agent`",
    )
    for p in (run, coord):
        add_flags(p, JobSettings)
    agent = sub.add_parser("agent", help="run one host's processes for a coordinator elsewhere")
    add_flags(agent, AgentSettings)
    data = sub.add_parser("data", help="dataset tools")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    data_sub.add_parser("prepare", help="tokenize text/JSONL into a token file", add_help=False)
    sub.add_parser("simulate", help="goodput at scale: checkpointless vs checkpoint-restart", add_help=False)
    sub.add_parser("status", help="one screen about a job, from its run directory", add_help=False)
    sub.add_parser("report", help="goodput ledger, checkpoint-restart estimate and timeline", add_help=False)
    sub.add_parser(
        "audit", help="is a script bitwise the same through faults? runs it and compares", add_help=False
    )
    return ap


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
    if argv[:1] == ["audit"]:
        from checkpointless.audit import main as audit_main

        return audit_main(argv[1:])
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
