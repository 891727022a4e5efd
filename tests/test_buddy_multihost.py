"""Composition: a sharded job without replicas loses a whole host, and its shards come back from
the buddy copies kept on the other host.

2 hosts x 2 ranks + 1 hot-spare host (network namespaces), FSDP 1x4 (R = 1: no shard has a
replica). Buddies are one host over: ranks 2 and 3 (host 1) keep their copies on ranks 0 and 1
(host 0), and the reverse. Every process of host 1 is killed at once; its ranks move to the spare
host and take their shards from host 0's buddies. Every rank's final shards must be bit for bit
those of the fault-free run.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from harness.hosts import NetnsCluster
from jobs import ROOT, TINY, JobResult, alive, run_job
from test_multihost import _committed, _events, _finish, _wait_for

ARGS = [*TINY[2:], "--steps", "40", "--fsdp", "1,4"]
CONTROL_PORT = 29410
_REF: dict[str, JobResult] = {}


def _start(cluster: NetnsCluster, run_dir: Path, corpus: Path, shm: list[Path]) -> list[Any]:
    h0 = cluster.hosts[0]
    py = [sys.executable, "-m", "checkpointless"]
    digest = run_dir.parent / (run_dir.name + ".digest-{rank}")
    coord = [
        *py,
        "coordinator",
        "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1",
        "--host", h0.address, "--control-port", str(CONTROL_PORT),
        "--run-dir", str(run_dir), "--hang-timeout", "20", "--lease", "3",
        str(ROOT / "examples" / "train_gpt.py"), *ARGS,
        "--data", str(corpus), "--digest-out", str(digest),
    ]  # fmt: skip
    log = open(run_dir.parent / "coordinator.out", "wb")  # noqa: SIM115 (lives as long as the job)
    procs = [h0.popen(coord, cwd=ROOT, stdout=log, stderr=log)]
    for i, h in enumerate(cluster.hosts):
        agent = [
            *py, "agent", "--coordinator", f"{h0.address}:{CONTROL_PORT}", "--host", h.address,
            "--secret-file", str(run_dir / "secret"), "--node-order", str(i),
        ]  # fmt: skip
        out = open(run_dir.parent / f"agent-{i}.out", "wb")  # noqa: SIM115
        # the namespaces share this machine's /dev/shm, real hosts do not: without a directory
        # of its own, a replacement on the spare host could read the lost host's own snapshots
        env = {**os.environ, "CHECKPOINTLESS_SHM_DIR": str(shm[i])}
        procs.append(h.popen(agent, cwd=ROOT, env=env, stdout=out, stderr=out))
    return procs


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_fsdp_host_loss_is_recovered_from_buddies_on_the_other_host(
    netns_hosts: Any, tmp_path: Path, corpus: Path
) -> None:
    if "ref" not in _REF:
        (tmp_path / "ref").mkdir()
        ref = run_job(tmp_path / "ref" / "run", corpus, nproc=4, spares=0, script_args=ARGS)
        assert ref.rc == 0 and len(set(ref.digests.values())) == 4, ref.output[-4000:]
        _REF["ref"] = ref
    ref = _REF["ref"]
    cluster = netns_hosts(3)
    run_dir = tmp_path / "job" / "run"
    run_dir.parent.mkdir()
    deadline = time.monotonic() + 200
    shm = [Path(tempfile.mkdtemp(prefix=f"cl-test-h{i}-", dir="/dev/shm")) for i in range(3)]
    try:
        procs = _start(cluster, run_dir, corpus, shm)
        _recovered_from_buddies(cluster, procs, run_dir, ref, deadline)
        # the surviving hosts' agents removed the job's shared memory (host 1's died with it)
        assert not [p for i in (0, 2) for p in shm[i].iterdir()], "shared memory was left behind"
    finally:
        for d in shm:
            shutil.rmtree(d, ignore_errors=True)


def _recovered_from_buddies(
    cluster: NetnsCluster, procs: list[Any], run_dir: Path, ref: JobResult, deadline: float
) -> None:
    _wait_for(lambda: _committed(run_dir, 2) >= 5, deadline, "rank 2 (host 1) to commit step 5")
    assert cluster.hosts[1].kill_all(), "host 1 had no processes to kill"
    res = _finish(procs, run_dir, deadline)
    assert res.rc == 0, res.output[-6000:]
    wrong = {r: d[:12] for r, d in ref.digests.items() if res.digests.get(r) != d}
    assert not wrong, f"final shards differ from the fault-free run's on ranks {wrong}"
    got, want = res.batches(), ref.batches()
    assert not {k for k in got if got[k] != want.get(k)}, "some rank trained on other samples"
    assert [e["ranks"] for e in _events(run_dir, "host_lost")] == [[2, 3]]
    # host 1's shards came from the copies host 0 keeps: rank 2's on rank 0, rank 3's on rank 1
    plans = [e for e in _events(run_dir, "plan") if e["generation"] > 0]
    served = {r: s for p in plans for r, s in p.get("sources", []) if r in p.get("from_copy", [])}
    assert served.get(2) == 0 and served.get(3) == 1, plans
    assert not [p for p in res.pids() if alive(p)], "processes of the job were left behind"
