"""The sharded benchmarks at tiny sizes, so they keep running as the launcher and the example
change: each drives real jobs (torchrun + plain FSDP2 and checkpointless run --fsdp R,S, gloo,
CPU) and fails if a run fails or its result lacks the fields BENCHMARKS.md is written from."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.paths import ROOT

BENCH = ROOT / "benchmarks"
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--global-batch", "4"]


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.soak  # `make soak`: the benchmark script itself, 20 s
@pytest.mark.timeout(150)
def test_steady_state_compares_plain_fsdp_with_checkpointless(tmp_path: Path) -> None:
    out = tmp_path / "ov.json"
    argv = ["--meshes", "1,2", "--rounds", "1", "--steps", "14", "--warmup", "4", "--plain-column", *TINY]
    argv += ["--out", str(out)]
    res = _bench("sharded_overhead").main(argv)
    # a run whose CPU was not fully counted is an error (benchmarks/_harness/cpu.py), so none here
    assert [r["error"] for r in res["runs"]] == [None] * len(res["runs"]), res["runs"]
    s = res["summary"]["1x2"]
    for d in res["designs"]:
        assert s["designs"][d]["median_step_s"]["median"] > 0
        assert s["designs"][d]["cpu_per_step_s"]["median"] > 0
    # every process of every design counted: each run in a cgroup of its own where one can be made
    sys.path.insert(0, str(BENCH))
    import _harness

    method = "proc-tree" if _harness.cgroup_base() is None else "cgroup"
    assert all(r["cpu_method"].startswith(method) and r["cpu_per_step_s"] > 0 for r in res["runs"]), res[
        "runs"
    ]
    # no design's job CPU is a fraction of another's (issue 35: 1.6 ms against 25-28 ms passed)
    cpu = [s["designs"][d]["cpu_per_step_s"]["median"] for d in res["designs"]]
    assert max(cpu) < 3 * min(cpu), cpu
    v = s["vs_fsdp"]["checkpointless"]
    assert v["ratio_median_step"] > 0 and v["target_pct"] == 2.0
    # the two designs train the same shards: bitwise equal final weights on every rank
    assert s["designs"]["fsdp"]["digests"] == s["designs"]["checkpointless"]["digests"]
    assert len(s["designs"]["fsdp"]["digests"]) == 1
    # the same torch script under `checkpointless run --plain`: the launcher's environment alone
    assert "fsdp_plain" in res["designs"] and s["vs_fsdp"]["fsdp_plain"]["target_pct"] is None
    assert s["designs"]["fsdp_plain"]["digests"] == s["designs"]["fsdp"]["digests"]
    if "buddy" not in res["designs"]:
        assert any("--buddy-copies" in n for n in res["notes"]), res["notes"]
    else:  # the copies' extra memory per rank, read from the commit events, and the same shards
        assert s["buddy_fields"]["extra_bytes_max"] >= 2 * s["buddy_fields"]["copy_bytes_max"] > 0, s
        assert s["designs"]["buddy"]["digests"] == s["designs"]["fsdp"]["digests"]
    assert json.loads(out.read_text())["summary"] == res["summary"]


@pytest.mark.soak  # `make soak`: both designs' fault-free and faulted runs, 65 s
@pytest.mark.timeout(180)
def test_recovery_measures_both_designs_after_a_kill(tmp_path: Path) -> None:
    out = tmp_path / "rec.json"
    argv = [
        "--ckpt-every",
        "5",
        "--steps",
        "8",
        "--fault-step",
        "6",
        "--no-reference",
        *TINY,
        "--out",
        str(out),
    ]
    res = _bench("sharded_recovery").main(argv)
    runs = {r["config"]: r for r in res["runs"]}
    assert sorted(runs) == ["a", "b5"] and all(r["error"] is None for r in runs.values()), res["runs"]
    a, b = runs["a"]["metrics"], runs["b5"]["metrics"]
    assert a["lost_steps"] == 0 and b["lost_steps"] == 1  # K=5: the restart redoes step 5
    assert a["sources"] == [[1, 3]], "rank 1 must take shard 1 from its replica peer, rank 3"
    for m in (a, b):
        assert m["downtime_s"] > 0 and set(m["phases"]) >= {"detect_s", "abort_s", "rebuild_s", "transfer_s"}
    assert res["summary"]["ratios"]["kill/b5"]["downtime"] > 0
    assert "Ratios (a)/(b)" in res["tables"]


@pytest.mark.timeout(150)
def test_transfer_recovers_a_whole_replica_group_and_measures_loopback(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    argv = ["--repeats", "1", "--steps", "4", "--fault-step", "2", "--loopback-repeats", "1", *TINY]
    res = _bench("sharded_transfer").main([*argv, "--out", str(out)])
    (run,) = res["runs"]
    assert "error" not in run, run
    # both ranks of replica group 0 came back from their shard's holder in group 1
    assert sorted(run["sources"]) == [[0, 2], [1, 3]] and run["receivers"] == 2
    assert run["state_bytes"] > 0 and run["transfer_s"] > 0
    assert run["aggregate_mbps"] > 0 and run["loopback_n_mbps"] > 0 and run["share_of_loopback"] > 0
    assert run["parts"]["role"] == "receiver" and run["parts"]["recv_s"] > 0, run["parts"]


@pytest.mark.timeout(60)
def test_loopback_copy_moves_every_byte() -> None:
    took = _bench("sharded_transfer").loopback_rate(4 << 20, 2)
    assert 0 < took < 30


@pytest.mark.timeout(30)
def test_pooled_rounds_pair_within_each_run_and_skip_failed_ones(tmp_path: Path) -> None:
    def run(rnd: int, design: str, step: float, cpu: float, error: str | None = None) -> dict[str, object]:
        common = {"mesh": "2x2", "round": rnd, "design": design, "error": error, "digest": "d"}
        return {**common, "median_step_s": step, "cpu_per_step_s": cpu}

    # run A: rounds 0 and 1 paired (1.1 and 1.0 by step); round 2's plain run failed: no pair
    a = [run(0, "fsdp", 1.0, 2.0), run(0, "checkpointless", 1.1, 2.2), run(1, "fsdp", 2.0, 4.0)]
    a += [
        run(1, "checkpointless", 2.0, 4.0),
        run(2, "fsdp", 1.0, 1.0, "rc 1"),
        run(2, "checkpointless", 9.0, 9.0),
    ]
    # run B: round numbers restart; its pair must not be matched with run A's round 0
    b = [run(0, "checkpointless", 0.9, 1.8), run(0, "fsdp", 1.0, 2.0)]
    files = []
    for name, runs in (("a.json", a), ("b.json", b)):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps({"command": "x", "machine": {"git": "g"}, "runs": runs}))
    res = _bench("pool_rounds").main([*map(str, files), "--out", str(tmp_path / "p.json")])
    assert res["step_ratios"] == [1.1, 1.0, 0.9] and res["cpu_ratios"] == [1.1, 1.0, 0.9]
    assert [p["rounds"] for p in res["parts"]] == [2, 1] and res["same_shards"]
    assert res["step_ci95"]["geomean"] == pytest.approx((1.1 * 1.0 * 0.9) ** (1 / 3))
    assert res["step_verdict"] == "undecided" and "**pooled** | 3 |" in res["table"]
    assert json.loads((tmp_path / "p.json").read_text())["rounds"] == 3


# `make soak`: benchmarks/wait_cost.py starts two fresh interpreters for each way to wait; the
# two ways that differ in timeouts, 30-60 s on two cores (all four took over 130 s at load 15).
# It measures the waits and checks no library behaviour (the collective waits themselves are
# tests/unit/comm's)
@pytest.mark.soak
@pytest.mark.timeout(150)
def test_wait_cost_measures_bounded_waits_against_one_then_a_callback(tmp_path: Path) -> None:
    out = tmp_path / "w.json"
    # a process of its own: the ranks are spawned and import the script by its own name
    argv = ["--rounds", "3", "--repeats", "1", "--late-ms", "40", "--modes", "slices", "first_wait"]
    subprocess.run(
        [sys.executable, str(BENCH / "wait_cost.py"), *argv, "--out", str(out)], check=True, timeout=130
    )
    s = {v["mode"]: v for v in json.loads(out.read_text())["summary"].values()}
    assert set(s) == {"slices", "first_wait"}
    assert all(v["cpu_ms_per_wait"] > 0 and v["wake_ms"] > 0 for v in s.values())
    assert s["slices"]["timeouts_per_wait"] >= 2, "a peer 40 ms late outlasts several 10 ms slices"
    assert 0 < s["first_wait"]["timeouts_per_wait"] <= 1, "one bounded wait, then the future's callback"


@pytest.mark.soak  # `make soak`: two FSDP2 jobs on the host, 35 s
@pytest.mark.timeout(120)
def test_the_gpu_step_time_check_runs_both_designs_on_the_host() -> None:
    """benchmarks/gpu_check.py's FSDP2 step-time comparison runs where a GPU is lent; on the CPU
    (gloo) the same script runs both designs in fresh processes and their final weights agree."""
    r = _bench("gpu_check").check_fsdp_step_time(
        sizes=(("tiny", 32, 2, 16),), rounds=1, steps=3, device="cpu"
    )
    assert r["bitwise_plain_equals_ours"] and r["ok"], r
    assert r["tiny"]["group_types"] == ["ProcessGroup", "ResilientProcessGroup"]
    assert r["tiny"]["step_ms_plain"] > 0 and r["tiny"]["step_ms_ours"] > 0
