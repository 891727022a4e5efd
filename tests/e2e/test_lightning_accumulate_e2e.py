"""Lightning's optimizer steps of several batches, or of several updates, under `checkpointless run`,
with real faults inside them, bitwise on every rank.

Four jobs run at once (each is mostly its processes' start-up): a fault-free and a faulted run of
each script, 2 ranks (and 1 spare in the faulted run). Each faulted job takes several faults at
their own steps, each asserted by the recovery that names its rank and step.

tests/scripts/lightning_accumulate.py, ``accumulate_grad_batches=3``: one update (one job step)
is a window of 3 micro-batches (1 at an epoch's end), 8 updates over 3 epochs.

- rank 1 raises in the forward pass of step 1's second micro-batch: both ranks train the window
  again from its first micro-batch (kept closures, generators as the step began);
- rank 0 raises half-way through step 3's update: rank 1 commits, rank 0 receives step 4's
  state and walks past the batch, rank 1 trains step 4's window again;
- rank 0 is SIGKILLed in step 6's second micro-batch (epoch 2): its replacement walks Lightning's
  loop across two epochs' windows and trains from step 6's first micro-batch;
- rank 1 raises in the backward pass of step 7's last micro-batch, its all-reduce in flight.

tests/scripts/lightning_manual.py, manual optimization with two optimizers: each batch (one job
step) updates the head, then the encoder after a second backward and all-reduce.

- rank 1 raises in step 1's first forward (before any update);
- rank 1 raises in step 3's second all-reduce, after both ranks applied the first update: both
  put back the state the step began with, and train it again;
- rank 0 raises half-way through step 5's first update;
- rank 0 is SIGKILLed in step 7's second all-reduce, after the first update: rank 1 puts its
  state back and hands it to the replacement, which walks 7 batches without training them.

The accumulating jobs write ``ModelCheckpoint`` files (rank 0, every 4 updates): the faulted
run's must hold the fault-free run's weights, optimizer state and loop counters. Under
`make soak`, fits resumed from the fault-free runs' checkpoints (``ckpt_path=``), the
accumulating one's of step 4 and the manual one's after 4 batches, run fault-free and through
faults, a SIGKILL in each.

Every rank must end with the fault-free run's weights, optimizer state, learning rates (and
EMA callback state, count of batch-end hooks, ``global_step``), and ``on_epoch`` sum; every
(micro-)batch trained must be the fault-free run's.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.helpers.jobs import ROOT, JobResult, RunningJob, fault_at, start_job

pytest.importorskip("lightning", reason="the `lightning` extra is not installed")

ACCUMULATE = ROOT / "tests" / "scripts" / "lightning_accumulate.py"
MANUAL = ROOT / "tests" / "scripts" / "lightning_manual.py"
# (micro-batch, spec): injected by the script as that micro-batch of the spec's step begins
MID_WINDOW = [
    ("1", "raise:rank=1:step=1:site=forward"),
    ("1", "kill:rank=0:step=6:site=forward"),
    ("2", "raise:rank=1:step=7:site=backward"),
]
AT_UPDATE = ["raise:rank=0:step=3:site=optimizer"]  # the launcher's --inject
# injected by the script once the step's first update is applied: fires in the second all-reduce
BETWEEN_UPDATES = ["raise:rank=1:step=3:site=allreduce", "kill:rank=0:step=7:site=allreduce"]
MANUAL_FAULTS = ["raise:rank=1:step=1:site=forward", "raise:rank=0:step=5:site=optimizer"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, JobResult]:
    root = tmp_path_factory.mktemp("lightning-steps")
    mid = [a for micro, spec in MID_WINDOW for a in ("--fault-at", micro, spec)]
    between = [a for spec in BETWEEN_UPDATES for a in ("--after-first-update", spec)]
    plan = {  # name: (script, spares, launcher faults, script arguments)
        "acc-ref": (ACCUMULATE, 0, [], ["--ckpt-dir", str(root / "acc-ref" / "ckpt")]),
        "acc": (ACCUMULATE, 1, AT_UPDATE, [*mid, "--ckpt-dir", str(root / "acc" / "ckpt")]),
        "manual-ref": (MANUAL, 0, [], ["--ckpt-dir", str(root / "manual-ref" / "ckpt")]),
        "manual": (MANUAL, 1, MANUAL_FAULTS, [*between, "--ckpt-dir", str(root / "manual" / "ckpt")]),
    }
    jobs: dict[str, RunningJob] = {}
    for name, (script, spares, faults, args) in plan.items():
        (root / name).mkdir()
        # the scripts make their own data: no corpus
        jobs[name] = start_job(
            root / name / "run", root, 2, spares, faults, script_args=args, script=script, hang_timeout=10
        )
    out: dict[str, JobResult] = {}
    errors: list[str] = []
    for name, job in jobs.items():  # every job waited for (or killed), whichever fails
        try:
            out[name] = job.finish(220)
        except AssertionError as e:
            errors.append(f"{name}: {e}")
    assert not errors, "\n".join(errors)
    for name, res in out.items():
        assert not res.left_behind(), f"{name}: processes of the job were left behind"
    return out


def trained(res: JobResult, kind: str) -> dict[tuple[int, ...], str]:
    """(rank, step, batch) -> digest of each (micro-)batch trained; a replay must train the same."""
    pattern = {
        "micro": r"micro rank=(\d+) step=(\d+) batch=(\d+)",
        "manual": r"manual rank=(\d+) step=(\d+) gs=(\d+)",
    }
    out: dict[tuple[int, ...], str] = {}
    for *key_s, digest in re.findall(pattern[kind] + r" ([0-9a-f]{16})", res.output):
        key = tuple(int(k) for k in key_s)
        assert out.get(key, digest) == digest, f"{key} trained on two different batches"
        out[key] = digest
    return out


def epoch_metrics(res: JobResult) -> dict[int, str]:
    return {int(r): v for r, v in re.findall(r"epoch metric rank=(\d+) (x_sum=\S+ \S+)", res.output)}


def plans(res: JobResult, spec: str) -> list[dict[str, Any]]:
    """The plans of the recovery from ``spec``'s fault, first first: those made since the recovery
    before it (a fault during a recovery makes a newer plan in the same one)."""
    rec = res.recovery_from(*fault_at(spec))
    assert rec is not None, spec
    gen = rec["generation"]
    before = max([r["generation"] for r in res.of("recovery") if r["generation"] < gen], default=0)
    found = [p for p in res.of("plan") if before < p["generation"] <= gen]
    assert found, (spec, rec)
    return sorted(found, key=lambda p: int(p["generation"]))


def assert_recovered_each(res: JobResult, specs: list[str], catch_up: str = "by seeking to epoch") -> None:
    """Each fault fired and was recovered; a killed rank's replacement caught up ``catch_up``."""
    timed_out = [f["detail"] for f in res.of("fault") if "Timed out" in f.get("detail", "")]
    assert not timed_out, timed_out
    for spec in specs:
        rank, step = fault_at(spec)
        rec = res.recovery_from(rank, step)
        assert res.fired(spec) and rec is not None, (spec, res.output[-4000:])
        if spec.startswith("kill"):
            assert [
                e
                for e in res.of("spare_assigned")
                if (e["rank"], e["generation"]) == (rank, rec["generation"])
            ]
            assert "Lightning's loop catches up" in res.output
            assert catch_up in res.output, res.output[-4000:]


@pytest.mark.timeout(300)
def test_accumulation_windows_survive_faults_in_and_at_their_end_bitwise(runs: dict[str, JobResult]) -> None:
    ref, res = runs["acc-ref"], runs["acc"]
    assert ref.rc == 0, ref.output[-4000:]
    want = trained(ref, "micro")
    assert len(want) == 2 * 20, "8 updates of 3, 3, 1, 3, 3, 1, 3, 3 micro-batches on each rank"
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=2)
    assert trained(res, "micro") == want, "some rank trained on other samples than the fault-free run"
    assert epoch_metrics(res) == epoch_metrics(ref) and len(epoch_metrics(ref)) == 2, (
        "an on_epoch sum or the EMA callback's hook count differs (a replayed micro-batch counted twice?)"
    )
    assert_recovered_each(res, [s for _, s in MID_WINDOW] + AT_UPDATE)
    received = {r for p in plans(res, AT_UPDATE[0]) for r in p["receivers"]}
    assert 0 in received, "a rank that faulted mid-update must receive state"
    # a fault in a window's second micro-batch trains the window again from its first: that
    # first micro-batch is printed twice (attempt and replay) by the faulted rank or its replacement
    assert res.output.count("micro rank=1 step=1 batch=3 ") == 2, (
        "step 1's window was not replayed from its start"
    )
    assert res.output.count("micro rank=0 step=6 batch=0 ") == 2, (
        "step 6's window was not trained from its start"
    )
    # rank 0 writes the ModelCheckpoint files; killed after step 4's, its replacement walks past
    # it without overwriting it, and writes step 8's and last.ckpt itself
    assert_same_checkpoints(res, ref)


def assert_same_checkpoints(res: JobResult, ref: JobResult) -> None:
    import torch

    got_dir, want_dir = res.run_dir.parent / "ckpt", ref.run_dir.parent / "ckpt"
    names = sorted(p.name for p in want_dir.glob("*.ckpt"))
    assert names == ["epoch=1-step=4.ckpt", "epoch=2-step=8.ckpt", "last.ckpt"], names
    assert sorted(p.name for p in got_dir.glob("*.ckpt")) == names
    for name in names:
        got = torch.load(got_dir / name, weights_only=False)
        want = torch.load(want_dir / name, weights_only=False)
        for key in ("global_step", "epoch", "loops", "lr_schedulers"):
            assert got[key] == want[key], f"{name}: {key} differs"
        for k, t in want["state_dict"].items():
            assert torch.equal(got["state_dict"][k], t), f"{name}: weight {k} differs"
        for a, b in zip(got["optimizer_states"], want["optimizer_states"], strict=True):
            for pa, pb in zip(a["state"].values(), b["state"].values(), strict=True):
                assert all(torch.equal(pa[k], pb[k]) for k in pb), f"{name}: optimizer state differs"


# a fit resumed from the fault-free run's checkpoint of step 4 (ckpt_path=), fault-free and with
# a raise at step 5, rank 0 SIGKILLed at step 6 (its replacement restores the checkpoint too and
# seeks from step 4) and a raise in step 7's second micro-batch; `make soak` only
RESUMED = ["raise:rank=1:step=5:site=forward", "kill:rank=0:step=6"]
RESUMED_MID = ("1", "raise:rank=0:step=7:site=forward")
# manual optimization, resumed from the fault-free run's checkpoint after 4 batches (8 updates)
RESUMED_MANUAL = ["kill:rank=1:step=6"]
RESUMED_BETWEEN = "raise:rank=0:step=8:site=allreduce"


@pytest.fixture(scope="module")
def resumed(runs: dict[str, JobResult], tmp_path_factory: pytest.TempPathFactory) -> dict[str, JobResult]:
    ckpt = runs["acc-ref"].run_dir.parent / "ckpt" / "epoch=1-step=4.ckpt"
    assert ckpt.exists(), ckpt
    root = tmp_path_factory.mktemp("lightning-resumed")
    resume = ["--resume", str(ckpt)]
    found = sorted((runs["manual-ref"].run_dir.parent / "ckpt").glob("*-step=8.ckpt"))
    assert len(found) == 1, found
    manual_ckpt = found[0]
    manual = ["--resume", str(manual_ckpt)]
    plan = {
        "ref": (ACCUMULATE, 0, [], resume),
        "faults": (ACCUMULATE, 1, RESUMED, [*resume, "--fault-at", *RESUMED_MID]),
        "manual-ref": (MANUAL, 0, [], manual),
        "manual": (MANUAL, 1, RESUMED_MANUAL, [*manual, "--after-first-update", RESUMED_BETWEEN]),
    }
    jobs: dict[str, RunningJob] = {}
    for name, (script, spares, faults, args) in plan.items():
        (root / name).mkdir()
        jobs[name] = start_job(
            root / name / "run", root, 2, spares, faults, script_args=args, script=script, hang_timeout=10
        )
    out = {name: job.finish(220) for name, job in jobs.items()}
    for name, res in out.items():
        assert not res.left_behind(), f"{name}: processes of the job were left behind"
    return out


@pytest.mark.soak
@pytest.mark.timeout(400)
def test_fit_resumed_from_a_checkpoint_survives_faults_bitwise(resumed: dict[str, JobResult]) -> None:
    ref, res = resumed["ref"], resumed["faults"]
    assert ref.rc == 0, ref.output[-4000:]
    want = trained(ref, "micro")
    assert min(step for _, step, _ in want) == 4, "the resumed fit starts at the checkpoint's step"
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=2)
    assert trained(res, "micro") == want, "some rank trained on other samples than the fault-free run"
    assert epoch_metrics(res) == epoch_metrics(ref)
    assert_recovered_each(
        res,
        [*RESUMED, RESUMED_MID[1]],
        catch_up="catches up from 4 by seeking to epoch 2, batch 0",  # from the checkpoint's step
    )


@pytest.mark.timeout(300)
def test_manual_optimization_with_two_optimizers_survives_faults_between_updates_bitwise(
    runs: dict[str, JobResult],
) -> None:
    ref, res = runs["manual-ref"], runs["manual"]
    assert ref.rc == 0, ref.output[-4000:]
    want = trained(ref, "manual")
    assert len(want) == 2 * 10, "10 batches of 2 updates on each rank"
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=2)
    assert trained(res, "manual") == want, "some rank trained on other samples, or counted other steps"
    assert epoch_metrics(res) == epoch_metrics(ref) and len(epoch_metrics(ref)) == 2, (
        "an on_epoch sum or global_step differs from the fault-free run's"
    )
    assert_recovered_each(res, MANUAL_FAULTS + BETWEEN_UPDATES)
    # between the updates every rank had applied the first: each puts back the state the step
    # began with, so the job resumes at that step (claiming the step's end, it would resume at
    # the next one with half its updates)
    for spec in BETWEEN_UPDATES:
        first = plans(res, spec)[0]
        assert first["target_step"] == fault_at(spec)[1], (spec, first)


@pytest.mark.soak
@pytest.mark.timeout(400)
def test_manual_fit_resumed_from_a_checkpoint_survives_faults_bitwise(resumed: dict[str, JobResult]) -> None:
    ref, res = resumed["manual-ref"], resumed["manual"]
    assert ref.rc == 0, ref.output[-4000:]
    want = trained(ref, "manual")
    assert min(step for _, step, _ in want) == 4, "the resumed fit starts at the checkpoint's batch"
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=2)
    assert trained(res, "manual") == want, "some rank trained on other samples, or counted other steps"
    assert epoch_metrics(res) == epoch_metrics(ref)
    assert_recovered_each(
        res,
        [*RESUMED_MANUAL, RESUMED_BETWEEN],
        catch_up="catches up from 4 by seeking to epoch 1, batch 2",  # from the checkpoint's batch
    )
