"""An adopted script started by plain ``torchrun`` is one job, not N single-process jobs.

Under real ``torchrun --nproc-per-node 2`` (the one in .venv/bin), the adopted DDP tutorial
(examples/adopted/multigpu_torchrun_adopted.py: DistributedSampler(dataset), job.loader, job.steps,
job.data_parallel, rank 0's snapshot after every epoch) must average gradients over both ranks and
end with weights bitwise equal on both ranks and to the same job under ``checkpointless run``;
each rank says once that it runs without in-process recovery and how to get it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from checkpointless.recovery.torchrun import started_by_torchrun
from tests.helpers.jobs import ROOT, read_digests, run_job, torchrun_env

TUTORIAL = ROOT / "examples" / "adopted" / "multigpu_torchrun_adopted.py"
WARNING = "runs WITHOUT in-process recovery"


@pytest.mark.timeout(400)
def test_adopted_tutorial_under_plain_torchrun_is_one_job_bitwise_equal_to_checkpointless_run(
    tmp_path: Path,
) -> None:
    # 4 epochs of 32 steps (2048 samples, 2 ranks, batches of 32), a snapshot every epoch; the
    # divergence check (every 100 steps by default) runs once, over torchrun's ranks
    def args(name: str) -> list[str]:
        return ["4", "1", "--snapshot_path", str(tmp_path / f"{name}.pt")]

    torchrun = Path(sys.executable).parent / "torchrun"
    digest = tmp_path / "torchrun.digest-{rank}"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(TUTORIAL), *args("torchrun")]
    proc = subprocess.run(
        [*cmd, "--digest-out", str(digest)],
        cwd=ROOT,
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    digests = read_digests(tmp_path, "torchrun.digest-")
    assert sorted(digests) == [0, 1], out[-4000:]
    # both ranks hold the same weights, and (below) the weights of a 2-rank job: N independent
    # jobs would each have trained a world of one on the whole dataset
    assert digests[0] == digests[1], "the ranks trained apart"
    warnings = [line for line in out.splitlines() if WARNING in line]
    assert len(warnings) == 2, out[-4000:]
    assert any("rank 0 of 2" in w for w in warnings) and any("rank 1 of 2" in w for w in warnings)
    assert all("checkpointless run --nproc 2" in w for w in warnings), warnings
    assert (tmp_path / "torchrun.pt").exists(), "rank 0's per-epoch snapshot was not written"

    ref = run_job(tmp_path / "ref", Path("/nonexistent"), 2, 0, script=TUTORIAL, script_args=args("ref"))
    assert ref.rc == 0 and ref.digest is not None, ref.output[-4000:]
    assert ref.digest == digests[0], "torchrun's run differs from the same job under checkpointless run"
    assert WARNING not in ref.output


# A small adopted script; an exit handler registered before init() runs after the job's own and
# reports what is left of torch.distributed and of the job's communicator at that point.
EXIT_PROBE = """
import atexit
import torch
import torch.distributed as dist
import checkpointless as cl

def report():
    job = cl.init()
    print(f"rank {job.rank} at exit: initialized={dist.is_initialized()} comm={job.internals.comm.aborted}", flush=True)

atexit.register(report)
job = cl.init()
torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
model = job.data_parallel(net)
job.track(model=net, optimizer=opt)
for step in job.steps(4):
    with step:
        loss = model(torch.full((2, 4), float(job.rank))).sum()
        opt.zero_grad(); loss.backward(); opt.step()
"""


def _torchrun_probe(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "probe.py"
    script.write_text(EXIT_PROBE)
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script)]
    return subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(200)
def test_under_plain_torchrun_the_groups_are_closed_before_the_interpreter_exits(tmp_path: Path) -> None:
    # Left to the interpreter's own teardown, gloo groups can abort a process that has finished
    # (seen once in this suite: SIGABRT after both digests were written); the job closes its
    # groups and torch's at exit, before the teardown.
    proc = _torchrun_probe(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} at exit: initialized=False comm=closed" in out, out[-4000:]


def test_torchrun_is_recognised_only_with_its_variables_and_a_world_of_many() -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2"}
    assert started_by_torchrun(torchrun)
    assert started_by_torchrun({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "4"})
    # a world of one, or RANK alone (set by init() itself in a single process), is not torchrun
    assert not started_by_torchrun({**torchrun, "WORLD_SIZE": "1"})
    assert not started_by_torchrun({"RANK": "0", "WORLD_SIZE": "2"})
    assert not started_by_torchrun({})
