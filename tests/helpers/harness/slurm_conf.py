"""The slurm.conf of a test cluster, as a pure function of its paths and ports.

Kept apart from slurm.py (processes) so it can be read, and tested, on its own: every node on
this machine with its own port and ``%n`` paths, every daemon on loopback, test-sized timeouts.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["render_conf"]


def render_conf(
    *,
    base: Path,
    cluster_name: str,
    munge_socket: Path,
    ctld_port: int,
    node_ports: dict[str, int],
    cpus_per_node: int,
) -> str:
    """slurm.conf text: state, spool, pid and log files under ``base``; nodes in ``node_ports``."""
    if len(set(node_ports.values()) | {ctld_port}) != len(node_ports) + 1:
        raise ValueError(f"ports must be distinct: slurmctld {ctld_port}, nodes {node_ports}")
    lines = [
        "# written by tests/helpers/harness/slurm.py for one test; removed when the test ends",
        f"ClusterName={cluster_name}",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={munge_socket}",
        "CredType=cred/munge",
        # bind to what localhost resolves to, never to every interface
        "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
        f"StateSaveLocation={base / 'state'}",
        f"SlurmdSpoolDir={base / 'spool'}/%n",
        f"SlurmctldPidFile={base / 'state'}/slurmctld.pid",
        f"SlurmdPidFile={base / 'spool'}/%n/slurmd.pid",
        f"SlurmctldLogFile={base / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={base / 'log'}/slurmd-%n.log",
        f"TmpFS={base / 'tmp'}",
        f"PlugStackConfig={base / 'etc' / 'plugstack.conf'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # process tracking that needs no cgroup set-up (CI machines differ); stop() catches
        # any process that escapes it through the tag in its environment
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "SelectType=select/linear",
        # node config is authoritative: N small nodes on one small machine
        "SlurmdParameters=config_overrides",
        # a node a test set DOWN stays down until it resumes it (2 would return it as soon
        # as its slurmd re-registers, within a second); one that stopped answering comes back
        "ReturnToService=1",
        # fast reactions: a test waits seconds, not Slurm's production minutes
        "SlurmdTimeout=10",
        "KillWait=2",
        "MessageTimeout=10",
        "InactiveLimit=0",
        "MinJobAge=600",
        "SchedulerParameters=sched_interval=1",
    ]
    for node, port in node_ports.items():
        # NodeHostname=localhost on every node: slurmd -N <node> tells them apart on one machine
        lines.append(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={cpus_per_node} RealMemory=256 State=UNKNOWN"
        )
    lines.append(f"PartitionName=test Nodes={','.join(node_ports)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"
