"""Shard-transfer throughput when several shards are recovered at once, against the loopback limit.

An HSDP job (``examples/train_gpt.py --fsdp R,S``, a larger model than the other benchmarks so the
shards are tens of MB) loses a whole replica group: every rank of group 0 is SIGKILLed as it
begins the same step. S hot spares take those ranks and each receives its own shard (parameters
and AdamW state, local DTensor shards) from the holder of that shard in another replica group, so
S transfers run at once, each from a different source. From the job's own records:

* the recovery event: ``state_bytes`` (one receiver's state), ``transfer_s`` (generation formed ->
  every rank holds verified state: the sources' collect, the stream, the XXH3 check, the restore
  into the model and optimizer), and the plan's (receiver, source) pairs;
* each receiver's own ``state receiver in X s`` line (the per-rank log);
* the recovery event's ``transfer_parts``: the slowest receiver's ``transfer_s`` split into its
  own tensors collected (the landing zone), the stream (``recv_s``, hashed as it arrives), the
  digests compared with the tree rebuilt (``verify_s``), and the restore.

The aggregate rate is receivers x state bytes / transfer_s. The loopback limit is measured in the
same run, right after each job, on the same machine: the same number of concurrent plain TCP
copies (one sender and one receiver thread per stream, ``sendall`` into ``recv_into`` a buffer
already paged in) of the same bytes per stream -- no encoding, no checksum, no allocation.

    .venv/bin/python benchmarks/sharded_transfer.py             # HSDP 2x2, dim 512, 2 repeats (~2 min)
    .venv/bin/python benchmarks/sharded_transfer.py --mesh 2,4 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "baseline"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl
import shardlib as sl

__all__ = ["loopback_rate", "main"]

# the worker's log line after a generation forms: "[rank 1] generation 1 formed in 0.053 s,
# state receiver in 0.116 s; resuming at step 15"
_FORMED = re.compile(r"\[rank (\d+)[^\]]*\] generation (\d+) formed in [\d.]+ s, state (\w+) in ([\d.]+) s")


def loopback_rate(nbytes: int, streams: int, timeout: float = 120.0) -> float:
    """Seconds for ``streams`` concurrent loopback TCP copies of ``nbytes`` each, first byte sent
    to last byte received (buffers allocated and paged in before the clock starts)."""
    listeners, conns, buffers = [], [], []
    try:
        for _ in range(streams):
            ls = socket.create_server(("127.0.0.1", 0))
            tx = socket.create_connection(ls.getsockname(), timeout=timeout)
            rx, _ = ls.accept()
            rx.settimeout(timeout)
            listeners.append(ls)
            conns.append((tx, rx))
            src, dst = bytearray(b"\x07" * nbytes), bytearray(nbytes)  # both paged in
            buffers.append((src, dst))
        start = threading.Barrier(2 * streams + 1)
        errors: list[BaseException] = []

        def send(i: int) -> None:
            try:
                start.wait(timeout)
                conns[i][0].sendall(buffers[i][0])
            except BaseException as e:  # reported below; a thread must not die silently
                errors.append(e)

        def recv(i: int) -> None:
            try:
                view, got = memoryview(buffers[i][1]), 0
                start.wait(timeout)
                while got < nbytes:
                    n = conns[i][1].recv_into(view[got:], nbytes - got)
                    if n == 0:
                        raise ConnectionError("loopback sender closed early")
                    got += n
            except BaseException as e:
                errors.append(e)

        threads = [
            threading.Thread(target=f, args=(i,), daemon=True) for i in range(streams) for f in (send, recv)
        ]
        for t in threads:
            t.start()
        start.wait(timeout)
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        took = time.perf_counter() - t0
        if errors or any(t.is_alive() for t in threads):
            raise RuntimeError(f"loopback copy failed: {errors or 'timed out'}")
        return took
    finally:
        for tx, rx in conns:
            tx.close()
            rx.close()
        for ls in listeners:
            ls.close()


def job_record(run_dir: Path, group: list[int]) -> dict[str, Any]:
    """The recovery that took back the lost group's ranks, from the job's events and logs."""
    events = bl.read_jsonl(run_dir / "events.jsonl")
    plans = {int(e["generation"]): e for e in events if e.get("event") == "plan" and int(e["generation"]) > 0}
    recs = [e for e in events if e.get("event") == "recovery"]
    if not recs:
        return {"error": "no recovery event"}
    # both kills normally land in one round; if they came apart, the round that received most
    rec = max(recs, key=lambda e: len(plans.get(int(e["generation"]), {}).get("sources", [])))
    gen = int(rec["generation"])
    sources = [[int(r), int(s)] for r, s in plans.get(gen, {}).get("sources", [])]
    per_rank: dict[int, float] = {}
    for line in (run_dir / "stderr.log").read_text(errors="replace").splitlines():
        m = _FORMED.search(line)
        if m and int(m.group(2)) == gen and m.group(3) == "receiver":
            per_rank[int(m.group(1))] = float(m.group(4))
    out: dict[str, Any] = {
        "generation": gen,
        "rounds": len(recs),
        "sources": sources,
        "receivers": len(sources),
        "state_bytes": float(rec.get("state_bytes") or 0.0),
        "transfer_s": float(rec["transfer_s"]),
        "downtime_s": float(rec["downtime_s"]),
        "transport": rec.get("transport"),
        "receiver_s": per_rank,
        # the slowest receiver's transfer_s split: own tensors collected, stream, digests, restore
        "parts": rec.get("transfer_parts") or {},
    }
    if sorted(r for r, _ in sources) != sorted(group):
        out["error"] = f"the plan's receivers {sorted(r for r, _ in sources)} are not the lost group {group}"
    return out


def one_run(a: argparse.Namespace, i: int, work: Path) -> dict[str, Any]:
    s_ = a.mesh[1]
    group = list(range(s_))  # replica group 0: ranks 0..S-1 (row-major mesh)
    run_dir = work / f"run-{i}"
    shutil.rmtree(run_dir, ignore_errors=True)
    inject: list[str] = []
    for rank in group:
        inject += ["--inject", f"kill:rank={rank}:step={a.fault_step}"]
    cmd = sl.checkpointless_command(a, a.mesh, run_dir, spares=s_, launcher_args=inject)
    fin = bl.run_job(cmd, run_dir, timeout=a.run_timeout, env=bl.bench_env(a.threads))
    rec: dict[str, Any] = {"run": i, "rc": fin.rc, "wall_s": round(fin.wall_s, 3)}
    if fin.timed_out or fin.rc != 0:
        rec["error"] = f"{'timed out' if fin.timed_out else f'exit code {fin.rc}'} (logs in {run_dir})"
        return rec
    rec.update(job_record(run_dir, group))
    if "error" in rec:
        return rec
    n, nbytes = rec["receivers"], int(rec["state_bytes"])
    rec["aggregate_mbps"] = n * nbytes / rec["transfer_s"] / 1e6
    per = [nbytes / t / 1e6 for t in rec["receiver_s"].values() if t > 0]
    rec["receiver_mbps"] = bl.summary(per)
    # the loopback limit right after the job, for the same streams and bytes
    one = [loopback_rate(nbytes, 1) for _ in range(a.loopback_repeats)]
    many = [loopback_rate(nbytes, n) for _ in range(a.loopback_repeats)]
    rec["loopback_1_mbps"] = nbytes / statistics.median(one) / 1e6
    rec["loopback_n_mbps"] = n * nbytes / statistics.median(many) / 1e6
    rec["share_of_loopback"] = rec["aggregate_mbps"] / rec["loopback_n_mbps"]
    bl.say(
        f"  #{i}: {n} shards of {nbytes / 1e6:.1f} MB at once in {rec['transfer_s']:.3f} s: "
        f"{rec['aggregate_mbps']:.0f} MB/s; loopback x{n} {rec['loopback_n_mbps']:.0f} MB/s "
        f"({100 * rec['share_of_loopback']:.1f}%), x1 {rec['loopback_1_mbps']:.0f} MB/s"
    )
    if rec["parts"]:
        split = ", ".join(
            f"{k.removesuffix('_s')} {v:.3f}" for k, v in rec["parts"].items() if k.endswith("_s")
        )
        bl.say(f"      rank {rec['parts'].get('rank')}'s transfer: {split} s")
    return rec


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="2,2", help="R,S (R >= 2); replica group 0, S ranks, is lost")
    ap.add_argument("--repeats", type=int, default=2, help="jobs")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--fault-step", type=int, default=3)
    ap.add_argument("--loopback-repeats", type=int, default=3)
    sl.add_model_args(ap)
    ap.set_defaults(dim=512)  # ~13 M parameters: a shard's state is tens of MB at S = 2
    bl.add_run_args(ap, run_timeout=300.0, out=str(bl.RESULTS / "sharded_transfer.json"))
    a = ap.parse_args(argv)
    try:
        a.mesh = sl.parse_mesh(a.mesh)
    except ValueError as e:
        ap.error(str(e))
    if a.mesh[0] < 2:
        ap.error(f"--mesh {a.mesh[0]},{a.mesh[1]}: R must be >= 2, a lost replica group needs another one")
    if not 0 < a.fault_step < a.steps:
        ap.error(f"--fault-step {a.fault_step} must be inside the job (0 < fault-step < --steps {a.steps})")

    cmd = "python benchmarks/sharded_transfer.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    info = bl.machine_info()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="cl-bench-shxfer-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    print(
        f"sharded transfer: {a.repeats} HSDP {a.mesh[0]}x{a.mesh[1]} jobs losing replica group 0, in {work}"
    )
    try:
        with bl.cleanup_on_exit(), bl.run_bar(a.repeats, "sharded transfer") as bar:
            for i in range(a.repeats):
                runs.append(one_run(a, i, work))
                if "error" in runs[-1]:
                    bl.say(f"  #{i}: FAILED: {runs[-1]['error']}")
                bar.update()
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    ok = [r for r in runs if "error" not in r]
    summary = {
        k: bl.summary([r[k] for r in ok])
        for k in (
            "state_bytes",
            "transfer_s",
            "aggregate_mbps",
            "loopback_n_mbps",
            "loopback_1_mbps",
            "share_of_loopback",
        )
    }
    summary["receivers"] = bl.summary([r["receivers"] for r in ok])
    for part in ("state_collect_s", "recv_s", "verify_s", "state_restore_s"):
        got = [r["parts"][part] for r in ok if part in r.get("parts", {})]
        if got:
            summary[f"receiver_{part}"] = bl.summary(got)
    notes = []
    if ok:
        share = summary["share_of_loopback"]["median"]
        notes.append(
            f"{summary['receivers']['median']:.0f} shards of {summary['state_bytes']['median'] / 1e6:.1f} MB recovered at "
            f"once from {summary['receivers']['median']:.0f} different sources: {summary['aggregate_mbps']['median']:.0f} "
            f"MB/s aggregate, {100 * share:.1f}% of {summary['loopback_n_mbps']['median']:.0f} MB/s for the same "
            "concurrent plain loopback copies (end to end: collect, stream, XXH3 check, restore into the shards)."
        )
        notes.append(
            f"plans (receiver, source): {[r['sources'] for r in ok]}; rank r holds shard r % {a.mesh[1]}."
        )
    failed = [f"#{r['run']}: {r['error']}" for r in runs if "error" in r]
    if failed:
        notes.append("Failed runs: " + "; ".join(failed))
    info["bench_wall_s"] = time.monotonic() - t0
    info["load_note"] = bl.load_note(load0, os.getloadavg())
    for n in notes:
        print(f"- {n}")
    result = {
        "benchmark": "sharded_transfer",
        "command": cmd,
        "machine": info,
        "params": {k: v for k, v in vars(a).items() if k != "out"},
        "summary": summary,
        "notes": notes,
        "runs": runs,
    }
    return bl.save_result(a.out, result)


if __name__ == "__main__":
    res = main()
    sys.exit(1 if any("error" in r for r in res["runs"]) else 0)
