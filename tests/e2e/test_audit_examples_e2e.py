"""`checkpointless audit` on every example and on the adopted public scripts (issue 38).

Each case runs the audit's command line (fault-free twice, then one random fault) on one script
with the small settings its own e2e test uses, and expects it to pass: every rank's per-step
fingerprints equal in all three runs. Soak only: each case is three short jobs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.corpus import write_words
from tests.helpers.paths import ROOT

EXAMPLES = ROOT / "examples"
SCRIPTS = ROOT / "tests" / "scripts"

pytestmark = pytest.mark.soak


def audit(run_dir: Path, script: Path, args: list[str], *opts: str) -> tuple[int, str, dict[str, object]]:
    """The audit's exit code, output and audit.json; seed 1 (a kill of rank 0) and one faulted run
    unless ``opts`` say (a later option wins); seed 0 draws an exception on the last rank at step 2."""
    cmd = [sys.executable, "-m", "checkpointless", "audit", "--run-dir", str(run_dir)]
    cmd += ["--fault-runs", "1", "--seed", "1", "--timeout", "150", *opts, str(script), *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=560)
    report = run_dir / "audit.json"
    doc = json.loads(report.read_text()) if report.is_file() else {}
    return p.returncode, p.stdout + p.stderr, doc


def assert_passed(rc: int, out: str, doc: dict[str, object], run_dir: Path) -> None:
    # on failure, the runs' own output says why (a script crash, a timeout)
    tails = "".join(f"\n--- {f}\n{f.read_text()[-2500:]}" for f in sorted(run_dir.glob("*/output.txt")))
    assert rc == 0, out + tails
    assert doc["ok"] is True, out
    assert doc["runs"] == ["fault-free-1", "fault-free-2", "fault-1"], out
    # every run wrote fingerprints: the hook saw the framework's steps
    for run in doc["runs"]:  # type: ignore[attr-defined]
        assert list((run_dir / run / "fingerprints").glob("*.jsonl")), f"{run}: no fingerprints\n{out}"


def inputs_seen(run_dir: Path) -> bool:
    """Whether every fingerprint line of the faulted run carries the batch's digest."""
    files = (run_dir / "fault-1" / "fingerprints").glob("*.jsonl")
    return all(json.loads(x)["inputs"] for f in files for x in f.read_text().splitlines())


@pytest.mark.timeout(600)
def test_lightning_example(tmp_path: Path, corpus: Path) -> None:
    tiny = ["--steps", "10", "--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16"]
    args = [*tiny, "--global-batch", "12", "--data", str(corpus)]
    rc, out, doc = audit(tmp_path / "a", EXAMPLES / "lightning_gpt.py", args, "--steps", "6")
    assert_passed(rc, out, doc, tmp_path / "a")
    assert inputs_seen(tmp_path / "a")


@pytest.mark.timeout(600)
def test_hf_trainer_example(tmp_path: Path) -> None:
    args = ["--steps", "10", "--accumulation", "2", "--output-dir", "{run}/out"]
    rc, out, doc = audit(tmp_path / "a", EXAMPLES / "hf_trainer.py", args, "--steps", "6", "--seed", "0")
    assert_passed(rc, out, doc, tmp_path / "a")
    # Hugging Face calls model(**batch): the forward pre-hook takes keyword arguments too
    assert inputs_seen(tmp_path / "a")


# 80 samples an epoch, 2 ranks, batches of 4, accumulation 2: 5 updates an epoch, 10 in all
ACCELERATE_ARGS = ["--epochs", "2", "--accumulation", "2"]


@pytest.mark.timeout(600)
def test_hf_accelerate_example_ended_at_an_epoch_end(tmp_path: Path) -> None:
    rc, out, doc = audit(tmp_path / "a", EXAMPLES / "hf_accelerate.py", ACCELERATE_ARGS, "--steps", "5")
    assert_passed(rc, out, doc, tmp_path / "a")
    # Hugging Face calls model(**batch): the forward pre-hook takes keyword arguments too
    assert inputs_seen(tmp_path / "a")


@pytest.mark.timeout(600)
@pytest.mark.xfail(
    strict=True,
    reason=(
        "audit limitation: the early end at K=6 stops the training loader one update into epoch 2, "
        "and the example's protected evaluate() (CheckpointlessAccelerator.protect) then raises "
        "ConfigError 'called after 6 optimizer steps, which is not the end of an epoch (5 steps "
        "each)' in both fault-free runs; K at an epoch end (5, 10) passes"
    ),
)
def test_hf_accelerate_example_ended_mid_epoch(tmp_path: Path) -> None:
    rc, out, doc = audit(tmp_path / "a", EXAMPLES / "hf_accelerate.py", ACCELERATE_ARGS, "--steps", "6")
    assert_passed(rc, out, doc, tmp_path / "a")


@pytest.mark.timeout(600)
def test_adopted_torchrun_tutorial(tmp_path: Path) -> None:
    args = ["4", "1", "--snapshot_path", "{run}/snapshot.pt"]
    script = EXAMPLES / "adopted" / "multigpu_torchrun_adopted.py"
    rc, out, doc = audit(tmp_path / "a", script, args, "--steps", "6", "--seed", "0")
    assert_passed(rc, out, doc, tmp_path / "a")
    assert inputs_seen(tmp_path / "a")


@pytest.mark.timeout(600)
def test_adopted_mingpt(tmp_path: Path) -> None:
    text = write_words(tmp_path / "input.txt")
    args = [f"data_config.path={text}", "trainer_config.snapshot_path={run}/snapshot.pt"]
    script = EXAMPLES / "adopted" / "mingpt_adopted" / "main.py"
    rc, out, doc = audit(tmp_path / "a", script, args, "--steps", "6")
    assert_passed(rc, out, doc, tmp_path / "a")
    assert inputs_seen(tmp_path / "a")


@pytest.mark.timeout(600)
def test_nanogpt_with_global_rng(tmp_path: Path) -> None:
    args = ["--steps", "24", "--eval-every", "4", "--digest-out", "{run}/d-{rank}"]
    rc, out, doc = audit(
        tmp_path / "a", SCRIPTS / "nanogpt_global_rng.py", args, "--steps", "8", "--seed", "0"
    )
    assert_passed(rc, out, doc, tmp_path / "a")
    assert inputs_seen(tmp_path / "a")


@pytest.mark.timeout(600)
def test_tensor_parallel_mlp_on_4_ranks(tmp_path: Path) -> None:
    args = ["--steps", "8", "--digest-out", "{run}/d-{rank}"]
    rc, out, doc = audit(
        tmp_path / "a", SCRIPTS / "tp_mlp.py", args, "--steps", "6", "--nproc", "4", "--seed", "0"
    )
    assert_passed(rc, out, doc, tmp_path / "a")
    assert inputs_seen(tmp_path / "a")
