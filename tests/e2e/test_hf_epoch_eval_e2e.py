"""Trainer evaluating and saving at each epoch's end and loading the best checkpoint at the end,
through faults in an evaluation and in a checkpoint's save, bitwise on every rank.

Each run is tests/scripts/hf_epoch_eval.py (a 2-layer GPT-2, ``CheckpointlessTrainer``, 3 epochs
of 4 optimizer steps, gradient accumulation 2, ``eval_strategy="epoch"``, ``save_strategy="epoch"``,
``load_best_model_at_end=True`` with ``metric_for_best_model="eval_loss"``; the best checkpoint
is the first epoch's, so loading it at the end changes the weights) on 2 ranks and 1 spare. It
must end with every rank's weights (the best checkpoint's, loaded at the end), optimizer state,
log history, evaluation metrics and best metric, step and checkpoint equal to the fault-free
run's, with each evaluation printed once, and with Trainer's checkpoint files equal to the
fault-free run's: a checkpoint whose save a fault cut short is written again whole before the
end of training loads it. Rank 0 lost after a section closed and before it printed the
evaluation's line has its replacement print it. A callback's ``on_log`` raising as the evaluation's line is shown, once
the section has closed on every rank, is recovered in its process and the line shown once. Rank 0's
closing barrier failing as it completes, its peer past it, is recovered with the section done on
both ranks (the recovery's plan says so): rank 0 shows its line once and redoes nothing. Rank 0
SIGKILLed past the last closing barrier before it marked its pass, rank 1's failed: nobody can say
whether it passed, so the evaluation is redone on both ranks and the launcher reports that redo
as an ``inexact`` resume naming the section. Each section completes once on each rank.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.jobs import ROOT, JobResult, fault_at, start_job

pytest.importorskip("transformers", reason="the `hf` extra is not installed")

SCRIPT = ROOT / "tests" / "scripts" / "hf_epoch_eval.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
STEPS = 12  # 3 epochs of 4 optimizer steps
TIMING = ("runtime", "per_second", "_time")


def run(run_dir: Path, faults: str, spares: int = 1, inject: tuple[str, ...] = ()) -> JobResult:
    env = {
        **OFFLINE,
        "HF_FAULTS": faults,
        "HF_FAULT_MARKS": str(run_dir.parent / "fired-{n}"),
        "HF_EPOCH_OUT": str(run_dir.parent / "summary-{rank}.json"),
    }
    args = ["--record-batches", "--output-dir", str(run_dir.parent / "out")]
    job = start_job(
        run_dir, run_dir.parent / "unused", 2, spares, list(inject), script_args=args, script=SCRIPT,
        hang_timeout=6, env=env,
    )  # fmt: skip
    return job.finish(150)


def summaries(res: JobResult) -> dict[int, dict[str, Any]]:
    """rank -> its evaluation entries (timings left out) and best metric, step and checkpoint."""
    return {r: json.loads((res.run_dir.parent / f"summary-{r}.json").read_text()) for r in range(2)}


def sections(res: JobResult) -> Counter[tuple[int, str, int]]:
    """(rank, section, boundary) -> how many times it completed, from the ranks' event logs."""
    events = [e for r in range(2) for e in res.events(f"rank-{r}.jsonl") if e["event"] == "section"]
    return Counter((e["rank"], e["name"], e["step"]) for e in events)


def checkpoints(res: JobResult) -> dict[str, Any]:
    """Relative path -> SHA-256 of every file Trainer wrote under its output_dir; each
    trainer_state.json as its content, without run times and with the best checkpoint's
    folder name for its path (the runs have their own output_dir). training_args.bin pickles
    the run's own output_dir and is left out."""
    out_dir = res.run_dir.parent / "out"
    files: dict[str, Any] = {}
    for p in sorted(out_dir.rglob("*")):
        if not p.is_file() or p.name == "training_args.bin":
            continue
        key = str(p.relative_to(out_dir))
        if p.name == "trainer_state.json":
            state = json.loads(p.read_text())
            best = state.get("best_model_checkpoint")
            state["best_model_checkpoint"] = None if best is None else Path(best).name
            state["log_history"] = [
                {k: v for k, v in e.items() if not any(t in k for t in TIMING)} for e in state["log_history"]
            ]
            files[key] = state
        else:
            files[key] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    res = run(tmp_path_factory.mktemp("hf-epoch-ref") / "run", "", spares=0)
    assert res.rc == 0, res.output[-4000:]
    assert sorted(res.digests) == [0, 1] and res.digest, res.digests
    summary = summaries(res)
    assert summary[0] == summary[1], summary
    assert [e["step"] for e in summary[0]["evals"]] == [4, 8, 12], summary
    assert summary[0]["best_model_checkpoint"] == "checkpoint-4" and summary[0]["best_global_step"] == 4
    files = checkpoints(res)
    assert {f.split("/")[0] for f in files} == {"checkpoint-4", "checkpoint-8", "checkpoint-12"}, files
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        assert f"checkpoint-4/{name}" in files, name
    assert len(res.batches()) == 2 * STEPS
    return res


# a rank lost between its pass of the closing barrier and its mark, its peer's barrier failed
DOUBT = ("kill:rank=0:step=12:site=unsettled", "raise:rank=1:step=12:site=unsettled")


@pytest.mark.timeout(240)  # 7 faults in one job: the DOUBT pair added a round with a spare
@pytest.mark.parametrize(
    ("faults", "inject"),
    [
        # rank 0 raises in checkpoint-4's save, its weights written and the rest not yet (the
        # evaluation before it logged already); rank 1 is SIGKILLed in the middle of the
        # second epoch's evaluation and a spare takes its place there
        # ... and rank 0's last callback raises in its on_log of the last evaluation's line, the
        # section closed on every rank and the line printed: recovered in process (no spare),
        # not redone, the line not printed again
        # ... and rank 0 (the one that prints) is SIGKILLed just after the closing barrier of
        # the first evaluation's redone section, before it showed the evaluation's line: its
        # replacement shows that line, once (recovery/held_lines.py)
        # ... and rank 0's closing barrier of the second evaluation's redone section fails as it
        # completes (site=unsettled), rank 1's replacement past it and into step 9: the plan
        # says the section is done (rank 1 passed it), so rank 0 does not redo it; it shows its
        # held evaluation line, once, and resumes its generators as the section left them
        # ... and at the last evaluation both ranks' closing barriers complete, rank 1 fails its
        # own (site=unsettled) and rank 0 (the printer) is SIGKILLed before it marks its pass: its
        # replacement finds only the mark it left as it entered, nobody can say whether it passed,
        # so every rank redoes the evaluation (its line printed once: rank 0 was lost before it
        # showed it) and the launcher says so (DOUBT: an ``inexact`` naming the section)
        pytest.param(
            "raise:save:0:4,kill:eval:1:8,raise:log:0:12",
            ("kill:rank=0:step=4:site=closed", "raise:rank=0:step=8:site=unsettled", *DOUBT),
            id="raise-in-save-sigkill-in-eval-raise-in-on-log",
        ),
        # rank 0, which writes the checkpoints, is SIGKILLed in the last checkpoint's save: its
        # replacement writes it again before the end of training loads the best one; rank 1
        # raises in the middle of the first evaluation
        pytest.param(
            "raise:eval:1:4,kill:save:0:12",
            (),
            id="raise-in-eval-then-sigkill-in-save",
            marks=pytest.mark.soak,
        ),
    ],
)
def test_epoch_evaluation_and_the_best_checkpoint_survive_faults_bitwise(
    tmp_path: Path, reference: JobResult, faults: str, inject: tuple[str, ...]
) -> None:
    res = run(tmp_path / "run", faults, inject=inject)
    assert res.rc == 0, res.output[-6000:]
    for n, fault in enumerate(faults.split(",")):
        kind, where, _, _ = fault.split(":")
        assert (tmp_path / f"fired-{n}").exists(), f"{fault} did not fire"
        assert f"fault in {where}: {kind}" in res.output
    assert len(res.of("recovery")) >= len(faults.split(",")) and res.of("spare_assigned"), res.output[-4000:]
    for fault in inject:
        assert res.fired(fault), (fault, res.output[-4000:])
        if ":site=closed" in fault:
            assert "showing the lines rank 0 held in section" in res.output  # by its replacement
        if ":site=unsettled" in fault and fault not in DOUBT:  # every rank took it as done
            assert "a peer passed its closing barrier, which failed here" in res.output
            _, at = fault_at(fault)  # the plan of the round that fault opened names the section
            plans = [p for p in res.of("plan") if p["target_step"] == at]
            assert any(p.get("sections_closed") == ["trainer_boundary"] for p in plans), plans
    # every raise recovered in its own process (an exception, not an exit a spare replaces),
    # and no rank resumed without its own generators
    raised = [f for r in res.of("recovery") for f in r["faults"] if f["kind"] == "exception"]
    assert len(raised) == faults.count("raise:") + sum(f.startswith("raise:") for f in inject), raised
    # no rank resumed without its own generators; a redo a lost rank may have passed is said
    doubts = [(e["what"], e.get("section"), e["step"], e.get("ranks")) for e in res.of("inexact")]
    assert doubts == ([("section", "trainer_boundary", 12, [0])] if DOUBT[0] in inject else []), doubts
    res.assert_same_weights(reference, nproc=2)  # the best checkpoint's weights, optimizer, log history
    assert summaries(res) == summaries(reference), "evaluation metrics or the best checkpoint differ"
    assert checkpoints(res) == checkpoints(reference), "Trainer's checkpoints differ"
    assert res.batches() == reference.batches(), "some rank trained on other micro-batches"
    assert sections(res) == sections(reference), "a section completed twice, or not at all, on a rank"
    # each evaluation's line printed once, as without the faults; the interrupted ones started over
    assert res.output.count("'eval_loss'") == reference.output.count("'eval_loss'") == 3
    assert res.output.count("{'loss'") == reference.output.count("{'loss'") == STEPS
    assert "the evaluation and checkpoint at global step" in res.output
    assert not res.left_behind(), "processes of the job were left behind"
