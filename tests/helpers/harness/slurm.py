"""A real Slurm cluster on this machine, private to one test: munged, slurmctld and N slurmd.

Debian's packages (slurm-wlm 22.05 on Debian 12). Every node is ``slurmd -N nK`` on this machine
(``NodeHostname=localhost``, its own ``Port``, spool, pid and log paths through ``%n``), so
``srun -N2`` really runs on two Slurm nodes. Everything lives under one directory
``/tmp/cpls-<pid>-<random>`` (short, because munge's socket path must fit in a sockaddr_un, and
outside pytest's 0700 tmp dirs, because munged refuses a socket directory others cannot enter):

    munge/key/munge.key (0700 dir)   munge/sock/munge.socket (0755 dir)   etc/slurm.conf
    state/   spool/nK/   log/slurmctld.log  log/slurmd-nK.log  log/munged.log   jobs/

Ports are picked free at start; every daemon binds to localhost only
(``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny``; this machine's name resolves to
loopback). All daemons run in the foreground as our children, and every process of the cluster,
job steps included, carries ``CHECKPOINTLESS_SLURM_TAG=<tag>`` in its environment: :meth:`stop`
cancels the jobs, stops the daemons, then SIGKILLs anything still carrying the tag (a job step
that escaped ``proctrack/linuxproc`` by re-parenting) and removes the directory. A crashed run's
leftovers are removed by :func:`sweep_stale` at the next start.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ._common import HarnessError, HarnessUnavailable, free_tcp_ports, missing_tools
from .slurm_conf import render_conf
from .slurm_procs import BASE_PREFIX, DAEMON_COMMS, TAG_ENV, kill_tagged, proc_comm, sweep_stale, tagged_pids

__all__ = [
    "TAG_ENV",
    "JobInfo",
    "SlurmCluster",
    "slurm_unavailable_reason",
    "sweep_stale",
    "tagged_pids",
]

_TOOLS = [
    "munged",
    "munge",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "squeue",
    "scancel",
    "scontrol",
    "sinfo",
]
# job states after which a job never runs again (squeue/scontrol spelling)
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
    }
)


def slurm_unavailable_reason(euid: int | None = None) -> str | None:
    """Why this machine cannot run the Slurm harness, or None when it can."""
    if (os.geteuid() if euid is None else euid) != 0:
        return "needs root (runs slurmctld/slurmd as SlurmUser=root); run `sudo make test` or in CI (.ci/run)"
    missing = missing_tools(_TOOLS)
    if missing:
        return f"missing {missing}: apt-get install slurmctld slurmd slurm-client munge"
    # with NoInAddrAny, srun and slurmd bind to what this machine's name resolves to; refuse to
    # run rather than listen on a real interface
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError as e:
        return f"this machine's name {name!r} does not resolve ({e}): add '127.0.1.1 {name}' to /etc/hosts"
    if not ipaddress.ip_address(addr).is_loopback:
        return (
            f"this machine's name {name!r} resolves to {addr}, not loopback, and srun would listen "
            f"there: add '127.0.1.1 {name}' to /etc/hosts (before other lines naming it)"
        )
    return None


@dataclass(frozen=True)
class JobInfo:
    """One job as ``scontrol show job`` reports it."""

    job_id: int
    state: str  # e.g. PENDING, RUNNING, COMPLETED, CANCELLED, NODE_FAIL
    nodes: str  # the allocated node list, e.g. "n[1-2]"; "" while pending
    exit_code: str  # "rc:signal", e.g. "0:0"


_LIVE: set[SlurmCluster] = set()
_LIVE_LOCK = threading.Lock()


def _stop_live_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for c in live:
        try:
            c.stop()
        except Exception:
            pass  # exiting anyway; the next run's sweep_stale() removes what is left


atexit.register(_stop_live_at_exit)


class SlurmCluster:
    """Start with :meth:`start`, always :meth:`stop` (also a context manager)."""

    def __init__(self, nodes: int = 3, *, cpus_per_node: int = 1, tmp: Path = Path("/tmp")) -> None:
        if not 1 <= nodes <= 16:
            raise ValueError(f"nodes={nodes}: use 1..16 (each node is a slurmd on this machine)")
        if cpus_per_node < 1:
            raise ValueError(f"cpus_per_node={cpus_per_node}: use 1 or more")
        self.node_names = [f"n{i + 1}" for i in range(nodes)]
        self.cpus_per_node = cpus_per_node
        self.tag = f"{BASE_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.base = tmp / self.tag
        self.conf = self.base / "etc" / "slurm.conf"
        self.munge_socket = self.base / "munge" / "sock" / "munge.socket"
        self.log_dir = self.base / "log"
        self.jobs_dir = self.base / "jobs"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._started = False
        self._stopped = False

    # -- paths --------------------------------------------------------------------------------------

    @property
    def ctld_log(self) -> Path:
        return self.log_dir / "slurmctld.log"

    def slurmd_log(self, node: str) -> Path:
        return self.log_dir / f"slurmd-{node}.log"

    @property
    def munge_log(self) -> Path:
        return self.log_dir / "munged.log"

    def env(self) -> dict[str, str]:
        """The environment for Slurm clients (sbatch, srun ...) talking to this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env[TAG_ENV] = self.tag
        env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
        return env

    # -- life cycle ---------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        if self._started:
            raise HarnessError(f"cluster {self.tag} was already started")
        reason = slurm_unavailable_reason()
        if reason:
            raise HarnessUnavailable(reason)
        self._started = True
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            sweep_stale(self.base.parent)
            self._make_dirs()
            self._start_munge(timeout)
            self._write_conf()
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)], self.ctld_log)
            for node in self.node_names:
                self._spawn(
                    f"slurmd-{node}",
                    ["slurmd", "-D", "-N", node, "-f", str(self.conf)],
                    self.slurmd_log(node),
                )
            self._wait_nodes_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def _make_dirs(self) -> None:
        self.base.mkdir(mode=0o755)
        os.chmod(self.base, 0o755)  # mkdir's mode is filtered by the umask
        for sub in ("etc", "state", "spool", "log", "jobs", "tmp", "munge"):
            (self.base / sub).mkdir(mode=0o755)
        (self.base / "munge" / "key").mkdir(mode=0o700)
        (self.base / "munge" / "sock").mkdir(mode=0o755)
        os.chmod(self.base / "munge" / "sock", 0o755)
        for node in self.node_names:
            (self.base / "spool" / node).mkdir()

    def _start_munge(self, timeout: float) -> None:
        key = self.base / "munge" / "key" / "munge.key"
        # a key private to this cluster: no other munged (the system's, a parallel test's) can
        # vouch for its credentials
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
        self._spawn(
            "munged",
            [
                "munged",
                "-F",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self.base / 'munge' / 'munged.pid'}",
                f"--seed-file={self.base / 'munge' / 'munged.seed'}",
                f"--log-file={self.munge_log}",
            ],
            self.log_dir / "munged.out",
        )
        deadline = time.monotonic() + timeout
        while True:
            enc = subprocess.run(
                ["munge", "-n", "-S", str(self.munge_socket)], capture_output=True, timeout=10.0
            )
            if enc.returncode == 0:
                dec = subprocess.run(
                    ["unmunge", "-S", str(self.munge_socket)],
                    input=enc.stdout,
                    capture_output=True,
                    timeout=10.0,
                )
                if dec.returncode == 0:
                    return
            self._check_alive("munged")
            if time.monotonic() >= deadline:
                raise HarnessError(
                    f"munged did not answer within {timeout:.0f}s: {self._tail(self.munge_log)}"
                )
            time.sleep(0.1)

    def _write_conf(self) -> None:
        ports = free_tcp_ports(1 + len(self.node_names))
        (self.base / "etc" / "plugstack.conf").write_text("")
        self.conf.write_text(
            render_conf(
                base=self.base,
                cluster_name=f"cpl{self.tag.rsplit('-', 1)[1]}",
                munge_socket=self.munge_socket,
                ctld_port=ports[0],
                node_ports=dict(zip(self.node_names, ports[1:], strict=True)),
                cpus_per_node=self.cpus_per_node,
            )
        )

    def _spawn(self, name: str, argv: list[str], log: Path) -> None:
        env = self.env()
        with open(log, "ab") as out:
            self._daemons[name] = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _check_alive(self, name: str) -> None:
        p = self._daemons[name]
        if p.poll() is not None:
            raise HarnessError(f"{name} exited with {p.returncode} at start-up; see {self.log_dir}")

    @staticmethod
    def _tail(path: Path, n: int = 2000) -> str:
        try:
            return path.read_text(errors="replace")[-n:]
        except OSError:
            return f"(no {path})"

    def _wait_nodes_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name in self._daemons:
                self._check_alive(name)
            res = self._client(["sinfo", "-h", "-N", "-o", "%N %t"], check_rc=False)
            states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
            if len(states) == len(self.node_names) and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() >= deadline:
                raise HarnessError(
                    f"Slurm nodes not idle after {timeout:.0f}s (sinfo: {states or res.stderr.strip()}); "
                    f"slurmctld log: {self._tail(self.ctld_log)}"
                )
            time.sleep(0.2)

    def stop(self, grace: float = 5.0) -> None:
        """Cancel every job, stop the daemons, kill any process left with our tag, remove the dir."""
        if self._stopped:
            return
        self._stopped = True
        errors: list[str] = []
        ctld = self._daemons.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            # let Slurm end its jobs the normal way first, so their epilogues and steps finish
            self._client(["scancel", "--full", "--quiet", "--partition=test"], check_rc=False)
        # slurmd first, then slurmctld, munged last: each one's shutdown still talks to the next
        # (and authenticates through munge); a daemon waiting on a peer already gone would stall
        order = sorted(self._daemons, key=lambda n: (n == "munged", n == "slurmctld"))
        for name in order:
            p = self._daemons[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                # a test cluster has no state worth a longer wait
                p.kill()
                p.wait(timeout=5.0)
        try:
            kill_tagged(self.tag, timeout=10.0)
        except HarnessError as e:
            errors.append(str(e))
        shutil.rmtree(self.base, ignore_errors=True)
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if errors:
            raise HarnessError("; ".join(errors))

    # -- clients ------------------------------------------------------------------------------------

    def _client(
        self, argv: list[str], *, timeout: float = 30.0, check_rc: bool = True
    ) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        if check_rc and res.returncode != 0:
            raise HarnessError(f"{' '.join(argv)!r} exited {res.returncode}: {res.stderr.strip()[-2000:]}")
        return res

    def sbatch(self, script: str, *args: str, script_args: tuple[str, ...] = ()) -> int:
        """Submit a batch script (its text); returns the job id. ``args`` go to sbatch before the
        script, ``script_args`` after it (the script's "$@")."""
        path = self.jobs_dir / f"job-{secrets.token_hex(4)}.sh"
        path.write_text(script if script.startswith("#!") else "#!/bin/bash\n" + script)
        path.chmod(0o755)
        res = self._client(
            [
                "sbatch",
                "--parsable",
                f"--chdir={self.jobs_dir}",
                f"--output={self.jobs_dir}/slurm-%j.out",
                *args,
                str(path),
                *script_args,
            ]
        )
        return int(res.stdout.strip().split(";")[0])

    def job_output(self, job_id: int) -> str:
        return self._tail(self.jobs_dir / f"slurm-{job_id}.out", n=100_000)

    def srun(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``srun args...`` to completion (an interactive job step)."""
        return self._client(["srun", *args], timeout=timeout, check_rc=False)

    def squeue(self) -> list[JobInfo]:
        """Jobs still pending or running."""
        res = self._client(["squeue", "-h", "-o", "%i %T %N"])
        jobs = []
        for line in res.stdout.splitlines():
            parts = line.split()
            if parts:
                jobs.append(JobInfo(int(parts[0]), parts[1], parts[2] if len(parts) > 2 else "", ""))
        return jobs

    def job(self, job_id: int) -> JobInfo:
        """A job's current record (kept for MinJobAge=600 s after it ends)."""
        res = self._client(["scontrol", "-o", "show", "job", str(job_id)])
        fields = dict(kv.split("=", 1) for kv in res.stdout.split() if "=" in kv)
        nodes = fields.get("NodeList", "")
        return JobInfo(
            job_id,
            fields.get("JobState", "?"),
            "" if nodes == "(null)" else nodes,
            fields.get("ExitCode", ""),
        )

    def wait(self, job_id: int, timeout: float = 60.0) -> JobInfo:
        """Block until the job reaches a final state; HarnessError at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.state in FINAL_STATES:
                return info
            if time.monotonic() >= deadline:
                raise HarnessError(f"job {job_id} still {info.state} after {timeout:.0f}s")
            time.sleep(0.2)

    def wait_running(self, job_id: int, timeout: float = 60.0) -> JobInfo:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.state == "RUNNING":
                return info
            if info.state in FINAL_STATES or time.monotonic() >= deadline:
                raise HarnessError(f"job {job_id} is {info.state}, not RUNNING (waited up to {timeout:.0f}s)")
            time.sleep(0.1)

    def job_pids(self) -> list[int]:
        """Processes of this cluster that are not its daemons: job scripts, slurmstepd, tasks."""
        return [p for p in tagged_pids(self.tag) if proc_comm(p) not in DAEMON_COMMS]

    def scancel(self, job_id: int, *args: str) -> None:
        self._client(["scancel", *args, str(job_id)])

    def node_state(self, node: str) -> str:
        """The node's state as ``sinfo`` abbreviates it: idle, alloc, down, down*, drain, ..."""
        res = self._client(["sinfo", "-h", "-N", "-n", node, "-o", "%t"])
        return res.stdout.strip()

    def set_node_down(self, node: str, reason: str = "test") -> None:
        """Mark a node DOWN (Slurm kills the jobs that run on it, like a real node failure)."""
        self._require_node(node)
        self._client(["scontrol", "update", f"NodeName={node}", "State=DOWN", f"Reason={reason}"])

    def resume_node(self, node: str) -> None:
        self._require_node(node)
        self._client(["scontrol", "update", f"NodeName={node}", "State=RESUME"])

    def kill_slurmd(self, node: str) -> None:
        """Node loss as Slurm sees it: the node's slurmd is SIGKILLed (its job steps keep running)."""
        self._require_node(node)
        p = self._daemons[f"slurmd-{node}"]
        p.kill()
        p.wait(timeout=10.0)

    def _require_node(self, node: str) -> None:
        if node not in self.node_names:
            raise ValueError(f"node={node!r}: this cluster has {self.node_names}")
