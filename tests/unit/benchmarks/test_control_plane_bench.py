"""The control-plane benchmark at a tiny size, so that it keeps running as the coordinator changes:
it drives the real coordinator through start-up, heartbeats and a lost host, and fails if a round
no longer plans."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.timeout(60)

BENCH = ROOT / "benchmarks" / "control_plane.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("control_plane_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_runs_at_four_hosts_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "cp.json"
    result = _bench().main(["--hosts", "4", "--repeats", "1", "--out", str(out)])
    (run,) = result["runs"]
    assert (run["hosts"], run["ranks"]) == (4, 32)
    # the lost host's 8 ranks went to spares and every member got the plan
    assert run["fault_recover_sends"] == 32
    assert run["recover_fits_control_cap"], "a 32-rank Recover is far below the control header cap"
    assert run["heartbeat_us"] > 0 and run["heartbeats_per_core_s"] > 0
    assert result["wire"]["coordinator_verify_decode_us"] > 0 and result["wire"]["frame_bytes"] > 100
    model = result["model"]
    assert model["ranks"] == 80000 and [r["interval_s"] for r in model["per_interval"]] == [0.25, 0.5, 1.0]
    assert json.loads(out.read_text())["runs"] == result["runs"]
    assert not list(tmp_path.glob("*.tmp")), "no half-written file is left"


def test_a_lost_host_needs_a_second_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _bench().main(["--hosts", "1", "--no-write"])
    assert "--hosts [1]" in capsys.readouterr().err
