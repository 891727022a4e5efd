"""The Lightning example under `checkpointless run`, with real faults, bitwise on every rank.

Each run is examples/lightning_gpt.py (a LightningModule, a Trainer with CheckpointlessStrategy,
the DataLoader into which Lightning injects its DistributedSampler, a stateful callback keeping an
EMA of the weights) on 3 ranks and 1 spare. It must end with every rank's final weights and EMA
equal to a fault-free run's, and every (rank, step) must have trained on the batch the fault-free
run trained on.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, JobResult, fault_at, start_job

pytest.importorskip("lightning", reason="the `lightning` extra is not installed")

SCRIPT = ROOT / "examples" / "lightning_gpt.py"
ARGS = ["--steps", "8", "--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16"]
ARGS += ["--global-batch", "12", "--print-batches", "--print-reads", "--ema", "0.9"]
# validation inside the fit, after batches 2 and 5: rank 0's replacement at step 6 seeks past both
# runs, and the checkpoint it writes holds the validation loop's counters of the fault-free run
ARGS += ["--val-every", "3"]
_REF: dict[str, JobResult] = {}


def run(
    run_dir: Path, corpus: Path, faults: list[str], spares: int = 1, extra: list[str] | None = None
) -> JobResult:
    # ModelCheckpoint (rank 0 writes, every 5 steps and last.ckpt) runs in every job
    args = [*ARGS, "--ckpt-dir", str(run_dir.parent / "ckpt")]
    job = start_job(
        run_dir, corpus, 3, spares, faults, extra, script_args=args, script=SCRIPT, hang_timeout=6
    )
    return job.finish(150)


def assert_same_checkpoints(res: JobResult, ref: JobResult) -> None:
    """Lightning's checkpoint files hold what the fault-free run's hold: weights, optimizer,
    scheduler and loop counters, whichever process was rank 0 when each was written."""
    import torch

    got_dir, want_dir = res.run_dir.parent / "ckpt", ref.run_dir.parent / "ckpt"
    names = sorted(p.name for p in want_dir.glob("*.ckpt"))
    assert names == ["epoch=0-step=5.ckpt", "last.ckpt"], names
    assert sorted(p.name for p in got_dir.glob("*.ckpt")) == names
    for name in names:
        got = torch.load(got_dir / name, weights_only=False)
        want = torch.load(want_dir / name, weights_only=False)
        for key in ("global_step", "epoch", "loops", "lr_schedulers"):
            assert got[key] == want[key], f"{name}: {key} differs"
        # the callbacks' state: ModelCheckpoint's paths and the weights' EMA (a replacement
        # received them, and its walk past covered batches never reached them)
        here, there = _paths(got["callbacks"], str(got_dir)), _paths(want["callbacks"], str(want_dir))
        assert _same(here, there), f"{name}: callback state differs"
        for k, t in want["state_dict"].items():
            assert torch.equal(got["state_dict"][k], t), f"{name}: weight {k} differs"
        for a, b in zip(got["optimizer_states"], want["optimizer_states"], strict=True):
            for pa, pb in zip(a["state"].values(), b["state"].values(), strict=True):
                assert all(torch.equal(pa[k], pb[k]) for k in pb), f"{name}: optimizer state differs"


def assert_reads_only_trained_batches(res: JobResult, replaced: int) -> None:
    """Every process read the samples of the batches it trained on and no other: ``replaced``
    processes were replacements, which seek to their step in Lightning's loop instead of reading
    the DataLoader from the job's start (each prints its count as it ends)."""
    counts = re.findall(r"reads rank=(\d+) samples=(\d+) trained=(\d+)x(\d+)", res.output)
    assert sorted(int(c[0]) for c in counts) == [0, 1, 2], res.output[-4000:]  # the killed print none
    for rank, samples, trained, per_batch in counts:
        assert int(samples) == int(trained) * int(per_batch), f"rank {rank} read {samples} samples"
    assert res.output.count("by seeking to epoch 0, batch") == replaced, res.output[-4000:]


def assert_same_loops(res: JobResult, ref: JobResult) -> None:
    """Every rank's Lightning loops (the training and validation loops' counters, as a checkpoint
    holds them) end where the fault-free run's do, a replacement's that sought its step too."""
    pattern = r"loops rank=(\d+) ([0-9a-f]{16})"
    got, want = dict(re.findall(pattern, res.output)), dict(re.findall(pattern, ref.output))
    assert sorted(want) == ["0", "1", "2"] and got == want, (got, want)


def _paths(state: object, ckpt_dir: str) -> object:
    """The state with the run's checkpoint directory named alike (runs write to their own)."""
    if isinstance(state, str):
        return state.replace(ckpt_dir, "<ckpt>")
    if isinstance(state, dict):
        return {_paths(k, ckpt_dir): _paths(v, ckpt_dir) for k, v in state.items()}
    return state


def _same(a: object, b: object) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> JobResult:
    res = run(tmp_path_factory.mktemp("lightning-ref") / "run", corpus, [], spares=0)
    assert res.rc == 0, res.output[-4000:]
    assert sorted(res.digests) == [0, 1, 2] and res.digest, res.digests
    assert len(res.trained_batches()) == 3 * 8, "every rank trains on one batch per step"
    return res


# (id, fault, soak): the soak cases run under `make soak` only. An exception in backward takes
# the strategy through the same abort and replay as one in forward (raise-forward); a killed
# rank's replacement walks Lightning's loop forward as rank0-killed-after-a-save's does (which
# checks the checkpoints on top); a stopped rank is found by the launcher's hang detection
# (test_faults_e2e's sigstop-hang) and then replaced exactly as a killed one
CASES = [
    ("sigkill", "kill:rank=1:step=4", True),
    ("raise-forward", "raise:rank=1:step=3:site=forward", False),
    ("raise-backward", "raise:rank=2:step=4:site=backward", True),
    # rank 0 (which writes the checkpoints) fails inside its update of step 4; its peers finish
    # theirs, so it is rolled forward to step 5 and writes epoch=0-step=5.ckpt while its stateful
    # callbacks sit out the hooks of batch 4, which the received state holds already
    ("raise-mid-optimizer", "raise:rank=0:step=4:site=optimizer", False),
    ("sigstop-hang", "hang:rank=2:step=5", True),
    # rank 0 writes the checkpoints; its replacement walks past step 5 and must not overwrite
    # epoch=0-step=5.ckpt with its later state
    ("rank0-killed-after-a-save", "kill:rank=0:step=6", False),
]


# `make test` runs the cases not marked soak above in one job (MERGED, at their own steps), each
# fault asserted as its own case asserts it (test_lightning_faults_in_one_job_are_each_survived_
# bitwise); every single-fault case runs under `make soak` only
MERGED = [f for _, f, soak in CASES if not soak]


@pytest.mark.soak
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", [pytest.param(f, id=name) for name, f, _ in CASES])
def test_lightning_fault_is_survived_bitwise(
    tmp_path: Path, corpus: Path, reference: JobResult, fault: str
) -> None:
    res = run(tmp_path / "run", corpus, [fault])
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(reference, nproc=3)
    assert res.trained_batches() == reference.trained_batches(), (
        "some rank trained on other samples than the fault-free run"
    )
    assert len(res.of("fault_injected")) == 1 and res.of("recovery"), res.output[-4000:]
    # a replacement walking Lightning's loop forward must not deadlock with the survivors (it did
    # in the loop's per-batch SIGTERM broadcast, until gloo's 60 s timeout broke it)
    timed_out = [f["detail"] for f in res.of("fault") if "Timed out" in f.get("detail", "")]
    assert not timed_out, timed_out
    assert_same_checkpoints(res, reference)
    if fault.startswith(("kill", "hang")):
        assert res.of("spare_assigned"), "a dead or hung rank must be replaced by a spare"
        assert "Lightning's loop catches up" in res.output
    assert_reads_only_trained_batches(res, replaced=1 if fault.startswith(("kill", "hang")) else 0)
    if "optimizer" in fault:
        plans = [p for p in res.of("plan") if p["generation"] > 0]
        assert 0 in plans[0]["receivers"], "a rank that faulted mid-update must receive state"
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.timeout(240)
def test_lightning_faults_in_one_job_are_each_survived_bitwise(
    tmp_path: Path, corpus: Path, reference: JobResult
) -> None:
    res = run(tmp_path / "run", corpus, MERGED)
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(reference, nproc=3)
    assert res.trained_batches() == reference.trained_batches(), (
        "some rank trained on other samples than the fault-free run"
    )
    assert len(res.of("fault_injected")) == len(MERGED), res.output[-4000:]
    # a replacement walking Lightning's loop forward must not deadlock with the survivors
    timed_out = [f["detail"] for f in res.of("fault") if "Timed out" in f.get("detail", "")]
    assert not timed_out, timed_out
    assert_same_checkpoints(res, reference)
    # the killed rank 0's replacement read only the batches from its step on
    assert_reads_only_trained_batches(res, replaced=sum(f.startswith(("kill", "hang")) for f in MERGED))
    assert_same_loops(res, reference)
    for fault in MERGED:
        rank, step = fault_at(fault)
        rec = res.recovery_from(rank, step)
        assert res.fired(fault) and rec is not None, (fault, res.output[-4000:])
        if fault.startswith(("kill", "hang")):
            spares = [
                e
                for e in res.of("spare_assigned")
                if (e["rank"], e["generation"]) == (rank, rec["generation"])
            ]
            assert spares, f"{fault}: a dead or hung rank must be replaced by a spare"
            assert "Lightning's loop catches up" in res.output
        if "optimizer" in fault:
            plans = [p for p in res.of("plan") if p["generation"] == rec["generation"]]
            assert plans and rank in plans[0]["receivers"], (
                "a rank that faulted mid-update must receive state"
            )
    assert not res.left_behind(), "processes of the job were left behind"


# `make soak`: the default suite's test_lightning_every_replica_e2e kills every rank of a smaller
# job the same way; this one checks Lightning's checkpoint files and an EMA callback on top
@pytest.mark.soak
@pytest.mark.timeout(240)
def test_lightning_job_that_loses_every_rank_restores_its_snapshot_bitwise(
    tmp_path: Path, corpus: Path, reference: JobResult
) -> None:
    # killall: as step 4 begins, each rank waits for the others and for rank 0's snapshot of step
    # 4 to be written, then every process holding a rank SIGKILLs itself: no replica is left, and
    # three spares restore the snapshot, each putting a fresh Lightning loop at step 4
    res = run(tmp_path / "run", corpus, ["killall:step=4"], spares=3, extra=["--snapshot-every", "2"])
    assert res.rc == 0, res.output[-6000:]
    assert sorted(e["rank"] for e in res.of("fault_injected") if e["kind"] == "killall") == [0, 1, 2]
    assert sorted(e["rank"] for e in res.of("spare_assigned")) == [0, 1, 2], "every rank is replaced once"
    plans = [(p["target_step"], p["receivers"]) for p in res.of("plan") if p.get("from_snapshot")]
    assert plans == [(4, [0, 1, 2])], res.of("plan")
    assert res.of("recovery")[-1]["transport"] == "snapshot"
    # weights, EMA, optimizer, scheduler, loop counters and callback state (in the checkpoint
    # files the replacement rank 0 wrote from step 5 on) are the fault-free run's on every rank
    res.assert_same_weights(reference, nproc=3)
    assert res.trained_batches() == reference.trained_batches(), (
        "some rank trained on other samples than the fault-free run"
    )
    assert_same_checkpoints(res, reference)
    # each replacement sought step 4 in Lightning's loop and read no sample before it
    assert_reads_only_trained_batches(res, replaced=3)
    assert not res.left_behind(), "processes of the job were left behind"
