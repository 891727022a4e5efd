"""BENCHMARKS.md's tables, rendered from the result files in ``benchmarks/results/``.

Each benchmark has one block in BENCHMARKS.md: the line ``<!-- render:KEY -->``, then a line with
its result file, command, date and machine, and its table, every figure read from the result
file here. The prose around the blocks is written by hand and holds no
table. ``tests/unit/benchmarks/test_benchmarks_doc.py`` checks that the committed blocks are what this script
renders, that no table stands outside a block, and that every result file is cited and every
cited file exists.

    .venv/bin/python benchmarks/render.py           # rewrite the blocks of BENCHMARKS.md in place
    .venv/bin/python benchmarks/render.py --check   # exit 1 and list what is out of date

A new benchmark: add its ``Block`` to ``BLOCKS`` (a table function over its result file) and a
``<!-- render:KEY -->`` line where its section goes; then run this script.
"""

# ruff: noqa: RUF001, RUF002 - the tables use the en dash and the multiplication sign of BENCHMARKS.md
from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
DOC = REPO / "BENCHMARKS.md"

Rows = list[list[str]]
Table = tuple[list[str], Rows]


# -- reading and formatting --------------------------------------------------------------------
def get(d: Any, path: str) -> Any:
    """The value at a dotted key path; ``[i]`` indexes a list (``summary[0].size``)."""
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        d = d[int(part[1:-1])] if part.startswith("[") else d[part]
    return d


def num(x: Any, nd: int = 2, unit: str = "", scale: float = 1.0) -> str:
    if x is None:
        return "–"
    return f"{float(x) * scale:,.{nd}f}{unit}"


def spread(s: dict[str, Any], nd: int = 2, unit: str = " s", scale: float = 1.0) -> str:
    """A median with its [min–max] over the repeats, from ``_harness.summary``'s dict."""
    if s.get("median") is None:
        return "–"
    med = num(s["median"], nd, unit, scale)
    if s.get("n", 1) <= 1 or s["min"] == s["max"]:
        return med
    return f"{med} [{num(s['min'], nd, '', scale)}–{num(s['max'], nd, '', scale)}]"


def ci(c: dict[str, Any], nd: int = 3) -> str:
    """A geometric mean of paired ratios with its 95% interval and number of rounds."""
    if not c or c.get("geomean") is None:
        return "–"
    if c.get("lo") is None:
        return f"{c['geomean']:.{nd}f} ({c['n']} rounds)"
    return f"{c['geomean']:.{nd}f} ({c['lo']:.{nd}f}–{c['hi']:.{nd}f}), {c['n']} rounds"


# -- the tables ----------------------------------------------------------------------------------
def t_recovery(d: dict[str, Any]) -> Table:
    cfg, ratios = d["summary"]["configs"], d["summary"]["ratios"]
    rows = []
    for kind, label in (("raise", "exception"), ("kill", "SIGKILL"), ("hang", "hang (SIGSTOP)")):
        cells = [spread(cfg[c]["kinds"][kind]["downtime_s"]) for c in ("a", "b10", "b50")]
        r = f"{num(ratios[f'{kind}/b10']['downtime'], 3)} / {num(ratios[f'{kind}/b50']['downtime'], 3)}"
        rows.append([label, *cells, r])
    head = [
        "fault",
        "(a) checkpointless downtime",
        "(b) torchrun K=10",
        "(b) torchrun K=50",
        "ratio (a)/(b) K=10 / K=50",
    ]
    return head, rows


def t_overhead(d: dict[str, Any]) -> Table:
    s, nproc = d["summary"], str(d["params"]["nproc"])
    rows = []
    for design in ("ddp", "checkpointless"):
        p = s["designs"][design]
        paired = ("–", "–") if design == "ddp" else (
            _paired(s, "pair_ci95", "pair_ratios", "ratio_median_step"),
            _paired(s, "cpu_pair_ci95", "cpu_pair_ratios", "ratio_cpu_per_step"),
        )  # fmt: skip
        rows.append([
            design, nproc, str(p["runs"]), spread(p["median_step_s"], 1, " ms", 1000),
            spread(p["cpu_per_step_s"], 1, " ms", 1000), *paired,
        ])  # fmt: skip
    return [
        "design",
        "ranks",
        "runs",
        "median step",
        "job CPU per step",
        "paired step ratio (95% CI)",
        "paired CPU ratio (95% CI)",
    ], rows


def _transfer(d: dict[str, Any]) -> Table:
    sizes = d["summary"]
    head = [
        "receiver",
        *(
            f"{num(x['size'] / 1e9, 0)} GB" if x["size"] >= 1e9 else f"{num(x['size'] / 1e6, 0)} MB"
            for x in sizes
        ),
    ]
    rows = []
    for key, label in (
        ("replica", "a replica's own tensors"),
        ("spare", "a promoted spare"),
        ("fresh", "new memory"),
        ("gloo", "over the gloo group"),
    ):
        rows.append([label, *(num(x[f"{key}_e2e_pct"]["median"], 0, "%") for x in sizes)])
    return head, rows


def t_cost_and_downtime(every_key: str) -> Callable[[dict[str, Any]], Table]:
    def table(d: dict[str, Any]) -> Table:
        c = d["cost"]
        every = list(c["overhead_pct"])
        rows = [
            [
                f"`{every_key}` " + " / ".join(every),
                " / ".join(num(c["overhead_pct"][k], 1, "%") for k in every),
            ]
        ]
        per = next(k for k in c if k.startswith("extra_wall_s_per_"))
        cpu = per.replace("wall", "cpu")
        rows.append(
            ["cost per copy: wall / CPU", f"{num(c[per], 1, ' ms', 1000)} / {num(c[cpu], 1, ' ms', 1000)}"]
        )
        for name, r in d["downtime"].items():
            parts = ", ".join(
                f"{k[:-2]} {num(r[k], 3)}" for k in ("collect_s", "rebuild_s", "transfer_s", "first_step_s")
            )
            rows.append([f"downtime, {name}", f"{num(r['downtime_s'])} s ({parts})"])
        return ["measure", "value"], rows

    return table


def t_rendezvous_scale(d: dict[str, Any]) -> Table:
    rows = [
        [num(r["ranks"], 0), num(r["central_unbatched_s"], 1, " s"), num(r["central_s"], 2, " s"),
         num(r["rootless_s"], 2, " s"), num(r["speedup"], 1, "×")]
        for r in d["model"]["rows"]
        if r["ranks"] in (1024, 8192, 100_000)
    ]  # fmt: skip
    return ["ranks (model)", "TCPStore unbatched", "TCPStore batched", "root-less", "speed-up"], rows


def t_rendezvous_pg(d: dict[str, Any]) -> Table:
    rows = [
        [r["store"], str(r["ranks"]), num(r["startup_median_ms"], 1, " ms"), num(r["rebuild_median_ms"], 1, " ms"),
         num(r["rebuild_max_ms"], 1, " ms"), r["rank0_replaced_summary"]]
        for r in d["rows"]
        if r["ranks"] == 4
    ]  # fmt: skip
    return ["store", "ranks", "start-up", "rebuild (median)", "rebuild (max)", "rank 0 replaced"], rows


def t_rendezvous_lazy(d: dict[str, Any]) -> Table:
    rows = [
        [str(r["ranks"]), r["mode"], num(r["recovery_keys_read_max"], 0), num(r["recovery_keys_read_total"], 0),
         num(r["recovery_requests_served_max"], 0), num(r["recovery_wall_median_s"], 0, " ms", 1000)]
        for r in d["rows"]
    ]  # fmt: skip
    header = ["ranks", "gloo connection", "keys read per rank", "keys read in all",
              "busiest key server's requests", "forming to first all-reduce (median)"]  # fmt: skip
    return header, rows


def t_host_loss(d: dict[str, Any]) -> Table:
    rows = []
    for name, s in d["summary"].items():
        ratio = s.get("ratio_checkpointless_over_this")
        rows.append(
            [
                name,
                num(s["downtime_s"]) + " s",
                num(s["regain_s"]) + " s",
                str(s["lost_steps"]),
                num(ratio, 3),
            ]
        )
    return ["design", "downtime", "regain", "lost steps", "ratio checkpointless / this"], rows


def t_failover(d: dict[str, Any]) -> Table:
    keys = ("elect_s", "rebuild_s", "to_coordinator_s", "downtime_s")
    n = {name: sum(r["scenario"] == name for r in d["runs"]) for name in d["median"]}
    rows = [
        [f"{name} (median of {n[name]})", *(num(m[k], 0, " ms", 1000) for k in keys)]
        for name, m in d["median"].items()
    ]
    return [
        "scenario",
        "election",
        "rebuild",
        "kill → new coordinator",
        "kill → every rank's next step",
    ], rows


def t_control_plane(d: dict[str, Any]) -> Table:
    m = d["model"]
    rows = [[num(r["interval_s"], 2, " s"), num(r["direct_core_s_per_s"], 2), num(r["aggregated_core_s_per_s"], 2),
             num(r["tick_core_s_per_s"], 2), num(r["max_ranks_one_core"], 0)] for r in m["per_interval"]]  # fmt: skip
    rows.append(["fault round / start-up (coordinator CPU)", num(m["fault_round_coordinator_s"], 2, " s"),
                 num(m["startup_coordinator_s"], 2, " s"), "", ""])  # fmt: skip
    head = [f"{num(m['ranks'], 0)} ranks: heartbeat every", "cores, a frame per rank", "cores, per-host frames",
            "ticks (50/s)", "ranks one core holds"]  # fmt: skip
    return head, rows


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


def t_data(d: dict[str, Any]) -> Table:
    rows = [
        [f"{k}, fresh process (after imports)", num(_median(v["after_imports_ms"]), 2, " ms")]
        for k, v in d["fresh_process"].items()
    ]
    for k, v in d.get("steady_batches_per_s", {}).items():
        rows.append([f"steady state, {k}", num(v, 0, " batches/s")])
    for k, v in d.get("memory", {}).items():
        rows.append([f"memory, {k}: node PSS", num(v["node_pss_mb"], 0, " MB")])
    return ["measure", "value"], rows


def t_goodput(d: dict[str, Any]) -> Table:
    """Every simulated size the result file sets a target for, each design a column."""
    columns = [
        ("checkpoint-restart", "checkpoint-restart (Young interval)"),
        ("checkpointless, fails when the spares run out", "checkpointless, fails when the spares run out"),
        (
            "checkpointless, chosen policy",
            "checkpointless, wait, then shrink (bitwise) + grow back + quarantine",
        ),
        (
            "checkpointless, chosen policy, store-based rebuild",
            "the same, store-based rebuild (--rendezvous tcp)",
        ),
    ]
    rows = [
        [num(int(gpus), 0), *(num(by[key], 2, "%", 100) if key in by else "–" for key, _ in columns)]
        for gpus, by in sorted(d["targets"].items(), key=lambda kv: int(kv[0]))
    ]
    return ["GPUs", *(label for _, label in columns)], rows


def _paired(v: dict[str, Any] | None, ci_key: str, pairs_key: str, ratio_key: str) -> str:
    """The paired interval where the run computed one (since session 14); before, the ratio of
    the medians and the round ratios' spread."""
    if v is None:
        return "–"
    if ci_key in v:
        return ci(v[ci_key])
    return f"{num(v[ratio_key], 3)}; rounds {spread(v[pairs_key], 3, '')}"


def t_sharded_overhead(d: dict[str, Any]) -> Table:
    rows = []
    for mesh, s in d["summary"].items():
        for design in d["designs"]:
            p, v = s["designs"][design], s["vs_fsdp"].get(design)
            rows.append([
                mesh, design, str(p["runs"]), spread(p["median_step_s"], 1, " ms", 1000),
                spread(p["cpu_per_step_s"], 1, " ms", 1000),
                *(_paired(v, "pair_ci95", "pair_ratios", "ratio_median_step"),
                  _paired(v, "cpu_pair_ci95", "cpu_pair_ratios", "ratio_cpu_per_step")),
            ])  # fmt: skip
    return [
        "mesh",
        "design",
        "runs",
        "median step",
        "job CPU per step",
        "paired step ratio (95% CI)",
        "paired CPU ratio (95% CI)",
    ], rows


def t_sharded_recovery(d: dict[str, Any]) -> Table:
    cfg, ratios = d["summary"]["configs"], d["summary"]["ratios"]
    rows = []
    for c in ("a", "b10", "b50"):
        k = cfg[c]["kinds"]["kill"]
        ratio = "" if c == "a" else num(ratios[f"kill/{c}"]["downtime"], 3)
        rows.append([cfg[c]["label"], spread(k["downtime_s"]), ratio])
    return ["design", "downtime (rank 1 SIGKILLed)", "ratio checkpointless / this"], rows


PARALLEL_JOBS = {"3d": "3-D, 2×2×2", "pp": "PP, 2 stages × 2, 1F1B"}


def _parallel_jobs(d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """parallel_recovery.json's jobs with their labels; a job carried over from an earlier run
    (``--jobs`` left it out) names that run's date and commit."""
    out = []
    for key, label in PARALLEL_JOBS.items():
        if key not in d["jobs"]:
            continue
        job = d["jobs"][key]
        m = job.get("measured") or {}
        if m.get("date") and m["date"] != d["machine"].get("date"):
            label += f" (run of {str(m['date']).replace('T', ' ')[:16]}, `{m.get('git')}`)"
        out.append((label, job))
    return out


def t_parallel_recovery(d: dict[str, Any]) -> Table:
    """One column per job: both designs' downtime, steps redone and bitwise checks, the fault-free
    step time with the ratio's interval, and the state the spare received against loopback."""
    jobs = _parallel_jobs(d)
    rows: Rows = []

    def row(name: str, cell: Callable[[dict[str, Any]], str]) -> None:
        rows.append([name, *(cell(job) for _, job in jobs)])

    def yes(x: bool | None) -> str:
        return "–" if x is None else ("yes" if x else "NO")

    def kill(job: dict[str, Any], c: str) -> dict[str, Any]:
        return dict(job["summary"]["configs"][c]["kinds"]["kill"])

    def step(job: dict[str, Any], c: str) -> str:
        s = job["step_time"][c] if "step_time" in job else job["summary"]["configs"][c]["no_fault"]["step_s"]
        return spread(s, 3)

    def ratio(job: dict[str, Any]) -> str:
        if "step_time" not in job:  # a run from before the interval: the ratio of the two medians
            ours, theirs = (job["summary"]["configs"][c]["no_fault"]["step_s"]["median"] for c in ("a", base))
            return f"{ours / theirs:.3f} (one run each, no interval)" if ours and theirs else "–"
        if job["step_time"]["ratio"]["ratio"] is None:
            return "–"
        r, p = job["step_time"]["ratio"], job["step_time"]["paired"]
        return f"{r['ratio']:.3f} ({r['lo']:.3f}–{r['hi']:.3f}); per repeat {spread(p, 3, '')}"

    def same_bits(job: dict[str, Any]) -> str:
        a, b = (job["summary"]["configs"][c]["no_fault"]["digests"] for c in ("a", base))
        return yes(len(a) == 1 and a == b) if a and b else "–"

    def moved(key: str, nd: int, unit: str, scale: float = 1.0) -> Callable[[dict[str, Any]], str]:
        return lambda job: spread(job["transfer"][key], nd, unit, scale) if "transfer" in job else "–"

    base = "b10"
    row("rank SIGKILLed", lambda job: str(job["params"]["fault_rank"]))
    row("downtime, (a) checkpointless", lambda job: spread(kill(job, "a")["downtime_s"]))
    row(
        "of it: the first step after recovery, (a)",
        lambda job: spread(kill(job, "a")["phases"]["first_step_s"]),
    )
    row("downtime, (b) torchrun + DCP, K=10", lambda job: spread(kill(job, base)["downtime_s"]))
    row("ratio (a) / (b)", lambda job: num(job["summary"]["ratios"][f"kill/{base}"]["downtime"], 3))
    row("steps redone, (a) / (b)", lambda job: f"{num(kill(job, 'a')['lost_steps']['max'], 0)} / "
        f"{num(kill(job, base)['lost_steps']['max'], 0)}")  # fmt: skip
    row("every rank's final state = fault-free run's, (a) / (b)", lambda job: f"{yes(kill(job, 'a')['digest_equal'])} / "
        f"{yes(kill(job, base)['digest_equal'])}")  # fmt: skip
    row("fault-free runs of (a) and (b) bitwise equal", same_bits)
    row("step, no fault, (a)", lambda job: step(job, "a"))
    row("step, no fault, (b)", lambda job: step(job, base))
    row("step ratio (a) / (b) (95% interval)", ratio)

    def cpu(job: dict[str, Any]) -> str:  # the whole job's CPU per step, from runs since 2026-12-07 16:00
        c = job.get("step_time", {}).get("cpu")
        if not c or not c["paired"]["n"]:
            return "–"
        ci = c["ratio"]
        interval = (
            f" ({ci['lo']:.3f}–{ci['hi']:.3f})" if ci["lo"] is not None else " (no interval: < 3 repeats)"
        )
        return (
            f"{num(c['a']['median'], 1, ' ms', 1000)} / {num(c[base]['median'], 1, ' ms', 1000)}: "
            f"{ci['geomean']:.3f}{interval}; per repeat {spread(c['paired'], 3, '')}"
        )

    row("CPU per step, whole job, (a) / (b) (95% interval)", cpu)
    row("state the spare received", moved("state_bytes", 1, " MB", 1e-6))
    row("its stream", moved("stream_mbps", 0, " MB/s"))
    row("whole transfer (collect, stream, check, restore)", moved("end_to_end_mbps", 0, " MB/s"))
    row("raw loopback TCP copy, same bytes", moved("loopback_mbps", 0, " MB/s"))
    row("stream / loopback", moved("stream_share_of_loopback", 1, "%", 100))
    return ["measure", *(label for label, _ in jobs)], rows


def t_sharded_transfer(d: dict[str, Any]) -> Table:
    s = d["summary"]
    rows = [
        ["state per shard", num(s["state_bytes"]["median"] / 1e6, 1, " MB")],
        ["transfer_s (slowest receiver)", spread(s["transfer_s"], 3)],
        ["aggregate", spread(s["aggregate_mbps"], 0, " MB/s")],
        ["loopback, 2 streams", spread(s["loopback_n_mbps"], 0, " MB/s")],
        ["share of loopback", spread(s["share_of_loopback"], 1, "%", 100)],
        ["of it: the stream (recv_s)", spread(s["receiver_recv_s"], 1, " ms", 1000)],
        ["of it: restore into FSDP2 + AdamW", spread(s["receiver_state_restore_s"], 1, " ms", 1000)],
    ]
    return ["measure", "value"], rows


def t_supervision(d: dict[str, Any]) -> Table:
    old, new = d["designs"]["old"]["median_ms_per_s"], d["designs"]["new"]["median_ms_per_s"]
    rows = [
        [k, num(old.get(k), 1), num(new[k], 1)] for k in new if old.get(k) or new[k]
    ]  # rows of 0.0 left out
    return ["process: threads", "before (`b840bd3`), ms/s", "after, ms/s"], rows


def t_wait_cost(d: dict[str, Any]) -> Table:
    rows = [
        [num(v["late_ms"], 0, " ms"), v["mode"], num(v["cpu_ms_per_wait"], 2, " ms"),
         num(v["wake_ms"], 2, " ms"), num(v["timeouts_per_wait"], 1)]
        for v in d["summary"].values()
    ]  # fmt: skip
    return ["peer late by", "wait", "CPU per wait", "wake-up", "timeouts per wait"], rows


def t_ddp_overlap(d: dict[str, Any]) -> Table:
    names = {
        "torch": "torch's DDP, plain gloo group",
        "ours": "on a resilient group (futures complete later)",
        "ours_waited": "on a resilient group, waited in the hook (before)",
    }
    rows = []
    for run in d["runs"]:
        for design, label in names.items():
            r = run["ratio_to_torch"].get(design)
            rows.append(
                [
                    f"{run['nproc']}, {run['buckets']}",
                    label,
                    spread(run["step_ms"][design], 0, " ms"),
                    ci(r) if r else "1",
                    "yes" if run["bitwise_equal"] else "NO",
                ]
            )
    return ["ranks, buckets", "DDP", "step (rank 0)", "× torch", "weights bitwise equal"], rows  # fmt: skip


def t_gpu_check(d: dict[str, Any]) -> Table:
    checks = {k: v for k, v in d.items() if k != "machine" and isinstance(v, dict)}
    passed = [k for k, v in checks.items() if v.get("ok", True)]
    c, s = d["communicator_nccl"], d["staging_cuda"]
    rows = [
        [f"checks passed: {len(passed)} of {len(checks)}", ", ".join(f"`{k}`" for k in passed)],
        ["NCCL communicator: form / rebuild", f"{num(c['form_s'], 1, ' ms', 1000)} / {num(c['rebuild_s'], 1, ' ms', 1000)}"],
        [f"staging {num(s['state_mb'], 0, ' MB')} for a copy: training thread / old synchronous copy",
         f"{num(s['staging_host_ms'], 2, ' ms')} / {num(s['old_sync_cpu_ms'], 0, ' ms')}"],
    ]  # fmt: skip
    return ["check", "result"], rows


def t_metrics_scrape(d: dict[str, Any]) -> Table:
    rows = [
        [num(r["steps"], 0), num(r["scrapes"], 0), num(r["p50_ms"], 2, " ms"), num(r["p99_ms"], 2, " ms"),
         num(r["server_cpu_per_scrape_ms"], 2, " ms"), num(r["records_held"], 0), num(r["before_ledger_per_scrape_ms"], 1, " ms")]
        for r in d["rows"]
    ]  # fmt: skip
    head = [
        "steps",
        "scrapes",
        "p50",
        "p99",
        "server CPU per scrape",
        "records held",
        "before the ledger, per scrape",
    ]
    return head, rows


def t_hf_recovery(d: dict[str, Any]) -> Table:
    s, k = d["summary"], d["params"]["save_steps"]
    rows = []
    for key, label in (
        ("checkpointless", "(a) `checkpointless run`, CheckpointlessTrainer"),
        ("torchrun", f"(b) torchrun + `resume_from_checkpoint`, `save_steps={k}`"),
    ):
        x = s["designs"][key]
        rows.append(
            [
                label,
                spread(x["downtime_s"]),
                spread(x["back_at_fault_step_s"]),
                spread(x["lost_steps"], 0, ""),
            ]
        )
    r = s["ratios"]
    rows.append(["ratio (a)/(b)", ci(r["downtime"]), ci(r["back_at_fault_step"]), "–"])
    return ["design", "downtime (kill → next step)", "back at the killed step", "steps computed again"], rows


def t_lightning_recovery(d: dict[str, Any]) -> Table:
    s = d["summary"]
    rows = []
    for key, label in (
        ("checkpointless", "(a) `checkpointless run`, CheckpointlessStrategy"),
        ("torchrun", '(b) torchrun + `ckpt_path="last"`, checkpoint every 5 steps'),
    ):
        x = s["designs"][key]
        rows.append([label, spread(x["downtime_s"]), spread(x["lost_steps"], 0, ""), str(len(x["failed"]))])
    rows.append(["ratio (a)/(b)", ci(s["ratio_downtime"]), "–", "–"])
    return ["design", "downtime (kill → next step)", "steps computed again", "runs failed outright"], rows


def t_lightning_catch_up(d: dict[str, Any]) -> Table:
    ways = d["summary"]["ways"]
    rows = []
    for step in sorted(ways["seek"], key=int):
        seek, reread = ways["seek"][step], ways["reread"][step]
        rows.append([
            f"{int(step):,}", spread(seek["catch_up_s"], 1, " ms", 1000), spread(seek["catch_up_cpu_s"], 1, " ms", 1000),
            spread(reread["catch_up_s"], 2), spread(reread["catch_up_cpu_s"], 2),
            f"{num(seek['samples_read'].get('median'), 0)} / {num(reread['samples_read'].get('median'), 0)}",
            num(seek["samples_trained"].get("median"), 0),
            str(len(seek["failed"]) + len(reread["failed"])),
        ])  # fmt: skip
    s = d["summary"]
    rows.append([
        "highest step / lowest", num(s.get("seek_high_over_low"), 2, "×"), num(s.get("seek_high_over_low_cpu"), 2, "×"),
        "–", "–", "–", "–", "–",
    ])  # fmt: skip
    rows.append([
        "re-read / seek, highest step", "–", "–", num(s.get("reread_over_seek_at_high"), 0, "×"),
        num(s.get("reread_over_seek_at_high_cpu"), 0, "×"), "–", "–", "–",
    ])  # fmt: skip
    head = ["replacement joins at step", "seek: wall", "seek: CPU", "re-read (walk): wall", "re-read: CPU",
            "samples read, seek / re-read", "samples trained", "runs failed"]  # fmt: skip
    return head, rows


def t_rank_rng(d: dict[str, Any]) -> Table:
    wall = " / ".join(num(_median(d[f"{k}_us"]), 1, " µs") for k in ("entry", "update", "commit"))
    rows = [
        ["record kept per step", f"{num(d['record_bytes'] / 1000, 1)} KB"],
        ["wall time per step (entry / update / commit)", f"{num(d['per_step_us_median'], 1, ' µs')} ({wall})"],
        ["CPU time per step (the loop less the loop without the keeping)", num(d["per_step_cpu_us_median"], 1, " µs")],
        [f"share of a {num(d['params']['step_ms'], 1, ' ms')} step (wall)", num(d["share_of_step_median"], 3, "%", 100)],
    ]  # fmt: skip
    return ["measure", "value"], rows


def _over(xs: list[float], nd: int, unit: str) -> str:
    """A list's median with its [min–max] (one value per round)."""
    return spread({"median": _median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}, nd, unit)


def t_rank_rng_lightning(d: dict[str, Any]) -> Table:
    rows = [
        ["record kept per step (generators; loader position)",
         f"{num(d['record_bytes'] / 1000, 1)} KB; {num(d['position_bytes'], 0)} B (a replacement seeks to the step)"],
        ["wall time per step (entry, first collective, update, commit)", _over(d["keep_us"], 1, " µs")],
        ["CPU time per step (the same, the training thread's)", _over(d["keep_cpu_us"], 1, " µs")],
        ["Lightning step without the keeping (wall)", _over(d["step_us_plain"], 0, " µs")],
        ["share of that step (wall, medians)", num(d["share_of_step_median"], 2, "%", 100)],
        [f"share of the overhead benchmark's {num(d['params']['step_ms'], 1, ' ms')} step",
         num(d["share_of_overhead_step"], 2, "%", 100)],
        ["the loop of the block above, timed between the fits (wall)",
         _over(d["loop_us"], 1, " µs") if d.get("loop_us") else "–"],
    ]  # fmt: skip
    return ["measure (a Lightning fit, one rank)", "value"], rows


def t_degraded_step(d: dict[str, Any]) -> Table:
    label = {
        "device4": f"4 → 3 ranks, a {num(d['params']['device_ms'], 0, ' ms')} sleep per pass for each rank's own device",
        "cpu2": "2 → 1 ranks, compute-bound pass (one rank per core)",
        "cpu4": "4 → 3 ranks, compute-bound pass on 2 cores (shared-CPU)",
    }
    rows = []
    before = (d.get("before") or {}).get("git") or "?"
    for name, w in d["workloads"].items():
        s = w["summary"]
        base, _, was = name.partition("@")
        rows.append([
            label.get(base, base) + (f" (before: git `{before}`)" if was else ""), spread(s["full_ms"], 1, " ms"), spread(s["degraded_ms"], 1, " ms"),
            spread(s["grown_back_ms"], 1, " ms"), spread(s["ratio"], 2, "×"),
            f"{num(s['ideal_ratio'], 2, '×')} / {num(s['issue_ratio'], 2, '×')}",
            spread(s["measured_over_ideal"], 2, ""), spread(s["measured_over_issue"], 2, ""),
        ])  # fmt: skip
    head = ["job", "full", "degraded", "grown back", "degraded / full", "ideal: rules / issue",
            "measured / rules ideal", "measured / issue ideal"]  # fmt: skip
    return head, rows


def t_degraded_step_phases(d: dict[str, Any]) -> Table:
    """Where a degraded step's time goes: each role's median phase times (ms), per workload."""
    roles = {"full": "full width, a rank", "holder_first": "degraded, holder's own pass (kept)",
             "holder_last": "degraded, holder's held-slot pass (reduces, updates)",
             "others": "degraded, a rank holding one slot"}  # fmt: skip
    names = ["loop", "enter", "forward", "backward", "optimizer", "sleep", "exit", "pass"]
    before = (d.get("before") or {}).get("git") or "?"
    rows = []
    for name, w in d["workloads"].items():
        s = w["summary"]
        base, _, was = name.partition("@")
        who = f"{base}, before (git `{before}`)" if was else base
        for role, ph in s.get("phases_ms", {}).items():
            # the step the pass is part of: the full one, or the degraded one and its ratio
            step = [spread(s["full_ms"], 1, ""), "1×"] if role == "full" else [
                spread(s["degraded_ms"], 1, ""), spread(s["ratio"], 2, "×")]  # fmt: skip
            rows.append([who, roles.get(role, role), *(spread(ph[k], 2, "") for k in names), *step])
    return ["library", "pass (ms)", *names, "step", "step / full"], rows


def t_degraded(d: dict[str, Any]) -> Table:
    """Two ranks lost with no spare: degraded mode against torchrun's elastic restarts."""
    s, n = d["summary"], d["params"]["nproc"]
    a, b, grow = s.get("a:two", {}), s.get("b:two", {}), s.get("a:grow", {})

    def cell(x: dict[str, Any], path: str, nd: int = 2, unit: str = " s") -> str:
        try:
            return spread(get(x, path), nd, unit)
        except (KeyError, IndexError):
            return "–"

    def both(path: str, nd: int = 2, unit: str = " s") -> list[str]:
        return [cell(a, path, nd, unit), cell(b, path, nd, unit)]

    def width(x: dict[str, Any], i: int) -> str:
        if len(x.get("widths", [])) <= i:
            return "–"
        w = x["widths"][i]
        return f"{spread(w['step_s'], 3)}, {spread(w['over_full'], 2, '×')} of full"

    def bits(x: dict[str, Any]) -> str:
        return "–" if not x else f"{sum(x['bitwise'])} of {len(x['bitwise'])} runs"

    rows = [
        ["whole job, 2 faults", *both("wall_s", 1)],
        [
            "whole job, no fault",
            cell(s.get("a:none", {}), "wall_s", 1),
            cell(s.get("b:none", {}), "wall_s", 1),
        ],
        ["time the 2 faults added", *both("added_wall_s", 1)],
    ]
    for i, (lo, hi) in enumerate(((n, n - 1), (n - 1, n - 2))):
        rows += [
            [f"downtime, fault {i + 1} ({lo} → {hi} ranks)", *both(f"faults[{i}].downtime_s")],
            [f"until the step fault {i + 1} hit is done again", *both(f"faults[{i}].back_s")],
            [f"steps redone, fault {i + 1}", *both(f"faults[{i}].redone", 0, "")],
        ]
    rows += [
        [f"step at {n} ranks", width(a, 0), width(b, 0)],
        [
            f"step at {n - 1} ranks (issue's ideal {n / (n - 1):.2f}×; (a)'s design 2×)",
            width(a, 1),
            width(b, 1),
        ],
        [f"step at {n - 2} ranks (ideal {n / (n - 2):.2f}×)", width(a, 2), width(b, 2)],
        ["final weights bitwise the fault-free run's", bits(a), bits(b)],
        ["time to shrink (1 fault, then a spare)", cell(grow, "faults[0].downtime_s"), "–"],
        ["time to grow back (last degraded commit → first full-width step)", cell(grow, "grow_gap_s"), "–"],
        ["step after growing back", width(grow, 2), "–"],
    ]
    return ["measure", "(a) checkpointless, degraded mode", "(b) torchrun elastic + DCP"], rows


# -- the blocks ----------------------------------------------------------------------------------
DEV = "the 2-vCPU development machine (shared)"
H200 = "the lent GPU machine (one NVIDIA H200, 16 cores)"


@dataclass(frozen=True)
class Block:
    key: str
    file: str  # under benchmarks/results/
    table: Callable[[dict[str, Any]], Table]
    machine: str = DEV
    command: str | None = None  # when the result file does not hold it
    date: str | None = None  # likewise


BLOCKS = [
    Block("recovery", "recovery.json", t_recovery),
    Block("overhead", "overhead.json", t_overhead),
    Block("transfer", "transfer.json", _transfer),
    Block("transfer_h200", "h200/transfer.json", _transfer, machine=H200,
          command="CHECKPOINTLESS_BACKEND=gloo python benchmarks/transfer.py --sizes 10M,100M,1G,2G"),
    Block("snapshot", "snapshot.json", t_cost_and_downtime("--snapshot-every"),
          command="python benchmarks/snapshot.py --blocks 5"),
    Block("checkpoint", "checkpoint.json", t_cost_and_downtime("--checkpoint-every"),
          command="python benchmarks/checkpoint.py --blocks 4 --every 5"),
    Block("rendezvous_scale", "rendezvous_scale.json", t_rendezvous_scale),
    Block("rendezvous_pg", "rendezvous_pg.json", t_rendezvous_pg),
    Block("rendezvous_lazy", "rendezvous_lazy.json", t_rendezvous_lazy),
    Block("host_loss", "host_loss.json", t_host_loss, command="sudo python benchmarks/host_loss.py"),
    Block("failover", "failover.json", t_failover, command="python benchmarks/failover.py --repeats 2"),
    Block("control_plane", "control_plane.json", t_control_plane),
    Block("data_first_batch", "data_first_batch.json", t_data, date="2026-11-29"),
    Block("data_job_loader", "data_job_loader.json", t_data, date="2026-12-01"),
    Block("goodput", "goodput.json", t_goodput),
    Block("sharded_overhead", "sharded_overhead.json", t_sharded_overhead),
    Block("sharded_recovery", "sharded_recovery.json", t_sharded_recovery),
    Block("sharded_transfer", "sharded_transfer.json", t_sharded_transfer),
    Block("parallel_recovery", "parallel_recovery.json", t_parallel_recovery),
    Block("supervision_cpu", "supervision_cpu.json", t_supervision, date="2026-12-03"),
    Block("wait_cost", "wait_cost.json", t_wait_cost),
    Block("ddp_overlap", "ddp_overlap.json", t_ddp_overlap),
    Block("metrics_scrape", "metrics_scrape.json", t_metrics_scrape),
    Block("hf_recovery", "hf_recovery.json", t_hf_recovery),
    Block("rank_rng", "rank_rng.json", t_rank_rng),
    Block("rank_rng_lightning", "rank_rng_lightning.json", t_rank_rng_lightning),
    Block("lightning_catch_up", "lightning_catch_up.json", t_lightning_catch_up),
    Block("degraded_step", "degraded_step.json", t_degraded_step),
    Block("degraded_step_phases", "degraded_step_ab.json", t_degraded_step_phases),
    Block("degraded", "degraded.json", t_degraded),
    Block("gpu_check", "h200/gpu_check.json", t_gpu_check, machine=H200, command="python3 benchmarks/gpu_check.py --out DIR"),
]  # fmt: skip
# calibration.json is recovery.py's second output: the measured costs the goodput simulator reads
SIDE_FILES = {"calibration.json": "recovery"}


def markdown_table(headers: list[str], rows: Rows) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _date(block: Block, d: dict[str, Any]) -> str:
    m = d.get("machine")
    raw = block.date or (m.get("date") if isinstance(m, dict) else None) or d.get("date") or "–"
    return str(raw).replace("T", " ")[:16] + (" UTC" if "T" in str(raw) else "")


def render_block(block: Block) -> str:
    d = json.loads((RESULTS / block.file).read_text())
    command = re.sub(r"\s--out\s+\S+", "", block.command or d.get("command") or "–").strip()
    m = d.get("machine")
    git = f", git `{m['git']}`" if isinstance(m, dict) and m.get("git") else ""
    head = (
        f"Result file: [benchmarks/results/{block.file}](benchmarks/results/{block.file}) · "
        f"command: `{command}` · date: {_date(block, d)}{git} · machine: {block.machine}"
    )
    return f"<!-- render:{block.key} -->\n{head}\n\n{markdown_table(*block.table(d))}"


# A block: its marker, then (once rendered) the line naming its file, a blank line and the table,
# which ends at the first line that is not a table row. A bare marker is a block to fill in.
BLOCK_RE = re.compile(r"<!-- render:(\w+) -->(?:\n[^|\n][^\n]*\n\n\|[^\n]*(?:\n\|[^\n]*)*)?")


def render(text: str) -> str:
    by_key = {b.key: b for b in BLOCKS}
    return BLOCK_RE.sub(lambda m: render_block(by_key[m.group(1)]), text)


def problems(text: str, results: Path = RESULTS) -> list[str]:
    """What is wrong with BENCHMARKS.md's ``text``: stale or missing blocks, tables outside the
    blocks, result files nobody cites, cited files that do not exist."""
    out = []
    keys = BLOCK_RE.findall(text)
    for b in BLOCKS:
        if b.key not in keys:
            out.append(f"no block for {b.key} ({b.file})")
    if (fresh := render(text)) != text:
        out.append("the rendered blocks differ from the result files: run benchmarks/render.py")
    outside = BLOCK_RE.sub("", text)
    out += [
        f"a table outside the rendered blocks: {line[:60]}"
        for line in outside.splitlines()
        if line.startswith("|")
    ]
    cited = {b.file for b in BLOCKS} | set(SIDE_FILES)
    cited |= {m for m in re.findall(r"benchmarks/results/([\w./-]+\.\w+)", fresh)}
    files = {p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file()}
    out += [f"benchmarks/results/{f} is cited nowhere" for f in sorted(files - cited)]
    out += [f"benchmarks/results/{f} is cited but does not exist" for f in sorted(cited - files)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if BENCHMARKS.md is out of date"
    )
    a = ap.parse_args(argv)
    text = DOC.read_text()
    if a.check:
        found = problems(text)
        for p in found:
            print(p)
        return 1 if found else 0
    DOC.write_text(render(text))
    left = [p for p in problems(DOC.read_text())]
    for p in left:
        print(p)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
