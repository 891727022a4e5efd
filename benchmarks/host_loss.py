"""Host loss across network namespaces: checkpointless versus multi-node torchrun with DCP checkpoints.

Three "hosts" are network namespaces on a bridge (tests/helpers/harness/hosts.py): 2 hosts x 2 ranks train
examples/train_gpt.py's GPT and host 2 is the spare host. When a rank of host 1 commits step
``--kill-step``, every process in host 1's namespace is SIGKILLed at once (agent, workers, torchrun's
agent: the host is gone). Measured, per design, from that kill:

* ``downtime_s``: to the first step that every rank commits after the kill;
* ``lost_steps``: steps that had been committed before the kill and were trained again;
* ``regain_s``: to the moment every rank has committed the step after the last one committed
  before the kill (downtime plus the recomputation of the lost steps);
* phases: checkpointless's ``host_lost`` and ``recovery`` events (detection, stop, rebuild, state,
  first batch, first step; docs/observability.md); torchrun's from the baseline's phase lines
  (restart, start and imports, process group, model, checkpoint load, first batch, first step).

The two designs:

* checkpointless: ``checkpointless coordinator`` on host 0 and ``checkpointless agent`` on every
  host (``--nnodes 2 --nproc-per-node 2 --spare-nodes 1``); the spare host's processes are
  started and imported before the fault.
* torchrun: ``torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d`` on hosts
  0 and 1, the rendezvous store on host 0's address, running benchmarks/baseline/train_ddp_ckpt.py
  (the same model, batches and seed) with a DCP checkpoint every K steps to a directory every
  host sees. After the kill, torchrun is started on the spare host with the same arguments (what a
  scheduler does when it replaces the lost node; its queueing delay is not counted), host 0's
  agent restarts its workers and both meet in a new rendezvous round, then load the newest
  checkpoint.

Needs root and iproute2 (it creates network namespaces); exits 2 saying so otherwise.

    sudo .venv/bin/python benchmarks/host_loss.py                     # ~3 min on a busy 2-core machine
    sudo .venv/bin/python benchmarks/host_loss.py --repeats 2 --ckpt-every 10 50
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the namespace harness lives with the tests (tests/helpers/harness)
sys.path.insert(0, str(REPO / "benchmarks" / "baseline"))
sys.path.insert(0, str(REPO / "benchmarks"))

import _harness as bl  # noqa: E402

from checkpointless.data import make_synthetic_corpus, prepare_main  # noqa: E402
from tests.helpers.harness.hosts import NetnsCluster, netns_unavailable_reason  # noqa: E402

CONTROL_PORT = 29400
RDZV_PORT = 29500
RESULT = REPO / "benchmarks" / "results" / "host_loss.json"


def model_args(a: argparse.Namespace) -> list[str]:
    return [
        "--steps", str(a.steps), "--dim", str(a.dim), "--layers", str(a.layers), "--heads", "4",
        "--seq-len", "64", "--global-batch", "16",
    ]  # fmt: skip


def job_env() -> dict[str, str]:
    env = bl.bench_env(1)
    env.pop("GLOO_SOCKET_IFNAME")  # checkpointless binds gloo to each host's --host itself
    return env


# -- reading the logs ------------------------------------------------------------------------
def commits(log_dir: Path) -> list[tuple[int, int, float]]:
    """(rank, step, wall time) of every commit line in ``log_dir``'s rank-<r>.jsonl files."""
    out = []
    for f in sorted(log_dir.glob("rank-*.jsonl")):
        rank = int(f.stem.split("-")[1])
        for e in bl.read_jsonl(f):
            if e.get("event") == "commit":
                out.append((rank, int(e["step"]), float(e["time"])))
    return out


def committed_by(log_dir: Path, rank: int) -> int:
    return max((s for r, s, _ in commits(log_dir) if r == rank), default=-1)


def outcome(log_dir: Path, t_kill: float, nproc: int) -> dict[str, Any]:
    """Downtime, lost steps and time to regain the kill point, from the commit lines."""
    cm = commits(log_dir)
    before = max((s for _, s, t in cm if t <= t_kill), default=-1)
    after: dict[int, dict[int, float]] = {}  # step -> rank -> first commit after the kill
    for r, s, t in cm:
        if t > t_kill:
            after.setdefault(s, {}).setdefault(r, t)
    full = sorted(s for s, by in after.items() if len(by) == nproc)
    if not full:
        return {"incomplete": "no step was committed by every rank after the kill"}
    resumed = full[0]
    regain = after.get(before + 1, {})
    return {
        "last_step_before_kill": before,
        "resumed_at_step": resumed,
        "lost_steps": max(0, before + 1 - resumed),
        "downtime_s": round(max(after[resumed].values()) - t_kill, 4),
        "regain_s": round(max(regain.values()) - t_kill, 4) if len(regain) == nproc else None,
    }


# -- checkpointless ----------------------------------------------------------------------------
def run_checkpointless(
    a: argparse.Namespace, cluster: NetnsCluster, work: Path, corpus: Path
) -> dict[str, Any]:
    run_dir = work / "run"
    run_dir.mkdir(parents=True)
    h0 = cluster.hosts[0]
    py = [bl.PYTHON, "-m", "checkpointless"]
    env = job_env()
    # the namespaces share this machine's /dev/shm; real hosts do not: give each host its own
    shm = [Path(tempfile.mkdtemp(prefix=f"cplh-bench-h{i}-", dir="/dev/shm")) for i in range(3)]
    coord = [
        *py, "coordinator", "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1",
        "--host", h0.address, "--control-port", str(CONTROL_PORT), "--run-dir", str(run_dir),
        "--hang-timeout", "20", "--lease", str(a.lease), str(bl.EXAMPLE), *model_args(a),
        "--data", str(corpus),
    ]  # fmt: skip
    (work / "command").write_text(shlex.join(coord) + "\n")
    procs = [h0.popen(coord, cwd=REPO, env=env, stdout=_out(work, "coordinator"), stderr=subprocess.STDOUT)]
    for i, h in enumerate(cluster.hosts):
        agent = [
            *py, "agent", "--coordinator", f"{h0.address}:{CONTROL_PORT}", "--host", h.address,
            "--secret-file", str(run_dir / "secret"), "--node-order", str(i),
        ]  # fmt: skip
        host_env = env | {"CHECKPOINTLESS_SHM_DIR": str(shm[i])}
        procs.append(
            h.popen(agent, cwd=REPO, env=host_env, stdout=_out(work, f"agent-{i}"), stderr=subprocess.STDOUT)
        )
    try:
        # rank 2 is host 1's first rank (host-major placement, node order = host index)
        t_kill = _kill_when(cluster, lambda: committed_by(run_dir, 2) >= a.kill_step, procs[0], a.run_timeout)
        spare_cache = cached_batches(shm[2])  # what the spare host had prefetched when host 1 died
        _wait(procs, a.run_timeout)
    finally:
        for d in shm:
            shutil.rmtree(d, ignore_errors=True)
    events = bl.read_jsonl(run_dir / "events.jsonl")
    res: dict[str, Any] = {"rc": procs[0].returncode, **outcome(run_dir, t_kill, 4)}
    lost = [e for e in events if e["event"] == "host_lost"]
    rec = [e for e in events if e["event"] == "recovery"]
    if lost:
        res["detect_s"] = round(float(lost[0]["time"]) - t_kill, 4)
        res["host_lost_why"] = lost[0]["why"]
    if rec:
        keys = ("downtime_s", "collect_s", "rebuild_s", "transfer_s", "first_batch_s", "first_step_s")
        res["recovery_event"] = {k: rec[-1].get(k) for k in (*keys, "transport", "state_bytes")}
    res["first_batch"] = replacement_first_batch(run_dir, events)
    res["first_batch"]["spare_host_cache_at_kill"] = spare_cache
    res["first_batch"]["resumed_step_cached"] = {
        r: res.get("resumed_at_step") in spare_cache.get(r, []) for r in res["first_batch"]["moved_ranks"]
    }
    return res


def cached_batches(root: Path) -> dict[int, list[int]]:
    """rank -> steps whose batch files are in this host's cache (``<job dir>/rank<r>/step<s>.batch``)."""
    out: dict[int, list[int]] = {}
    for f in root.glob("*/rank*/step*.batch"):
        out.setdefault(int(f.parent.name[4:]), []).append(int(f.stem[4:]))
    return {r: sorted(s) for r, s in sorted(out.items())}


def replacement_first_batch(run_dir: Path, events: list[dict[str, Any]]) -> dict[str, Any]:
    """How the spare host's processes got their first batch: the seconds from the step's start to
    the model's first forward, per moved rank (from the recovery event's per-rank reports)."""
    moved = {int(e["rank"]): int(e["worker"]) for e in events if e["event"] == "spare_assigned"}
    rec = [e for e in events if e["event"] == "recovery"]
    return {
        "moved_ranks": sorted(moved),
        "slowest_first_batch_s": rec[-1].get("first_batch_s") if rec else None,
    }


# -- torchrun ----------------------------------------------------------------------------------
def run_torchrun(a: argparse.Namespace, cluster: NetnsCluster, work: Path, every: int) -> dict[str, Any]:
    log_dir = work / "logs"
    log_dir.mkdir(parents=True)
    h0 = cluster.hosts[0]
    env = bl.bench_env(1)
    env["GLOO_SOCKET_IFNAME"] = "eth0"  # each namespace's own interface (the name is per namespace)

    conf = f"keep_alive_interval={a.rdzv_keep_alive},keep_alive_max_attempt=3," if a.rdzv_keep_alive else ""

    def command(h: Any, is_host: bool) -> list[str]:
        return [
            bl.TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "3",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{h0.address}:{RDZV_PORT}",
            "--rdzv-id", "hostloss", "--rdzv-conf", f"{conf}is_host={int(is_host)}", "--local-addr", h.address,
            str(bl.BASELINE), *model_args(a), "--ckpt-every", str(every), "--log-dir", str(log_dir),
            "--hang-timeout", "20", "--digest-out", str(work / "digest"),
        ]  # fmt: skip

    (work / "command").write_text(shlex.join(command(h0, True)) + "\n")
    procs = [
        h.popen(
            command(h, i == 0),
            cwd=REPO,
            env=env,
            stdout=_out(work, f"torchrun-{i}"),
            stderr=subprocess.STDOUT,
        )
        for i, h in enumerate(cluster.hosts[:2])
    ]

    def host1_rank_at_kill_step() -> bool:
        # group ranks are the rendezvous's choice: the ranks whose pids live in host 1's namespace
        pids = set(cluster.hosts[1].pids())
        for f in log_dir.glob("rank-*.jsonl"):
            evs = bl.read_jsonl(f)
            starts = [e for e in evs if e.get("name") == "process_start" and int(e.get("pid", -1)) in pids]
            if starts and any(e.get("event") == "commit" and int(e["step"]) >= a.kill_step for e in evs):
                return True
        return False

    t_kill = _kill_when(cluster, host1_rank_at_kill_step, procs[0], a.run_timeout)
    spare = cluster.hosts[2]
    procs.append(
        spare.popen(
            command(spare, False),
            cwd=REPO,
            env=env,
            stdout=_out(work, "torchrun-2"),
            stderr=subprocess.STDOUT,
        )
    )
    _wait([procs[0], procs[2]], a.run_timeout)
    res: dict[str, Any] = {"rc": procs[0].returncode, **outcome(log_dir, t_kill, 4)}
    res["phases"] = torchrun_phases(log_dir, t_kill, res.get("downtime_s"))
    return res


def torchrun_phases(log_dir: Path, t_kill: float, downtime: float | None) -> dict[str, Any]:
    """The restart's phases, from the baseline's phase lines written after the kill (the slowest
    of the four new processes at each phase; the spare host's processes are counted too)."""
    at: dict[str, list[float]] = {}
    for f in log_dir.glob("rank-*.jsonl"):
        for e in bl.read_jsonl(f):
            if e.get("event") == "phase" and float(e["time"]) > t_kill:
                at.setdefault(str(e["name"]), []).append(float(e["time"]))
    names = ("process_start", "example_imported", "pg_ready", "optimizer_ready", "ckpt_loaded", "first_batch")
    if any(len(at.get(n, [])) < 4 for n in names) or downtime is None:
        return {"incomplete": {n: len(at.get(n, [])) for n in names}}
    t = {n: max(at[n]) for n in names}
    return {
        "restart_s": round(min(at["process_start"]) - t_kill, 4),  # detection, teardown, spare agent up
        "start_and_imports_s": round(t["example_imported"] - min(at["process_start"]), 4),
        "rendezvous_and_pg_s": round(t["pg_ready"] - t["example_imported"], 4),
        "build_s": round(t["optimizer_ready"] - t["pg_ready"], 4),
        "ckpt_load_s": round(t["ckpt_loaded"] - t["optimizer_ready"], 4),
        "first_batch_s": round(t["first_batch"] - t["ckpt_loaded"], 4),
        "first_step_s": round(t_kill + downtime - t["first_batch"], 4),
    }


# -- plumbing ----------------------------------------------------------------------------------
def _out(work: Path, name: str) -> Any:
    return open(work / f"{name}.out", "wb")


def _kill_when(cluster: NetnsCluster, cond: Any, main: subprocess.Popen[bytes], timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while not cond():
        if main.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the job ended or timed out before host 1 reached the kill step")
        time.sleep(0.01)
    t_kill = time.time()
    cluster.hosts[1].kill_all()
    return t_kill


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def one(a: argparse.Namespace, design: str, work: Path, corpus: Path) -> dict[str, Any]:
    work.mkdir(parents=True)
    with NetnsCluster(3) as cluster:
        try:
            if design == "checkpointless":
                res = run_checkpointless(a, cluster, work, corpus)
            else:
                res = run_torchrun(a, cluster, work, int(design.split("=")[1]))
        except RuntimeError as e:
            res = {"error": str(e)}
        finally:
            for h in cluster.hosts:
                h.kill_all()
    if res.get("rc") not in (0, None) or "incomplete" in res or "error" in res:
        tail = "".join(p.read_text(errors="replace")[-1500:] for p in sorted(work.glob("*.out")))
        res["output_tail"] = tail[-4000:]
    return res


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ckpt-every", type=int, nargs="+", default=[10, 50], metavar="K")
    ap.add_argument("--steps", type=int, default=85)
    ap.add_argument("--kill-step", type=int, default=74, help="host 1 dies once it committed this step")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    # host loss here is seen by the closed connection at once; the lease only fences silent hosts,
    # and a short one loses agents starved of CPU while every process imports torch at start
    ap.add_argument("--lease", type=float, default=5.0, help="checkpointless's agent lease (s)")
    ap.add_argument("--run-timeout", type=float, default=300.0)
    ap.add_argument(
        "--rdzv-keep-alive",
        type=int,
        default=0,
        help="torchrun's c10d keep-alive interval in s (a dead node expires after 3 of them); "
        "0: torch's default (5 s, so 15 s)",
    )
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--keep", action="store_true", help="keep the runs' logs (their folder is printed)")
    ap.add_argument("--only-torchrun", action="store_true", help="skip the checkpointless runs")
    a = ap.parse_args()
    why = netns_unavailable_reason()
    if why is not None:
        print(f"host_loss.py cannot run here: {why}", file=sys.stderr)
        return 2
    if not 0 < a.kill_step < a.steps - 2:
        print(
            f"--kill-step must be in 1..{a.steps - 3} for --steps {a.steps} (got {a.kill_step})",
            file=sys.stderr,
        )
        return 2
    designs = ["checkpointless", *(f"torchrun K={k}" for k in a.ckpt_every)][int(a.only_torchrun) :]
    result: dict[str, Any] = {"machine": bl.machine_info(), "args": vars(a) | {"out": str(a.out)}, "runs": {}}
    work = Path(tempfile.mkdtemp(prefix="cl-hostloss-"))
    # checkpointless reads a token file through the per-host batch cache (the spare host's first
    # batch is the point); the baseline keeps its synthetic batches (the same cost: microseconds)
    try:
        make_synthetic_corpus(work / "corpus.jsonl", num_docs=400, seed=0)
        prepare_main([str(work / "corpus.jsonl"), "-o", str(work / "corpus.tokens"), "--quiet"])
        with bl.cleanup_on_exit():  # SIGTERM too: the namespaces and shm dirs go
            for rep in range(a.repeats):
                for d in designs:
                    bl.say(f"[{rep + 1}/{a.repeats}] {d} ...")
                    res = one(
                        a, d, work / f"{d.replace(' ', '_').replace('=', '')}-{rep}", work / "corpus.tokens"
                    )
                    result["runs"].setdefault(d, []).append(res)
                    bl.say(f"    {json.dumps({k: v for k, v in res.items() if k != 'output_tail'})}")
    finally:
        if a.keep:
            bl.say(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for d, rows in result["runs"].items():
        summary[d] = {k: median(rows, k) for k in ("downtime_s", "regain_s", "lost_steps", "detect_s")}
    cl = summary.get("checkpointless", {}).get("downtime_s")
    for d in designs:
        if d == "checkpointless":
            continue
        tr = summary[d]["downtime_s"]
        summary[d]["ratio_checkpointless_over_this"] = round(cl / tr, 4) if cl and tr else None
    result["summary"] = summary
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
