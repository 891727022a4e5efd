"""`checkpointless audit` end to end: real jobs, real faults, every rank's per-step fingerprints.

An adopted script passes; a planted time-seeded shuffle is found in the fault-free runs and
named; state the job cannot see (a script-owned generator) is found in the faulted run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

SCRIPTS = ROOT / "tests" / "scripts"


def audit(run_dir: Path, *args: str, timeout: float = 240) -> tuple[int, str, dict[str, object]]:
    cmd = [sys.executable, "-m", "checkpointless", "audit", "--run-dir", str(run_dir), *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    report = run_dir / "audit.json"
    doc = json.loads(report.read_text()) if report.is_file() else {}
    return p.returncode, p.stdout + p.stderr, doc


@pytest.mark.timeout(240)
def test_an_adopted_script_passes_through_a_kill(tmp_path: Path) -> None:
    # seed 1 draws kill:rank=0:step=4: a spare takes rank 0's place mid-run
    script = [str(SCRIPTS / "adopt.py"), "--workers", "0", "--digest-out", str(tmp_path / "d-{rank}")]
    rc, out, doc = audit(tmp_path / "a", "--steps", "6", "--fault-runs", "1", "--seed", "1", *script)
    assert rc == 0, out
    assert "audit: OK" in out
    assert doc["ok"] is True and doc["runs"] == ["fault-free-1", "fault-free-2", "fault-1"]
    # every rank wrote a fingerprint per step, and the kill's replacement wrote its own file
    free = (tmp_path / "a" / "fault-free-1" / "fingerprints").glob("*.jsonl")
    assert sum(len(f.read_text().splitlines()) for f in free) == 2 * 6
    assert len(list((tmp_path / "a" / "fault-1" / "fingerprints").glob("*.jsonl"))) == 3


@pytest.mark.timeout(240)
def test_a_time_seeded_shuffle_is_found_without_faults_and_named(tmp_path: Path) -> None:
    rc, out, doc = audit(tmp_path / "t", "--steps", "4", "--fault-runs", "1", str(SCRIPTS / "time_seeded.py"))
    assert rc == 1, out
    assert "not deterministic without faults" in out and "step 0, rank 0" in out, out
    assert doc["deterministic"] is False
    (finding,) = doc["findings"]  # type: ignore[misc]
    # the model's inputs (the batch) already differ: the cause is the data order
    assert finding["difference"] == {"step": 0, "rank": 0, "what": "inputs"}
    assert "seeded from the time" in finding["cause"] and "batch" in finding["cause"]
    assert doc["runs"] == ["fault-free-1", "fault-free-2"], (
        "no faulted run is judged against a flaky reference"
    )


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_state_the_job_cannot_see_is_found_in_the_faulted_run(tmp_path: Path) -> None:
    rc, out, doc = audit(
        tmp_path / "u", "--steps", "6", "--fault-runs", "1", "--seed", "1", str(SCRIPTS / "untracked_rng.py")
    )
    assert rc == 1, out
    assert doc["deterministic"] is True
    (finding,) = doc["findings"]  # type: ignore[misc]
    assert finding["fault"] == "kill:rank=0:step=4"
    # the noise is added to the batch: the inputs of the fault's step differ first
    assert finding["difference"]["step"] == 4 and finding["difference"]["what"] == "inputs"
    assert "generator of the script's own" in finding["cause"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flag", "value"), [("--steps", "2"), ("--nproc", "1"), ("--fault-runs", "-1")])
def test_bad_input_exits_2_naming_the_value(tmp_path: Path, flag: str, value: str) -> None:
    rc, out, _ = audit(tmp_path / "b", flag, value, str(SCRIPTS / "time_seeded.py"))
    assert rc == 2, out
    assert flag in out and value in out


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_the_gpt_example_passes_through_a_kill(tmp_path: Path, corpus: Path) -> None:
    tiny = ["--steps", "10", "--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16"]
    script = [str(ROOT / "examples" / "train_gpt.py"), *tiny, "--global-batch", "12", "--data", str(corpus)]
    rc, out, doc = audit(tmp_path / "g", "--steps", "6", "--fault-runs", "1", "--seed", "1", *script)
    assert rc == 0, out
    assert doc["ok"] is True
    # the example's batches are seen: each line carries the inputs' digest
    lines = (tmp_path / "g" / "fault-1" / "fingerprints").glob("*.jsonl")
    assert all(json.loads(x)["inputs"] for f in lines for x in f.read_text().splitlines())
