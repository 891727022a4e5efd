"""Coordinator failover: time to a new coordinator, and the job's downtime.

Three hosts as network namespaces (tests/helpers/harness), as in tests/multihost/test_failover_netns.py: the
coordinator on host 0 next to its agent, 2 hosts x 2 ranks + 1 spare host, the tiny GPT example.
Each repetition starts a job, waits for step 5, then SIGKILLs the coordinator process
(``process``) or every process of host 0 (``host``: the coordinator, node 0's agent and ranks
0-1, which move to the spare host), and reads:

- ``elect_s``: the winner's election (loss detected -> majority of votes), from its
  ``coordinator_failover`` event;
- ``rebuild_s``: majority -> state rebuilt from the agents' votes and the workers' reconnects;
- ``to_coordinator_s``: the kill -> the ``coordinator_failover`` event (wall clock, one machine);
- ``downtime_s``: the kill -> every rank's first committed step of the new generation (their
  ``rank-<r>.jsonl`` commit times), i.e. what the job lost;
- whether the job then finished (``job_end`` ok) with every rank's digest equal.

Needs root (namespaces). Run: ``python benchmarks/failover.py --repeats 2`` (both scenarios,
about a minute per job on 2 busy cores, most of it the job's start-up). Writes
benchmarks/results/failover.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from checkpointless.data import make_synthetic_corpus, prepare_main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.harness.hosts import NetnsCluster  # noqa: E402 (the tests' harness, found through sys.path)

__all__ = ["main", "run_once"]

RESULTS = Path(__file__).resolve().parent / "results"
PORT = 29400
MODEL = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--global-batch", "12"]


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    f = run_dir / "events.jsonl"
    if not f.exists():
        return []
    return [e for e in map(json.loads, f.read_text().splitlines()) if e.get("event") == kind]


def _commits(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    f = run_dir / f"rank-{rank}.jsonl"
    if not f.exists():
        return []
    return [e for e in map(json.loads, f.read_text().splitlines()) if e.get("event") == "commit"]


def _wait(cond: Any, deadline: float, what: str) -> None:
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def run_once(
    cluster: NetnsCluster, work: Path, corpus: Path, steps: int, lease: float, scenario: str
) -> dict[str, Any]:
    run_dir = work / "run"
    h0 = cluster.hosts[0]
    py = [sys.executable, "-m", "checkpointless"]
    coord_argv = [
        *py, "coordinator", "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1",
        "--host", h0.address, "--control-port", str(PORT), "--run-dir", str(run_dir),
        "--hang-timeout", "20", "--lease", str(lease),
        str(ROOT / "examples" / "train_gpt.py"), "--steps", str(steps), *MODEL, "--data", str(corpus),
        "--digest-out", str(work / "digest-{rank}"),
    ]  # fmt: skip
    logs = [open(work / f"p{i}.out", "wb") for i in range(4)]  # noqa: SIM115 (closed below)
    procs = [h0.popen(coord_argv, cwd=ROOT, stdout=logs[0], stderr=logs[0])]
    for i, h in enumerate(cluster.hosts):
        agent = [
            *py, "agent", "--coordinator", f"{h0.address}:{PORT}", "--host", h.address,
            "--secret-file", str(run_dir / "secret"), "--node-order", str(i),
        ]  # fmt: skip
        procs.append(h.popen(agent, cwd=ROOT, stdout=logs[i + 1], stderr=logs[i + 1]))
    deadline = time.monotonic() + 240
    try:
        _wait(lambda: max((c["step"] for c in _commits(run_dir, 2)), default=-1) >= 5, deadline, "step 5")
        killed_wall = time.time()
        if scenario == "host":
            h0.kill_all()
        else:
            procs[0].kill()
        procs[0].wait(timeout=10)
        _wait(lambda: _events(run_dir, "coordinator_failover"), deadline, "a new coordinator")
        codes = []
        for p in procs[2:] if scenario == "host" else procs[1:]:  # host 0's agent died with it
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            codes.append(p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for f in logs:
            f.close()
    fo = _events(run_dir, "coordinator_failover")[0]
    firsts = []
    for rank in range(4):
        after = [c["time"] for c in _commits(run_dir, rank) if c["generation"] >= fo["generation"]]
        firsts.append(min(after) if after else float("nan"))
    digests = {
        (work / f"digest-{r}").read_text().strip() for r in range(4) if (work / f"digest-{r}").exists()
    }
    ends = _events(run_dir, "job_end")
    return {
        "scenario": scenario,
        "elect_s": fo["elect_s"],
        "rebuild_s": fo["rebuild_s"],
        "to_coordinator_s": round(fo["time"] - killed_wall, 4),
        "downtime_s": round(max(firsts) - killed_wall, 4),
        "term": fo["term"],
        "voters": fo["voters"],
        "missing": fo["missing"],
        "ok": bool(ends) and ends[-1].get("status") == "ok" and len(digests) == 1 and not any(codes),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lease", type=float, default=5.0)
    ap.add_argument("--scenario", choices=["process", "host", "both"], default="both")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root: hosts are network namespaces", file=sys.stderr)
        return 2
    runs = []
    keep = Path(tempfile.mkdtemp(prefix="cl-failover-"))  # left for its logs if a run fails
    tmp = str(keep)
    corpus = Path(tmp) / "corpus.tokens"
    make_synthetic_corpus(Path(tmp) / "corpus.jsonl", num_docs=400, seed=0)
    if prepare_main([str(Path(tmp) / "corpus.jsonl"), "-o", str(corpus), "--quiet"]) != 0:
        raise RuntimeError("could not prepare the benchmark's corpus")
    scenarios = ["process", "host"] if args.scenario == "both" else [args.scenario]
    for i in range(args.repeats):
        for scenario in scenarios:  # interleaved: the machine's load changes over minutes
            work = Path(tmp) / f"{scenario}{i}"
            work.mkdir()
            with NetnsCluster(3) as cluster:
                r = run_once(cluster, work, corpus, args.steps, args.lease, scenario)
            print(json.dumps(r))
            runs.append(r)
    if all(r["ok"] for r in runs):
        shutil.rmtree(keep, ignore_errors=True)
    else:
        print(f"a run failed; its logs are in {keep}", file=sys.stderr)
    # medians of the runs that finished; a failed one stays listed in "runs" with ok: false
    summary: dict[str, dict[str, float] | None] = {}
    for sc in scenarios:
        ok = [r for r in runs if r["scenario"] == sc and r["ok"]]
        keys = ("elect_s", "rebuild_s", "to_coordinator_s", "downtime_s")
        summary[sc] = {k: round(statistics.median(r[k] for r in ok), 4) for k in keys} if ok else None
    out = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "lease_s": args.lease,
        "runs": runs,
        "median": summary,
    }
    print(json.dumps(out["median"]))
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "failover.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
