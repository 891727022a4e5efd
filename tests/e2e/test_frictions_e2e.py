"""The frictions a new user met (issue 38), each through real launcher runs:

* a ConfigError ends the job at once, with its traceback printed once and no spare or restart;
* a script that never called checkpointless.init() and exits cleanly is told to use --plain;
* a killed rank's fault event names the step its fault fired at, not a heartbeat's late one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.jobs import ROOT, SCRIPTS

ERROR = "tiny_steps.py: --bad-setting is refused; drop it"


def _run(
    tmp_path: Path, args: list[str], timeout: float = 90
) -> tuple[int, str, list[dict[str, Any]], float]:
    """``checkpointless run ARGS`` to its end: exit code, output, events and seconds taken."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "checkpointless", "run", "--run-dir", str(run_dir), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    took = time.monotonic() - t0
    events_file = run_dir / "events.jsonl"
    lines = events_file.read_text().splitlines() if events_file.exists() else []
    return p.returncode, p.stdout + p.stderr, [json.loads(x) for x in lines if x.strip()], took


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["step", "section"])
def test_a_config_error_ends_the_job_at_once_with_one_traceback(tmp_path: Path, where: str) -> None:
    script = [str(SCRIPTS / "tiny_steps.py"), "--config-error-at", "2", "--rank", "1"]
    script += ["--in-section"] if where == "section" else []
    rc, out, events, _ = _run(tmp_path, ["--nproc", "2", "--spares", "1", *script])
    assert rc != 0, out[-3000:]
    assert out.count(f"ConfigError: {ERROR}") == 1, f"the traceback is printed once:\n{out[-3000:]}"
    assert out.count("Traceback (most recent call last)") == 1, out[-3000:]
    assert "rank 1 stopped the job with a configuration error" in out, out[-3000:]
    # no recovery, no spare given the rank, no restart
    assert not _of(events, "fault") and not _of(events, "recovery") and not _of(events, "spare_assigned")
    end = _of(events, "job_end")
    assert end and end[-1]["status"] == "failed" and ERROR in end[-1]["error"], end
    # at once: no retries, no spare warming up (the time before is the job's start-up)
    assert end[-1]["time"] - _of(events, "started")[0]["time"] < 5, events


@pytest.mark.timeout(120)
def test_a_config_error_under_plain_is_not_restarted(tmp_path: Path) -> None:
    rc, out, events, _ = _run(
        tmp_path, ["--plain", "--nproc", "2", "--max-restarts", "3", str(SCRIPTS / "plain_config_error.py")]
    )
    assert rc != 0, out[-3000:]
    assert not _of(events, "restart") and len(_of(events, "plain_start")) == 1, out[-3000:]
    assert out.count("ConfigError: plain_config_error.py") == 1, out[-3000:]
    assert "rank 1 stopped the job with a configuration error" in out, out[-3000:]


@pytest.mark.timeout(120)
def test_an_unadopted_script_that_exits_cleanly_is_told_to_run_with_plain(tmp_path: Path) -> None:
    rc, out, events, _ = _run(tmp_path, ["--nproc", "2", "--spares", "1", str(SCRIPTS / "unadopted.py")])
    assert rc != 0, out[-3000:]
    assert "without ever calling checkpointless.init()" in out and "--plain" in out, out[-3000:]
    assert "docs/adoption.md" in out and "hot spares" not in out, out[-3000:]
    assert not _of(events, "fault") and not _of(events, "spare_assigned"), "no spare trains the job again"
    end, spawns = _of(events, "job_end"), _of(events, "spawn")
    assert end and end[-1]["time"] - spawns[0]["time"] < 5, "at the first clean exit, not after 76 s"


@pytest.mark.timeout(120)
def test_a_killed_rank_s_fault_event_names_the_step_it_was_killed_at(tmp_path: Path) -> None:
    # steps of ~10 ms: a heartbeat a quarter second old lags 10-20 of them
    rc, out, events, _ = _run(
        tmp_path,
        [
            "--nproc", "2", "--spares", "1", "--inject", "kill:rank=1:step=30",
            str(SCRIPTS / "tiny_steps.py"), "--steps", "40", "--sleep", "0.01",
        ],
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    faults = [(f["rank"], f["kind"], f["step"]) for f in _of(events, "fault")]
    assert (1, "killed", 30) in faults, faults
    # a survivor may see its collective fail before the exit is read: the step in flight too
    assert all(step == 30 for _, _, step in faults), faults
