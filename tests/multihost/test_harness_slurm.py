"""Self-tests of the Slurm harness (tests/helpers/harness/slurm.py): real munged, slurmctld and slurmd."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.harness.fixtures import unavailable
from tests.helpers.harness.slurm import SlurmCluster, slurm_unavailable_reason, sweep_stale, tagged_pids
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


def test_srun_runs_on_two_distinct_nodes(slurm_cluster: SlurmCluster) -> None:
    res = slurm_cluster.srun("-N2", "--ntasks-per-node=1", "bash", "-c", "echo node=$SLURMD_NODENAME")
    assert res.returncode == 0, res.stderr
    nodes = sorted(line.split("=", 1)[1] for line in res.stdout.split())
    assert len(nodes) == 2 and len(set(nodes)) == 2 and set(nodes) <= set(slurm_cluster.node_names), (
        res.stdout
    )


def test_sbatch_two_node_job_completes(slurm_cluster: SlurmCluster) -> None:
    job = slurm_cluster.sbatch(
        "srun --ntasks-per-node=1 bash -c 'echo task=$SLURM_PROCID node=$SLURMD_NODENAME'\n", "-N2"
    )
    info = slurm_cluster.wait(job, timeout=60)
    out = slurm_cluster.job_output(job)
    assert info.state == "COMPLETED" and info.exit_code == "0:0", (info, out)
    tasks = sorted(line for line in out.splitlines() if line.startswith("task="))
    assert [t.split()[0] for t in tasks] == ["task=0", "task=1"], out
    assert len({t.split()[1] for t in tasks}) == 2, out


def test_scancel_stops_the_jobs_processes(slurm_cluster: SlurmCluster) -> None:
    c = slurm_cluster
    job = c.sbatch("srun --ntasks-per-node=1 sleep 300\n", "-N2")
    c.wait_running(job, timeout=30)
    # both steps' sleeps run (they carry the cluster's tag, inherited through sbatch and srun)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sleeps = [p for p in tagged_pids(c.tag) if _comm(p) == "sleep"]
        if len(sleeps) == 2:
            break
        time.sleep(0.1)
    assert len(sleeps) == 2, sleeps
    c.scancel(job)
    assert c.wait(job, timeout=30).state == "CANCELLED"
    deadline = time.monotonic() + 30
    while c.job_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = c.job_pids()
    assert not left, f"processes left after scancel: {[(p, _comm(p)) for p in left]}"


def test_node_set_down_while_a_job_runs_is_observable(slurm_cluster: SlurmCluster) -> None:
    c = slurm_cluster
    job = c.sbatch("srun --ntasks-per-node=1 sleep 300\n", "-N2", "--no-requeue")
    info = c.wait_running(job, timeout=30)
    victim = _first_node(info.nodes)
    c.set_node_down(victim, reason="harness self-test")
    assert c.node_state(victim).startswith("down")
    end = c.wait(job, timeout=60)
    assert end.state == "NODE_FAIL", end
    # the node stays DOWN (no job can land there) until it is resumed
    time.sleep(1.0)
    assert c.node_state(victim).startswith("down")
    assert c.srun("-N3", "--immediate=3", "true", timeout=30).returncode != 0
    c.resume_node(victim)
    deadline = time.monotonic() + 30
    while c.node_state(victim) != "idle" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert c.node_state(victim) == "idle"
    assert c.srun("-N3", "true", timeout=30).returncode == 0


def test_stop_leaves_nothing_behind() -> None:
    reason = slurm_unavailable_reason()
    if reason:
        unavailable(reason)
    c = SlurmCluster(nodes=2)
    try:
        c.start()
        c.sbatch("srun --ntasks-per-node=1 sleep 300\n", "-N2")
        assert len(tagged_pids(c.tag)) >= 4  # munged, slurmctld, two slurmd (and the job)
    finally:
        c.stop()
    assert tagged_pids(c.tag) == []
    assert not c.base.exists()


def test_stale_cluster_of_a_dead_run_is_swept(tmp_path: Path) -> None:
    stale = os.path.join(str(tmp_path), "cpls-0-abcdef")
    os.makedirs(os.path.join(stale, "log"))
    removed = sweep_stale(tmp_path)
    assert [str(p) for p in removed] == [stale] and not os.path.exists(stale)


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="nodes=0"):
        SlurmCluster(nodes=0)
    with pytest.raises(ValueError, match="'n9'"):
        SlurmCluster(nodes=2).set_node_down("n9")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _first_node(nodelist: str) -> str:
    # "n[1-2]" or "n1,n2" -> "n1"
    if "[" in nodelist:
        prefix, rest = nodelist.split("[", 1)
        return prefix + rest.split("-", 1)[0].split(",", 1)[0].rstrip("]")
    return nodelist.split(",")[0]


_OWNER = """
import sys, time
sys.path.insert(0, {tests!r})
from tests.helpers.harness.slurm import SlurmCluster
c = SlurmCluster(nodes=2)
c.start()
c.sbatch("srun --ntasks-per-node=1 sleep 300\\n", "-N2")
print(c.tag, c.base, flush=True)
time.sleep(120)
"""


def test_a_killed_owner_is_swept_by_the_next_run() -> None:
    reason = slurm_unavailable_reason()
    if reason:
        unavailable(reason)
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER.format(tests=str(ROOT))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        tag, base = owner.stdout.readline().split()
        owner.kill()  # no cleanup at all: its daemons (own sessions) and the directory stay
        owner.wait(timeout=30)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
    assert tagged_pids(tag) and Path(base).exists()
    assert Path(base) in sweep_stale(Path(base).parent)
    assert tagged_pids(tag) == [] and not Path(base).exists()
