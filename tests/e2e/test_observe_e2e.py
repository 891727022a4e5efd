"""Operator visibility against real jobs: /metrics scraped while a faulted job runs matches its
events; status reads a running job, a finished one and one whose launcher was SIGKILLed; the
report's totals add up to the wall time and the timeline PNG is written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from checkpointless.observe.report import main as report_main
from checkpointless.observe.runfiles import read_jsonl
from checkpointless.observe.status import main as status_main
from tests.helpers.jobs import ROOT, TINY, alive
from tests.helpers.wait import deadline_in, wait_for

LONG = [*TINY[:1], "400", *TINY[2:]]  # the tiny model, but enough steps to scrape after a recovery


def _start(run_dir: Path, data: Path, extra: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "checkpointless", "run", "--nproc", "2", "--spares", "1"]
    cmd += ["--run-dir", str(run_dir), "--hang-timeout", "8", *extra]
    cmd += [str(ROOT / "examples" / "train_gpt.py"), *LONG, "--data", str(data)]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "events.jsonl")  # every kind: load_run keeps only what status reads


def _output_if_ended(proc: subprocess.Popen[str]) -> str:
    """The job's output once it has ended: read earlier, it would block until the job ends."""
    return proc.stdout.read() if proc.poll() is not None and proc.stdout else ""


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def _status_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert status_main([str(run_dir), "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


@pytest.mark.timeout(240)
def test_metrics_status_and_report_of_a_faulted_job(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    proc = _start(
        run_dir, corpus, ["--metrics-port", "0", "--progress", "1", "--inject", "kill:rank=1:step=5"]
    )
    try:
        port = wait_for(
            lambda: next((e["port"] for e in _events(run_dir) if e["event"] == "metrics_listening"), None),
            deadline_in(60),
            "metrics_listening",
            interval=0.1,
            proc=proc,
            details=lambda: _output_if_ended(proc),
        )
        wait_for(
            lambda: any(e["event"] == "recovery" for e in _events(run_dir)),
            deadline_in(150),
            "a recovery",
            interval=0.1,
            proc=proc,
            details=lambda: _output_if_ended(proc),
        )
        time.sleep(1.0)  # a few more commits for the step-time histogram and the tailer
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        live = _status_json(run_dir, capsys)
        ev = _events(run_dir)
        assert proc.poll() is None, "the job should still be running while it is scraped"
    finally:
        out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-6000:]

    # metrics: the counters moved, and by exactly what the events say
    faults = [e for e in ev if e["event"] == "fault"]
    rec = next(e for e in ev if e["event"] == "recovery")
    for kind in {f["kind"] for f in faults}:
        want = sum(1 for f in faults if f["kind"] == kind)
        assert _metric(text, "checkpointless_faults_total", f'{{kind="{kind}"}}') == want
    assert _metric(text, "checkpointless_recoveries_total") == 1
    assert _metric(text, "checkpointless_recovery_downtime_seconds_count") == 1
    assert _metric(text, "checkpointless_recovery_downtime_seconds_sum") == pytest.approx(rec["downtime_s"])
    for phase in ("collect", "rebuild", "transfer", "first_step"):
        got = _metric(text, "checkpointless_recovery_phase_seconds_sum", f'{{phase="{phase}"}}')
        assert got == pytest.approx(rec[f"{phase}_s"])
    plan = next(e for e in ev if e["event"] == "plan" and e["generation"] == rec["generation"])
    sent = _metric(text, "checkpointless_state_transferred_bytes_total")
    assert sent == pytest.approx(rec["state_bytes"] * len(plan["receivers"])) and sent > 0
    # where the receiver's transfer went: its parts, each timed, within the whole
    parts = rec["transfer_parts"]
    assert parts["role"] == "receiver" and parts["rank"] in plan["receivers"], parts
    split = [parts[k] for k in ("state_collect_s", "recv_s", "verify_s", "state_restore_s")]
    assert all(v >= 0 for v in split) and sum(split) <= rec["transfer_s"] + 1e-3, (parts, rec)
    # the spare read the new peer table from the host's copy (agent/tables.py), as every rank did
    # at start-up: one copy per round to the host, none whole to a member, none asked for
    plans = [e for e in ev if e["event"] == "plan"]
    assert [p["peer_tables"] for p in plans] == [{"hosts": 1, "members": 0}] * 2, plans
    assert not [e for e in ev if e["event"] == "peer_table_request"]
    assert _metric(text, "checkpointless_generation") == rec["generation"]
    assert _metric(text, "checkpointless_steps_committed_total") > 5
    assert _metric(text, "checkpointless_step_duration_seconds_count") > 3
    assert 0 < _metric(text, "checkpointless_goodput_ratio") < 1

    # status while it ran, and after it finished
    assert live["state"] == "running" and live["recoveries"] == 1, live
    assert [r["state"] for r in live["ranks"]] == ["training", "training"], live
    assert live["ranks"][1]["worker"] != 1, "rank 1 is held by the spare after the kill"
    assert all(isinstance(r["pid"], int) and r["host"] for r in live["ranks"]), live
    assert "secret" not in json.dumps(live)
    done = _status_json(run_dir, capsys)
    assert done["state"] == "finished" and {r["state"] for r in done["ranks"]} == {"finished"}
    assert "progress: running" in out, "--progress prints its one-line summary"

    # report: totals add up, phases are the event's, PNG and files written
    md, js, png = tmp_path / "ledger.md", tmp_path / "ledger.json", tmp_path / "timeline.png"
    assert report_main([str(run_dir), "--markdown", str(md), "--json", str(js), "--png", str(png)]) == 0
    table = capsys.readouterr().out
    assert "checkpoint-restart" in table and "productive steps" in table
    led = json.loads(js.read_text())
    assert sum(led["totals_s"].values()) == pytest.approx(led["wall_s"])
    f0 = led["faults"][0]
    us = 1e-5  # segments are differences of Unix times: exact to about a microsecond
    assert f0["phases"]["rebuild"] == pytest.approx(rec["rebuild_s"], abs=us)
    assert f0["phases"]["transfer"] == pytest.approx(rec["transfer_s"], abs=us)
    assert f0["phases"]["abort"] + f0["phases"]["spare_wait"] == pytest.approx(rec["collect_s"], abs=us)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert md.read_text().startswith("# Goodput ledger")


@pytest.mark.timeout(180)
def test_status_after_the_launcher_was_sigkilled(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, corpus, [])
    try:
        wait_for(
            lambda: any(e["event"] == "started" for e in _events(run_dir)),
            deadline_in(120),
            "generation 0",
            interval=0.1,
            proc=proc,
            details=lambda: _output_if_ended(proc),
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        # the reaper takes the workers down once the launcher is gone
        pids = [int(x) for x in (run_dir / "pids").read_text().split()]
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        st = _status_json(run_dir, capsys)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert st["state"] == "launcher gone", st
    assert {r["state"] for r in st["ranks"]} == {"dead"}, st
    assert st["elapsed_s"] > 0 and st["spares"] == []
    assert status_main([str(run_dir)]) == 0
    assert "LAUNCHER GONE" in capsys.readouterr().out
    assert report_main([str(run_dir), "--no-plot"]) == 0
    assert "launcher gone" in capsys.readouterr().out
