"""Steady-state cost of a recoverable sharded job: checkpointless FSDP2/HSDP versus plain FSDP2/HSDP.

The example GPT (``examples/train_gpt.py --fsdp R,S``) is trained without faults, per mesh:

* ``fsdp``: torch alone -- ``torchrun benchmarks/baseline/train_fsdp_ckpt.py --fsdp R,S
  --ckpt-every 0`` (gloo ``init_process_group`` + ``init_device_mesh``, ``fully_shard`` per block
  and at the root, AdamW); the same model, data and seed;
* ``checkpointless``: ``checkpointless run --nproc R*S --spares 1 --buddy-copies off
  examples/train_gpt.py --fsdp R,S`` (launcher, heartbeats, resilient process groups under the
  same ``fully_shard``, commit bookkeeping, one idle hot spare; copies off explicitly, since the
  default turns them on for a 1xS mesh);
* ``buddy``: the same with ``--buddy-copies on``, when the launcher knows that flag (another branch
  adds it); otherwise the column is skipped with a note.

Runs alternate (A B C, C B A, ...) so every design sees the same drift of the machine's load. Step
time is the time between consecutive steps completed on every rank (per-rank commit logs) after
the warm-up and, on the checkpointless side, after the hot spare is ready; the figures are the
ratio of the medians, the median of adjacent-run ratios, and the job's CPU seconds per step (every
process it started, counted in the run's own cgroup), which a shared machine moves less than
wall time. The step-time and CPU readers are the harness's (benchmarks/_harness/logs.py), shared
with benchmarks/overhead.py; a run whose CPU was not fully counted fails.

    .venv/bin/python benchmarks/sharded_overhead.py              # FSDP 1x2 and HSDP 2x2, 2 rounds of 50 steps (~3 min; 5 at load 15)
    .venv/bin/python benchmarks/sharded_overhead.py --rounds 4 --steps 120
    .venv/bin/python benchmarks/sharded_overhead.py --meshes 1,4 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "baseline"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl
import shardlib as sl

__all__ = ["main"]

# fsdp_plain has no target: it tells what the launcher's environment alone costs
TARGET_PCT: dict[str, float | None] = {
    "fsdp_plain": None,
    "checkpointless": 2.0,
    "buddy": 5.0,
    "buddy_every": 5.0,
}


def launch(a: argparse.Namespace, design: str, mesh: tuple[int, int], run_dir: Path) -> bl.Finished:
    if design == "fsdp":
        cmd = sl.torchrun_command(a, mesh, run_dir, ckpt_every=0)
    elif design == "fsdp_plain":
        cmd = sl.plain_command(a, mesh, run_dir)
    else:
        # Explicit both ways: the launcher's default (auto) turns copies on for a mesh without a
        # replica (1xS), and the checkpointless column is the cost *without* them.
        extra = ["--buddy-copies", "on" if design.startswith("buddy") else "off"] if a.buddy_known else []
        if design == "buddy_every":  # copies every N steps (--buddy-every)
            extra += ["--buddy-every", str(a.buddy_every)]
        cmd = sl.checkpointless_command(a, mesh, run_dir, spares=a.spares, launcher_args=extra)
    return bl.run_job(cmd, run_dir, timeout=a.run_timeout, env=bl.bench_env(a.threads), sample_cpu=True)


def buddy_fields(run_dir: Path, warmup: int) -> dict[str, float]:
    """What the buddy copies cost, from every rank's commit events (their ``buddy`` record): the
    most memory one rank spent keeping copies for others (``keeps_bytes``; none when they lie in
    their owners' shared-memory files), the most extra memory in all (``extra_bytes``: that plus
    its own undo copies, in memory or in files), the
    bytes of one copy, and the median seconds a copy travelled and an update waited for it."""
    keeps: list[float] = []
    undo: list[float] = []
    extra: list[float] = []
    sent: list[float] = []
    send_s: list[float] = []
    wait_s: list[float] = []
    cpu: dict[str, list[float]] = {}  # per rank-step, over each rank's steady steps
    for f in sorted(run_dir.glob("rank-*.jsonl")):
        records = []
        for e in bl.read_jsonl(f):
            b = e.get("buddy") if e.get("event") == "commit" else None
            if not isinstance(b, dict):
                continue
            records.append((int(e["step"]), b))
            keeps.append(float(b.get("keeps_bytes", 0.0)))
            undo.append(float(b.get("undo_bytes", 0.0)))
            # all a rank spends: what it keeps for others, and its own undo copies (in process
            # memory, or in its shared-memory copy files with one spare file)
            extra.append(keeps[-1] + max(undo[-1], float(b.get("file_bytes", 0.0))))
            sent.append(float(b.get("bytes", 0.0)))
            send_s.append(float(b.get("send_s", 0.0)))
            wait_s.append(float(b.get("wait_s", 0.0)))
        steady = [r for r in records if r[0] >= warmup and isinstance(r[1].get("cpu_s"), dict)]
        if len(steady) >= 2:  # what the rank's copies cost it: laying out, sending, keeping
            (s0, b0), (s1, b1) = steady[0], steady[-1]
            for k, v in b1["cpu_s"].items():
                cpu.setdefault(k, []).append((float(v) - float(b0["cpu_s"].get(k, 0.0))) / (s1 - s0))
    if not keeps:
        return {}
    return {
        **{f"cpu_{k}_s_per_step": statistics.mean(v) for k, v in cpu.items()},
        "undo_bytes_max": max(undo),
        "keeps_bytes_max": max(keeps),
        "extra_bytes_max": max(extra),
        "copy_bytes_max": max(sent),
        "send_s_median": statistics.median(send_s),
        "wait_s_median": statistics.median(wait_s),
        "wait_s_max": max(wait_s),
    }


def _cpu_parts(bf: dict[str, float]) -> str:
    parts = [
        (k.removeprefix("cpu_").removesuffix("_s_per_step"), v) for k, v in bf.items() if k.startswith("cpu_")
    ]
    if not parts:
        return "not reported"
    each = ", ".join(f"{name} {v * 1000:.1f} ms" for name, v in parts)
    return f"{sum(v for _, v in parts) * 1000:.1f} ms ({each})"


def _target(pct: float | None) -> str:
    return "" if pct is None else f" (≤ {pct:g}%)"


def one_run(a: argparse.Namespace, design: str, mesh: tuple[int, int], i: int, work: Path) -> dict[str, Any]:
    run_dir = work / f"{design}-{mesh[0]}x{mesh[1]}-{i}"
    shutil.rmtree(run_dir, ignore_errors=True)
    fin = launch(a, design, mesh, run_dir)
    _, done = bl.step_times(run_dir, a.warmup)
    start = bl.steady_start(run_dir, done, a.warmup)
    st, _ = bl.step_times(run_dir, start)
    cps = bl.cpu_per_step(fin.cpu_samples, done, start)
    digest = sl.combine_digests(run_dir, mesh[0] * mesh[1])
    error = bl.run_error(fin.timed_out, fin.rc, len(st), min(5, a.steps - start - 1), (fin.cpu_error, cps))
    if error:
        tail = (
            (run_dir / "stderr.log").read_text(errors="replace").strip().splitlines()[-1:] if fin.rc else []
        )
        error += f" (logs in {run_dir})" + "".join(f": {line[-300:]}" for line in tail)
    rec: dict[str, Any] = {
        "design": design,
        "mesh": f"{mesh[0]}x{mesh[1]}",
        "round": i,
        "rc": fin.rc,
        "wall_s": round(fin.wall_s, 3),
        "steady_from_step": start,
        "error": error,
        "digest": digest,
        "median_step_s": statistics.median(st) if st else None,
        "cpu_per_step_s": cps,
        "cpu_method": fin.cpu_method,
        "buddy": buddy_fields(run_dir, start) if design.startswith("buddy") else {},
        "step_s": [round(x, 5) for x in st],
    }
    med = rec["median_step_s"]
    bl.say(
        f"  {rec['mesh']} {design:<15} #{i}: {fin.wall_s:6.1f} s, median step "
        f"{'-' if med is None else f'{med * 1000:.1f} ms'}, CPU/step {'-' if cps is None else f'{cps * 1000:.1f} ms'}"
        + (f"  FAILED: {error}" if error else "")
    )
    return rec


def summarize(runs: list[dict[str, Any]], mesh: str, designs: list[str], rounds: int) -> dict[str, Any]:
    ok = [r for r in runs if r["error"] is None and r["mesh"] == mesh]
    per: dict[str, Any] = {}
    for d in designs:
        rs = [r for r in ok if r["design"] == d]
        per[d] = {
            "runs": len(rs),
            "median_step_s": bl.summary([r["median_step_s"] for r in rs]),
            "cpu_per_step_s": bl.summary([r["cpu_per_step_s"] for r in rs]),
            "digests": sorted({r["digest"] for r in rs} - {None}),
        }
    out: dict[str, Any] = {"designs": per, "vs_fsdp": {}}
    base = per["fsdp"]
    for d in designs:
        if d == "fsdp":
            continue
        pairs, cpu_pairs = [], []
        for i in range(rounds):
            x = [r for r in ok if r["round"] == i and r["design"] == d]
            y = [r for r in ok if r["round"] == i and r["design"] == "fsdp"]
            if x and y:
                pairs.append(x[0]["median_step_s"] / y[0]["median_step_s"])
                if x[0]["cpu_per_step_s"] and y[0]["cpu_per_step_s"]:
                    cpu_pairs.append(x[0]["cpu_per_step_s"] / y[0]["cpu_per_step_s"])
        m, b = per[d]["median_step_s"]["median"], base["median_step_s"]["median"]
        c, cb = per[d]["cpu_per_step_s"]["median"], base["cpu_per_step_s"]["median"]
        ratio = m / b if m and b else None
        out["vs_fsdp"][d] = {
            "ratio_median_step": ratio,
            "overhead_pct": (ratio - 1) * 100 if ratio else None,
            "pair_ratios": bl.summary(pairs),
            "pair_ci95": bl.ratio_ci(pairs),
            "ratio_cpu_per_step": c / cb if c and cb else None,
            "cpu_pair_ratios": bl.summary(cpu_pairs),
            "cpu_pair_ci95": bl.ratio_ci(cpu_pairs),
            "target_pct": TARGET_PCT[d],
        }
    for d, key in (("buddy", "buddy_fields"), ("buddy_every", "buddy_every_fields")):
        buddy = [r["buddy"] for r in ok if r["design"] == d and r["buddy"]]
        out[key] = {k: max(b[k] for b in buddy if k in b) for b0 in buddy for k in b0}  # worst run
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--meshes", default="1,2;2,2", help="R,S meshes separated by ';' (default FSDP 1,2 and HSDP 2,2)"
    )
    ap.add_argument("--rounds", type=int, default=2, help="runs of each design per mesh, alternating")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=15, help="steps left out at the start of each run")
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--no-buddy", action="store_true", help="leave out the --buddy-copies on column")
    ap.add_argument(
        "--plain-column",
        action="store_true",
        help="add a column with the plain FSDP2 script under `checkpointless run --plain` (the launcher "
        "without any of our code in the worker): what the launcher's environment alone costs",
    )
    ap.add_argument(
        "--buddy-every",
        type=int,
        default=0,
        metavar="N",
        help="add a column with buddy copies every N steps (--buddy-every N; default: no such column)",
    )
    sl.add_model_args(ap)
    bl.add_run_args(ap, run_timeout=300.0, out=str(bl.RESULTS / "sharded_overhead.json"))
    a = ap.parse_args(argv)
    try:
        meshes = [sl.parse_mesh(m) for m in a.meshes.split(";") if m.strip()]
    except ValueError as e:
        ap.error(str(e))
    if a.warmup + 5 > a.steps:
        ap.error(f"--steps {a.steps} must leave at least 5 measured steps after --warmup {a.warmup}")

    a.buddy_known = sl.buddy_flag_known()
    notes: list[str] = []
    designs = ["fsdp", "fsdp_plain", "checkpointless"] if a.plain_column else ["fsdp", "checkpointless"]
    if a.no_buddy:
        notes.append("The --buddy-copies on column was left out (--no-buddy).")
    elif a.buddy_known:
        designs.append("buddy")
        if a.buddy_every > 1:
            designs.append("buddy_every")
    else:
        notes.append(
            "The --buddy-copies on column was skipped: `checkpointless run` does not know --buddy-copies yet "
            "(another branch adds it); rerun this benchmark once it is merged."
        )
    cmd = "python benchmarks/sharded_overhead.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    info = bl.machine_info()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="cl-bench-shov-"))
    runs: list[dict[str, Any]] = []
    print(f"sharded overhead: {len(meshes)} mesh(es) x {len(designs)} designs x {a.rounds} rounds in {work}")
    try:
        with (
            bl.cleanup_on_exit(),
            bl.run_bar(len(meshes) * len(designs) * a.rounds, "sharded overhead") as bar,
        ):
            for mesh in meshes:
                for i in range(a.rounds):
                    for design in bl.interleaved(designs, i):
                        runs.append(one_run(a, design, mesh, i, work))
                        bar.update()
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)

    per_mesh = {f"{m[0]}x{m[1]}": summarize(runs, f"{m[0]}x{m[1]}", designs, a.rounds) for m in meshes}
    rows: list[list[str]] = []
    for key, s in per_mesh.items():
        for d in designs:
            p = s["designs"][d]
            v = s["vs_fsdp"].get(d)
            ms = {k: (x * 1000 if isinstance(x, float) else x) for k, x in p["median_step_s"].items()}
            cpu = {k: (x * 1000 if isinstance(x, float) else x) for k, x in p["cpu_per_step_s"].items()}
            rows.append(
                [
                    key,
                    d,
                    str(p["runs"]),
                    bl.fmt_spread(ms, 1),
                    bl.fmt_spread(cpu, 1),
                    "-" if v is None else f"{bl.fmt(v['overhead_pct'], 1)}%" + _target(v["target_pct"]),
                    "-" if v is None else bl.fmt_spread(v["pair_ratios"], 3),
                    "-" if v is None else bl.fmt(v["ratio_cpu_per_step"], 3),
                ]
            )
    tbl = bl.table(
        ["mesh", "design", "runs", "median step ms", "job CPU ms/step", "overhead vs fsdp (target)",
         "round ratios", "CPU/step ratio"],
        rows,
    )  # fmt: skip
    for key, s in per_mesh.items():
        for d, v in s["vs_fsdp"].items():
            pct, pr = v["overhead_pct"], v["pair_ratios"]
            if pct is None:
                notes.append(f"{key} {d}: no ratio (failed runs).")
                continue
            if v["target_pct"] is None:
                notes.append(f"{key} {d}: {pct:.1f}% over torchrun with the same script (no target).")
                continue
            spread = (
                f"; round ratios spread {100 * (pr['max'] - pr['min']):.1f} points" if pr["n"] >= 2 else ""
            )
            # the ratio of the medians is a point estimate: the verdict is the paired interval's
            notes.append(
                f"{key} {d}: ratio of the medians {pct:+.1f}% (target ≤ {v['target_pct']:g}%; "
                f"the verdict is the paired rounds' interval){spread}."
            )
            for what, ci in (("step", v["pair_ci95"]), ("CPU", v["cpu_pair_ci95"])):
                if ci["lo"] is not None:
                    notes.append(
                        f"{key} {d}, paired rounds by {what}: {100 * (ci['geomean'] - 1):+.1f}% "
                        f"(95% CI {100 * (ci['lo'] - 1):+.1f}% to {100 * (ci['hi'] - 1):+.1f}%, "
                        f"{ci['n']} rounds): {bl.verdict(ci, v['target_pct'])} against ≤ {v['target_pct']:g}%."
                    )
        if s["buddy_fields"]:
            bf = s["buddy_fields"]
            notes.append(
                f"{key} buddy copies (worst run): extra memory per rank "
                f"{bf.get('extra_bytes_max', 0.0) / 1e6:.1f} MB for a {bf['copy_bytes_max'] / 1e6:.1f} MB "
                f"shard state ({bf['keeps_bytes_max'] / 1e6:.1f} MB kept for another rank, "
                f"{bf.get('undo_bytes_max', 0.0) / 1e6:.1f} MB its own two undo copies); CPU per "
                f"rank-step: {_cpu_parts(bf)}; a copy travels "
                f"{bf['send_s_median'] * 1000:.0f} ms (median), the update waited for it "
                f"{bf['wait_s_median'] * 1000:.1f} ms median, {bf['wait_s_max'] * 1000:.0f} ms at most."
            )
        elif "buddy" in designs:
            notes.append(f"{key} buddy copies: no commit event carried a buddy record.")
        if s.get("buddy_every_fields"):
            notes.append(
                f"{key} buddy copies every {a.buddy_every} steps (worst run): CPU per rank-step "
                f"{_cpu_parts(s['buddy_every_fields'])}."
            )
    failed = [f"{r['mesh']} {r['design']} #{r['round']}: {r['error']}" for r in runs if r["error"]]
    if failed:
        notes.append("Failed runs: " + "; ".join(failed))
    cores = os.cpu_count() or 1
    notes.append(
        f"{cores} cores; up to {max(m[0] * m[1] for m in meshes)} ranks share them; the checkpointless side also "
        f"runs the launcher and {a.spares} idle hot spare(s); OMP_NUM_THREADS={a.threads} everywhere."
    )
    info["bench_wall_s"] = time.monotonic() - t0
    info["load_note"] = bl.load_note(load0, os.getloadavg())
    print()
    print(tbl)
    print()
    for n in notes:
        print(f"- {n}")
    result = {
        "benchmark": "sharded_overhead",
        "command": cmd,
        "machine": info,
        "params": {k: v for k, v in vars(a).items() if k != "out"},
        "designs": designs,
        "summary": per_mesh,
        "table": tbl,
        "notes": notes,
        "runs": runs,
    }
    return bl.save_result(a.out, result)


if __name__ == "__main__":
    res = main()
    sys.exit(1 if any(r["error"] for r in res["runs"]) else 0)
