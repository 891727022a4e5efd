"""Multi-host jobs under a real Slurm (tests/helpers/harness/slurm.py: munged, slurmctld, 3 slurmd).

The batch script is the README's, word for word, with only the training command filled in: the
coordinator runs in the batch script on the first node, and ``srun --ntasks-per-node=1`` starts one
agent per node (2 nodes x 2 ranks + 1 hot-spare node). Every node is a slurmd on this machine
(NodeHostname=localhost), so ``hostname -i`` is a loopback address for all of them and the agents'
port allocation keeps them apart.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.harness.slurm import SlurmCluster
from tests.helpers.harness.slurm_procs import proc_comm
from tests.helpers.jobs import EXAMPLE, ROOT, SCRIPTS, TINY, JobResult, read_digests
from tests.helpers.reference import ReferenceRuns
from tests.helpers.wait import wait_for
from tests.multihost.test_multihost import check_recovered

pytestmark = [pytest.mark.timeout(240)]

ARGS = [*TINY[2:], "--steps", "30"]  # long enough to lose a node mid-run
# README.md's and docs/operations.md's sbatch example, character for character (the test below
# checks); the tests put the example's path in place of train.py and pass its arguments to sbatch
SCRIPT = """\
#!/bin/bash
#SBATCH --nodes=3 --ntasks-per-node=1 --no-kill
# 2 nodes x 2 ranks + 1 hot-spare node; the coordinator runs on the batch host.
# --no-kill: a failed node leaves the allocation instead of ending (requeueing) the whole job
RUN=runs/$SLURM_JOB_ID; PORT=$((20000 + SLURM_JOB_ID % 20000))
HOST=$(hostname -i)
checkpointless coordinator --nnodes 2 --nproc-per-node 2 --spare-nodes 1 \\
    --host $HOST --control-port $PORT --run-dir $RUN train.py "$@" &
COORD=$!
srun --ntasks-per-node=1 --no-kill bash -c 'exec checkpointless agent --coordinator '$HOST:$PORT' \\
    --host $(hostname -i) --secret-file '$RUN'/secret'
wait $COORD
"""


def _submit(c: SlurmCluster, out: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    # the job finds `checkpointless` on PATH as a user's would (sbatch exports our environment)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    args = (*ARGS, "--data", str(corpus), "--digest-out", f"{out}/digest-{{rank}}")
    return c.sbatch(SCRIPT.replace("train.py", str(EXAMPLE)), script_args=args)


def _run_dir(c: SlurmCluster, job: int) -> Path:
    return c.jobs_dir / "runs" / str(job)


def _start(
    c: SlurmCluster, tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, Path, Path]:
    """Submit the README's job: its id, the folder its digests go to, its run directory."""
    out = tmp_path / "out"
    out.mkdir()
    job = _submit(c, out, corpus, monkeypatch)
    return job, out, _run_dir(c, job)


def _wait_committed(c: SlurmCluster, job: int, rank: int, step: int, deadline: float, where: str) -> None:
    """Wait for ``rank`` of ``job`` (on node ``where``) to commit ``step``; a failed wait names
    what Slurm says of the job."""
    run_dir = _run_dir(c, job)
    wait_for(
        lambda: _committed(run_dir, rank) >= step,
        deadline,
        f"rank {rank} ({where}) to commit step {step}",
        interval=0.1,
        details=lambda: _job_state(c, job),
    )


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    f = run_dir / "events.jsonl"
    if not f.exists():
        return []
    return [e for e in map(json.loads, f.read_text().splitlines()) if e["event"] == kind]


def _committed(run_dir: Path, rank: int) -> int:
    f = run_dir / f"rank-{rank}.jsonl"
    if not f.exists():
        return -1
    return max((json.loads(x)["step"] for x in f.read_text().splitlines() if '"commit"' in x), default=-1)


def _job_state(c: SlurmCluster, job: int) -> str:
    """What Slurm says of the job, and the end of its output: why a wait for it failed."""
    return f"job {c.job(job)}:\n{c.job_output(job)[-4000:]}"


def _result(c: SlurmCluster, job: int, out: Path, timeout: float) -> JobResult:
    info = c.wait(job, timeout=timeout)
    output = c.job_output(job)
    run_dir = _run_dir(c, job)
    for f in sorted(run_dir.glob("agent-*.jsonl")):
        output += f"\n--- {f.name}\n" + f.read_text(errors="replace")[-2000:]
    assert info.state == "COMPLETED" and info.exit_code == "0:0", (info, output[-6000:])
    return JobResult(0, output, run_dir, read_digests(out, "digest-"))


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def _node_step_pids(c: SlurmCluster, node: str) -> list[int]:
    """The agent and workers that run on ``node`` (their environment names it), and the
    slurmstepd that the agent is a child of."""
    procs = [p for p in c.job_pids() if _environ(p).get("SLURMD_NODENAME") == node]
    parents = set()
    for p in procs:
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if proc_comm(ppid) == "slurmstepd":
            parents.add(ppid)
    return procs + sorted(parents)


def _lose_node(c: SlurmCluster, node: str, at_least: int) -> None:
    """``node`` dies as a whole: its slurmd first (so nothing on it reacts), then, all at once,
    the job step's slurmstepd, the agent and its workers (``at_least`` processes)."""
    c.kill_slurmd(node)
    victims = _node_step_pids(c, node)
    assert len(victims) >= at_least and any(proc_comm(p) == "slurmstepd" for p in victims), victims
    for p in victims:
        os.kill(p, signal.SIGKILL)


def _no_job_processes(c: SlurmCluster, timeout: float = 30.0) -> None:
    """No process of any job (batch shell, slurmstepd, coordinator, agent, worker) on any node."""
    deadline = time.monotonic() + timeout  # slurmstepd ends a moment after its tasks
    while c.job_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = c.job_pids()
    assert not left, f"processes left behind: {[(p, proc_comm(p)) for p in left]}"


def _check_clean(c: SlurmCluster, res: JobResult) -> None:
    assert not res.left_behind(), "processes of the job were left behind"
    _no_job_processes(c)
    shm = res.of("job_start")[0]["shm"]
    assert not Path(shm).exists(), f"shared memory {shm} left behind"


@pytest.mark.slurm
def test_sbatch_job_finishes_bitwise(
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    corpus: Path,
    monkeypatch: pytest.MonkeyPatch,
    reference: ReferenceRuns,
) -> None:
    ref = reference(4, script_args=ARGS)
    job, out, _ = _start(slurm_cluster, tmp_path, corpus, monkeypatch)
    res = _result(slurm_cluster, job, out, timeout=150)
    res.assert_same_weights(ref, nproc=4)
    assert res.batches() == ref.batches(), "some rank trained on other samples than the fault-free run"
    placement = _events(res.run_dir, "placement")
    assert placement and len(placement[0]["spare_hosts"]) == 1, placement
    _check_clean(slurm_cluster, res)


@pytest.mark.slurm
def test_node_lost_mid_run_is_recovered_on_the_spare_node(
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    corpus: Path,
    monkeypatch: pytest.MonkeyPatch,
    reference: ReferenceRuns,
) -> None:
    c = slurm_cluster
    ref = reference(4, script_args=ARGS)
    deadline = time.monotonic() + 180
    job, out, run_dir = _start(c, tmp_path, corpus, monkeypatch)
    # $SLURM_NODEID orders the hosts: node n2 (id 1) holds ranks 2 and 3, n3 is the spare node
    _wait_committed(c, job, 2, 5, deadline, "node n2")
    # the step's slurmstepd, the agent and the two workers of ranks 2-3 at least
    _lose_node(c, "n2", at_least=4)
    # what Slurm does: after SlurmdTimeout the node is DOWN ("down*", not responding) and, as the
    # job was submitted with --no-kill, it leaves the job's allocation while the job runs on
    wait_for(
        lambda: c.node_state("n2").startswith("down"),
        deadline,
        "Slurm to mark n2 DOWN",
        interval=0.1,
        details=lambda: _job_state(c, job),
    )
    running_when_down = c.job(job).state == "RUNNING"
    res = _result(c, job, out, timeout=max(1.0, deadline - time.monotonic()))
    if running_when_down:
        assert c.job(job).nodes in ("n[1,3]", "n1,n3"), c.job(job)
    check_recovered(res, ref, {2, 3})
    _no_job_processes(c)
    lost = _events(run_dir, "host_lost")
    assert [e["ranks"] for e in lost] == [[2, 3]], lost
    moved = {e["rank"]: e["worker"] for e in _events(run_dir, "spare_assigned")}
    assert {2, 3} <= set(moved), moved
    # every node's address is 127.0.0.1 here, so the spare node is told apart by its agent: not
    # the lost one (n2's), and not the one that started the first workers of ranks 0 and 1 (n1's)
    spawns = {
        int(f.name.split("-")[1].split(".")[0]): {
            e["worker"] for e in map(json.loads, f.read_text().splitlines()) if e["event"] == "spawn"
        }
        for f in run_dir.glob("agent-*.jsonl")
    }
    # workers 0-3 are the first ones of ranks 0-3
    (n1,) = [h for h, w in spawns.items() if {0, 1} <= w]
    (spare,) = set(spawns) - {n1, lost[0]["host"]}
    assert {moved[2], moved[3]} <= spawns[spare], (
        f"the lost node's ranks must land on the spare node: {spawns}"
    )


@pytest.mark.slurm
def test_scancel_leaves_nothing_behind(
    slurm_cluster: SlurmCluster, tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = slurm_cluster
    deadline = time.monotonic() + 120
    job, _, run_dir = _start(c, tmp_path, corpus, monkeypatch)
    _wait_committed(c, job, 0, 2, deadline, "node n1")
    shm = Path(_events(run_dir, "job_start")[0]["shm"])
    assert shm.exists() and (run_dir / "secret").exists()
    c.scancel(job)
    assert c.wait(job, timeout=60).state == "CANCELLED"
    _no_job_processes(c)
    assert not shm.exists(), f"shared memory {shm} left behind"
    assert not (run_dir / "secret").exists(), "the job's secret was left behind"


# Degraded mode under Slurm (issue 39): 3 nodes x 1 rank and no spare node. The script draws per
# rank from the global generators, as the netns degraded test's does (the same fault-free run).
DEGRADED_SCRIPT = SCRIPTS / "dropout_global_rng.py"
DEGRADED_ARGS = ["--steps", "80", "--sleep", "0.05"]
DEGRADED_JOB = """\
#!/bin/bash
#SBATCH --nodes=3 --ntasks-per-node=1 --no-kill
RUN=runs/$SLURM_JOB_ID; PORT=$((20000 + SLURM_JOB_ID % 20000))
HOST=$(hostname -i)
checkpointless coordinator --nnodes 3 --nproc-per-node 1 --spare-nodes 0 --when-no-spare shrink \\
    --host $HOST --control-port $PORT --run-dir $RUN train.py "$@" &
COORD=$!
srun --ntasks-per-node=1 --no-kill bash -c 'exec checkpointless agent --coordinator '$HOST:$PORT' \\
    --host $(hostname -i) --secret-file '$RUN'/secret'
wait $COORD
"""
# A second allocation that brings one more node to a running job. The job's run directory ($1,
# on the shared file system) holds what its agent needs: the coordinator's address, recorded by
# the coordinator (a successor after a failover records its own), and the secret. The agent
# leaves when that job ends.
JOINING_JOB = """\
#!/bin/bash
#SBATCH --nodes=1 --ntasks-per-node=1
RUN=$1
srun bash -c 'exec checkpointless agent --coordinator '$(cat $RUN/coordinator)' \\
    --host $(hostname -i) --secret-file '$RUN'/secret'
"""


@pytest.mark.slurm
# in the soak: test_degraded_netns.py runs the same shrink and grow-back in `make test`; this adds
# Slurm's node loss and a second allocation's agent joining through the run directory
@pytest.mark.soak
@pytest.mark.timeout(240)
@pytest.mark.parametrize("slurm_cluster", [4], indirect=True)
def test_node_lost_with_no_spare_node_trains_degraded_and_a_second_allocation_grows_it_back(
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    corpus: Path,
    monkeypatch: pytest.MonkeyPatch,
    reference: ReferenceRuns,
) -> None:
    c = slurm_cluster
    ref = reference(3, script=DEGRADED_SCRIPT, script_args=DEGRADED_ARGS)
    deadline = time.monotonic() + 200
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    out = tmp_path / "out"
    out.mkdir()
    args = (*DEGRADED_ARGS, "--data", str(corpus), "--digest-out", f"{out}/digest-{{rank}}")
    job = c.sbatch(DEGRADED_JOB.replace("train.py", str(DEGRADED_SCRIPT)), script_args=args)
    run_dir = _run_dir(c, job)
    # $SLURM_NODEID orders the hosts: n2 holds rank 1, and n4 is left for the second allocation
    _wait_committed(c, job, 1, 8, deadline, "node n2")
    _lose_node(c, "n2", at_least=3)  # the step's slurmstepd, the agent and rank 1's worker
    details = lambda: _job_state(c, job)  # noqa: E731
    wait_for(lambda: _events(run_dir, "width"), deadline, "the job to shrink", interval=0.1, details=details)
    shrunk = _committed(run_dir, 0)
    wait_for(
        lambda: _committed(run_dir, 0) >= shrunk + 5,
        deadline,
        "the job to train on degraded",
        interval=0.1,
        details=details,
    )
    joining = c.sbatch(JOINING_JOB, script_args=(str(run_dir.resolve()),))
    wait_for(
        lambda: [e for e in _events(run_dir, "width") if e["width"] == 3],
        deadline,
        "the job to grow back",
        interval=0.1,
        details=lambda: f"{details()}\n{_job_state(c, joining)}",
    )
    res = _result(c, job, out, timeout=max(1.0, deadline - time.monotonic()))
    assert c.wait(joining, timeout=60).state == "COMPLETED", _job_state(c, joining)
    assert [e["ranks"] for e in _events(run_dir, "host_lost")] == [[1]]
    widths = [(e["width"], e["holders"]) for e in res.of("width")]
    assert widths == [(2, [[1, 0]]), (3, [])], widths
    res.assert_same_weights(ref, nproc=3)
    assert not res.of("inexact"), res.of("inexact")
    # only the step the kill cut off may lack its line: its replicas committed it, the lost rank
    # never logged it
    res.assert_same_batches(ref, lost={1})
    # the slot came back on the second allocation's node
    spawns = {
        int(f.name.split("-")[1].split(".")[0]): [
            e for e in map(json.loads, f.read_text().splitlines()) if e["event"] == "spawn"
        ]
        for f in run_dir.glob("agent-*.jsonl")
    }
    assert len(spawns) == 4, f"expected the agents of n1-n3 and of the second allocation: {sorted(spawns)}"
    _check_clean(c, res)


@pytest.mark.parametrize("doc", ["README.md", "docs/operations.md"])
def test_the_docs_show_the_tested_script(doc: str) -> None:
    text = (ROOT / doc).read_text()
    start = text.index("#!/bin/bash\n#SBATCH")
    assert text[start : text.index("```", start)] == SCRIPT, (
        f"{doc}'s sbatch example is not the one tested here"
    )
