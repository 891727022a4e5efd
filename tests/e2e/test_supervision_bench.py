"""The supervision-CPU benchmark at its smallest, so that it keeps working as the launcher and the
worker change: it runs a real job, reads every thread of every process it started, and cleans up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.timeout(120), pytest.mark.soak]

BENCH = ROOT / "benchmarks" / "supervision_cpu.py"


def test_every_process_of_the_job_is_measured_and_nothing_is_left(tmp_path: Path) -> None:
    out = tmp_path / "sup.json"
    args = ["--window", "5", "--settle", "1", "--repeats", "1", "--step-s", "0.05", "--out", str(out)]
    r = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stdout + r.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert {"launcher", "rank", "spare", "template"} <= set(run["roles_ms_per_s"]), run
    assert (
        "launcher: main thread" in run["threads_ms_per_s"] and "rank: main thread" in run["threads_ms_per_s"]
    )
    assert all(v >= 0 for v in run["roles_ms_per_s"].values())
    # the job was stopped and its temporary directory removed with it
    left = subprocess.run(["pgrep", "-f", "cl-supervision-"], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes left behind: {left}"
