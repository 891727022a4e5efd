"""A checkpointless job across namespace hosts: the coordinator on host 0, one agent per host.

The layout every multi-host test uses (and the README's Slurm script): ``nnodes`` hosts hold
ranks, ``spare_nodes`` more are hot-spare hosts, the coordinator runs next to host 0's agent,
agents take ``--node-order`` = host index. What differs between tests is passed in: the script's
arguments, launcher flags (``--inject``, straggler options), the lease, a shared-memory
directory per host, extra environment. :func:`start_netns_job` returns a :class:`NetnsJob` that
reads the run directory while the job runs and collects a :class:`jobs.JobResult` at the end.

Process cleanup is the cluster's (``NetnsCluster.close`` kills everything in the namespaces);
:meth:`NetnsJob.kill` is for a test that must stop the job before asserting.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jobs import JobResult, read_digests
from ..paths import EXAMPLE, ROOT
from ..wait import wait_for
from ..zygote import Process
from .hosts import Host, NetnsCluster

__all__ = ["CONTROL_PORT", "NetnsJob", "host_shm_dirs", "launch_on_hosts", "read_records", "start_netns_job"]

CONTROL_PORT = 29400  # each cluster's namespaces are its own, so tests never contend for it


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file that a running job may be appending to."""
    if not path.exists():
        return []
    # the last line is whole only once its newline is written: one still being written waits
    # for the next poll instead of failing to parse
    lines = path.read_text().split("\n")[:-1]
    return [json.loads(x) for x in lines if x.strip()]


def _stop(proc: Process, timeout: float) -> None:
    """Wait up to ``timeout`` s for ``proc``; SIGKILL it (and reap it) when it is still running."""
    try:
        proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@dataclass
class NetnsJob:
    """A job started by :func:`start_netns_job`; ``agents[i]`` runs on ``cluster.hosts[i]``."""

    cluster: NetnsCluster
    run_dir: Path
    coordinator: Process
    agents: list[Process]
    env: dict[str, str]  # every process's environment
    control: str  # the coordinator's control address, as the agents were given it
    nproc_per_node: int = 2  # ranks per host: host i holds ranks i*n .. i*n + n-1

    def start_agent(self, agent_flags: Sequence[str] = (), shm_dir: Path | None = None) -> Process:
        """Start an agent on the next host without one (a host held back with ``idle``): a host
        that joins the running job, given the coordinator's address as every agent was.
        ``shm_dir`` becomes its CHECKPOINTLESS_SHM_DIR (a job started with ``shm_dirs``)."""
        i = len(self.agents)
        if i >= len(self.cluster.hosts):
            raise ValueError(f"every one of the {i} hosts runs an agent already")
        env = dict(self.env)
        if shm_dir is not None:
            env["CHECKPOINTLESS_SHM_DIR"] = str(shm_dir)
        self.agents.append(_agent(self.cluster.hosts[i], i, self.control, self.run_dir, env, agent_flags))
        return self.agents[-1]

    @property
    def procs(self) -> list[Process]:
        return [self.coordinator, *self.agents]

    # -- the run directory, read while the job runs ------------------------------------------------

    def events(self, kind: str) -> list[dict[str, Any]]:
        """The coordinator's events of ``kind`` so far (events.jsonl)."""
        return [e for e in read_records(self.run_dir / "events.jsonl") if e["event"] == kind]

    def committed(self, rank: int) -> int:
        """The last step ``rank`` logged as committed, -1 before any."""
        steps = [
            e["step"] for e in read_records(self.run_dir / f"rank-{rank}.jsonl") if e["event"] == "commit"
        ]
        return max(steps, default=-1)

    def agent_events(self, address: str, kind: str) -> list[dict[str, Any]]:
        """The events of the agent on the host with ``address`` (agents are numbered as they join,
        not by host index, so the coordinator's ``host_joined`` says which file is whose)."""
        joined = [e["host"] for e in self.events("host_joined") if e["address"] == address]
        if not joined:
            return []
        return [e for e in read_records(self.run_dir / f"agent-{joined[0]}.jsonl") if e["event"] == kind]

    def spare_host_spawns(self) -> set[int]:
        """Workers started on the (first) spare host the placement chose."""
        address = self.events("placement")[0]["spare_hosts"][0]
        return {e["worker"] for e in self.agent_events(address, "spawn")}

    # -- waits of the test that drives it ----------------------------------------------------------

    def wait_training(self, deadline: float, *, rank: int = 2, step: int = 5, joined: int = 0) -> None:
        """Wait until ``rank`` has committed ``step`` (the default: rank 2, host 1's first, well into
        the run, so a fault now is a mid-run fault) and, when ``joined`` is given, until that many
        agents have joined (:meth:`wait_joined`)."""
        where = f"host {rank // self.nproc_per_node}"
        wait_for(
            lambda: self.committed(rank) >= step, deadline, f"rank {rank} ({where}) to commit step {step}"
        )
        if joined:
            self.wait_joined(deadline, joined)

    def wait_joined(self, deadline: float, n: int) -> None:
        """Wait until ``n`` agents have joined the coordinator: a test that then loses the
        coordinator needs every voter of the election in the job."""
        wait_for(lambda: len(self.events("host_joined")) >= n, deadline, f"{n} agents to join")

    @contextlib.contextmanager
    def killed_on_failure(self) -> Iterator[NetnsJob]:
        """Around the part of a test that drives the job: when it fails (a wait timed out, an
        assertion), kill the coordinator and agents at once, since :meth:`finish` would wait
        the whole deadline out for a job that may never end."""
        try:
            yield self
        except BaseException:
            self.kill()
            raise

    # -- the end ---------------------------------------------------------------------------------

    def _log(self, name: str) -> str:
        return (self.run_dir.parent / name).read_text(errors="replace")

    def _output(self, coordinator_tail: int | None, agent_tail: int) -> str:
        out = self._log("coordinator.out")
        if coordinator_tail is not None:
            out = out[-coordinator_tail:]
        for i in range(len(self.agents)):
            out += f"\n--- agent {i}\n" + self._log(f"agent-{i}.out")[-agent_tail:]
        return out

    def _result(self, rc: int, output: str) -> JobResult:
        return JobResult(
            rc, output, self.run_dir, read_digests(self.run_dir.parent, self.run_dir.name + ".digest-")
        )

    def finish(self, deadline: float, lenient: Sequence[int] = ()) -> JobResult:
        """The job ends with its coordinator, whose exit code is the job's; then the agents.
        Whatever is still running at ``deadline`` (monotonic) is killed. An agent on a host in
        ``lenient`` (a fenced host's, which tries to rejoin a coordinator that has ended for its
        whole --connect-timeout) gets 5 s, then is killed."""
        _stop(self.coordinator, deadline - time.monotonic())
        out = self._output(None, 3000)
        for i, p in enumerate(self.agents):
            _stop(p, 5.0 if i in lenient else deadline - time.monotonic())
        rc = self.coordinator.returncode
        return self._result(rc if rc is not None else -1, out)

    def finish_agents(self, deadline: float, lenient: Sequence[int] = ()) -> JobResult:
        """After a coordinator failover the job ends in the agent that took over, so the agents'
        exit codes are the job's (the first non-zero one, else 0). Agents on the hosts in
        ``lenient`` (a fenced host's, which may still be trying to rejoin a coordinator that has
        gone) get 5 s once the others are done, then are killed; their exit code does not count."""
        codes: list[int] = []
        for i, p in enumerate(self.agents):
            if i not in lenient:
                _stop(p, deadline - time.monotonic())
                codes.append(p.returncode)
        for i in lenient:
            _stop(self.agents[i], 5.0)
        out = self._output(3000, 6000)
        rc = 0 if all(c == 0 for c in codes) else max(codes, key=lambda c: c != 0)
        return self._result(rc, out + f"\nagent exit codes {codes}")

    def kill(self) -> None:
        """SIGKILL the coordinator and every agent (their workers are the cluster's to remove)."""
        for p in self.procs:
            p.kill()


def start_netns_job(
    cluster: NetnsCluster,
    run_dir: Path,
    corpus: Path,
    script_args: Sequence[str],
    *,
    inject: Sequence[str] = (),
    launcher_flags: Sequence[str] = (),
    lease: float = 3.0,
    hang_timeout: float = 20.0,
    nnodes: int = 2,
    nproc_per_node: int = 2,
    spare_nodes: int = 1,
    control_port: int = CONTROL_PORT,
    shm_dirs: Sequence[Path] | None = None,
    env: Mapping[str, str] | None = None,
    script: Path = EXAMPLE,
    agent_flags: Sequence[str] = (),
    idle: int = 0,
) -> NetnsJob:
    """Start the coordinator on host 0, then an agent on every host of ``cluster`` but the last
    ``idle`` ones (for :meth:`NetnsJob.start_agent` to start later).

    ``run_dir``'s parent (made if missing) receives the logs ``coordinator.out`` and
    ``agent-<host>.out`` and the final digests ``<run_dir name>.digest-<rank>``.
    Each of ``inject`` becomes an ``--inject`` fault spec; ``launcher_flags`` (e.g.
    ``["--swap-stragglers"]``) follow them, before the script.
    ``shm_dirs[i]`` becomes host i's agent's CHECKPOINTLESS_SHM_DIR; ``env`` is added to every
    process's environment; ``agent_flags`` (e.g. ``["--no-rejoin"]``) go to every agent.
    """
    if nnodes + spare_nodes + idle != len(cluster.hosts):
        held = f" + idle={idle}" if idle else ""
        raise ValueError(
            f"nnodes={nnodes} + spare_nodes={spare_nodes}{held} != {len(cluster.hosts)} hosts: "
            "make the cluster with one host per node"
        )
    if shm_dirs is not None and len(shm_dirs) != len(cluster.hosts):
        raise ValueError(f"{len(shm_dirs)} shm_dirs for {len(cluster.hosts)} hosts: give one per host")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, **(env or {})}
    h0 = cluster.hosts[0]
    py = [sys.executable, "-m", "checkpointless"]
    digest = run_dir.parent / (run_dir.name + ".digest-{rank}")
    coord = [
        *py, "coordinator",
        "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node), "--spare-nodes", str(spare_nodes),
        "--host", h0.address, "--control-port", str(control_port), "--run-dir", str(run_dir),
        "--hang-timeout", str(hang_timeout), "--lease", str(lease),
        *[a for f in inject for a in ("--inject", f)], *launcher_flags,
        str(script), *script_args, "--data", str(corpus), "--digest-out", str(digest),
    ]  # fmt: skip
    # a file, not a pipe: nobody reads the output until the end, and a full pipe would stall the
    # job; the child holds its own descriptor, so ours can close at once
    with open(run_dir.parent / "coordinator.out", "wb") as log:
        coordinator = h0.launch(coord, cwd=ROOT, env=base, out=log.fileno())
    agents: list[Process] = []
    control = f"{h0.address}:{control_port}"
    for i, h in enumerate(cluster.hosts[: len(cluster.hosts) - idle]):
        agent_env = dict(base)
        if shm_dirs is not None:
            agent_env["CHECKPOINTLESS_SHM_DIR"] = str(shm_dirs[i])
        agents.append(_agent(h, i, control, run_dir, agent_env, agent_flags))
    return NetnsJob(cluster, run_dir, coordinator, agents, base, control, nproc_per_node)


def launch_on_hosts(
    netns_hosts: Callable[[int], NetnsCluster],
    tmp_path: Path,
    corpus: Path,
    script_args: Sequence[str],
    *,
    hosts: int = 3,
    seconds: float = 200.0,
    **start: Any,
) -> tuple[NetnsJob, float]:
    """The start every many-host test shares: ``hosts`` namespace hosts from the ``netns_hosts``
    fixture, the job of :func:`start_netns_job` (given ``start``) with its run directory at
    ``tmp_path/job/run``, and the monotonic deadline ``seconds`` from now that all the test's
    waits and the job's end share. The job is started before the deadline is returned."""
    cluster = netns_hosts(hosts)
    deadline = time.monotonic() + seconds
    return start_netns_job(cluster, tmp_path / "job" / "run", corpus, script_args, **start), deadline


def _agent(
    host: Host, i: int, control: str, run_dir: Path, env: dict[str, str], flags: Sequence[str]
) -> Process:
    """Host ``i``'s agent, its output in ``agent-<i>.out`` beside the run directory."""
    agent = [
        sys.executable, "-m", "checkpointless", "agent", "--coordinator", control, "--host", host.address,
        "--secret-file", str(run_dir / "secret"), "--node-order", str(i), *flags,
    ]  # fmt: skip
    with open(run_dir.parent / f"agent-{i}.out", "wb") as out:
        return host.launch(agent, cwd=ROOT, env=env, out=out.fileno())


@contextlib.contextmanager
def host_shm_dirs(n: int) -> Iterator[list[Path]]:
    """A /dev/shm directory per host, removed at the end.

    The namespaces share this machine's /dev/shm and real hosts do not: without a directory of
    its own, a replacement on the spare host could read the lost host's own snapshots.
    """
    dirs: list[Path] = []
    try:
        for i in range(n):
            dirs.append(Path(tempfile.mkdtemp(prefix=f"cl-test-h{i}-", dir="/dev/shm")))
        yield dirs
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
