"""Recovery from a fault: checkpointless versus the tuned traditional path, on the example GPT.

The example job (``examples/train_gpt.py``: 4 ranks, same model, data and seed everywhere) runs
three ways in one invocation:

* (a) ``checkpointless run --nproc 4 --spares 1`` with ``--inject KIND:rank=R:step=F``;
* (b) ``torchrun --max-restarts 3`` running ``benchmarks/baseline/train_ddp_ckpt.py`` (gloo DDP,
  torch.distributed.checkpoint every K steps, reload on restart, exact data resume), once per K;
* (c) each of them without a fault.

For every fault kind (exception, SIGKILL, hang) and every repeat it measures, from the per-rank
commit logs and the launchers' own records: the downtime from the fault to the next step
completed on every rank and its parts (detection, abort, rebuild, state transfer, first batch,
first step), the steps that had been completed and had to be computed again, the time until the
job has again completed the step the fault hit, the job time added over (c) of the same design,
and whether the final weights are bitwise those of (c) (the log readers are benchmarks/_harness/downtime.py's,
shared with benchmarks/sharded_recovery.py). It prints tables, writes
``benchmarks/results/recovery.json`` (and prints its Markdown report), and the measured costs the goodput
simulator reads (``benchmarks/results/calibration.json``).

    .venv/bin/python benchmarks/recovery.py            # 3 repeats x 3 kinds x (a, K=10, K=50) + (c): 36 jobs
    .venv/bin/python benchmarks/recovery.py --quick    # smoke run: SIGKILL only, K=10, 1 repeat (4 jobs)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "baseline"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl
from _harness.downtime import (
    KIND_LABEL,
    KINDS,
    PHASE_LABEL,
    PHASES,
    Config,
    RunRecord,
    inject_spec,
    read_run,
    run_rows,
    schedule,
)


# -- launching ---------------------------------------------------------------------------------
def model_args(a: argparse.Namespace) -> list[str]:
    return [
        "--steps", str(a.steps), "--dim", str(a.dim), "--layers", str(a.layers), "--heads", str(a.heads),
        "--seq-len", str(a.seq_len), "--seed", str(a.seed),
    ]  # fmt: skip


def launch(a: argparse.Namespace, cfg: Config, kind: str, run_dir: Path) -> bl.Finished:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = bl.bench_env(a.threads)
    digest = str(run_dir / "digest")
    if cfg.design == "checkpointless":
        port_base = 40000 + (os.getpid() * 7 + len(str(run_dir))) % 40 * 200
        cmd = [
            bl.PYTHON, "-m", "checkpointless", "run", "--nproc", str(a.nproc), "--spares", str(a.spares),
            "--run-dir", str(run_dir), "--hang-timeout", str(a.hang_timeout),
            "--port-base", str(port_base), "--port-range", "200",
            *inject_spec(a, kind), str(bl.EXAMPLE), *model_args(a),
            *bl.example_batch_args(a.global_batch, a.nproc), "--digest-out", digest,
        ]  # fmt: skip
    else:
        cmd = [
            bl.TORCHRUN, "--nproc-per-node", str(a.nproc), "--max-restarts", "3",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{bl.free_port()}",
            str(bl.BASELINE), *model_args(a), "--global-batch", str(a.global_batch),
            "--ckpt-every", str(cfg.ckpt_every), "--log-dir", str(run_dir),
            "--hang-timeout", str(a.hang_timeout), *inject_spec(a, kind), "--digest-out", digest,
        ]  # fmt: skip
    return bl.run_job(cmd, run_dir, timeout=a.run_timeout, env=env)


# -- the benchmark -----------------------------------------------------------------------------
def collect(a: argparse.Namespace, cfg: Config, kind: str, repeat: int, work: Path) -> RunRecord:
    run_dir = work / f"{cfg.key}-{kind}-{repeat}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    fin = launch(a, cfg, kind, run_dir)
    return read_run(cfg, kind, repeat, fin, run_dir, fault_step=a.fault_step, run_timeout=a.run_timeout)


def aggregate(a: argparse.Namespace, runs: list[RunRecord], configs: list[Config]) -> dict[str, Any]:
    ok = [r for r in runs if r.error is None]
    ref_batches: dict[str, str] = {}
    for r in ok:
        if r.kind == "none":
            for k, v in r.metrics.get("batches", {}).items():
                ref_batches.setdefault(k, v)
    out: dict[str, Any] = {"configs": {}, "ratios": {}}
    for cfg in configs:
        clean = [r for r in ok if r.config == cfg and r.kind == "none"]
        clean_digests = sorted({r.metrics.get("digest") for r in clean} - {None})
        c_wall = bl.summary([r.wall_s for r in clean])
        c_span = bl.summary([r.metrics.get("span_s") for r in clean])
        entry: dict[str, Any] = {
            "label": cfg.label,
            "no_fault": {
                "wall_s": c_wall,
                "span_s": c_span,
                "step_s": bl.summary([r.metrics.get("normal_step_s") for r in clean]),
                "digests": clean_digests,
                "start_s": bl.summary([r.metrics.get("start_s") for r in clean]),
                "launch_to_first_step_s": bl.summary(
                    [r.metrics.get("launch_to_first_step_s") for r in clean]
                ),
                "save_s": bl.summary([s for r in clean for s in r.metrics.get("save_s", [])]),
            },
            "kinds": {},
        }
        for kind in a.kinds:
            rs = [r for r in ok if r.config == cfg and r.kind == kind]
            failed = [r for r in runs if r.config == cfg and r.kind == kind and r.error is not None]
            ph = {p: bl.summary([r.metrics["phases"].get(p) for r in rs]) for p in PHASES}
            digest_eq = [r.metrics.get("digest") in clean_digests and len(clean_digests) == 1 for r in rs]
            data_eq = [
                all(ref_batches.get(k, v) == v for k, v in r.metrics.get("batches", {}).items()) for r in rs
            ]
            extra_first = [
                r.metrics["phases"]["first_step_s"] - r.metrics["normal_step_s"]
                for r in rs
                if r.metrics.get("normal_step_s") is not None
            ]
            entry["kinds"][kind] = {
                "n": len(rs),
                "failed": [f"#{r.repeat}: {r.error}" for r in failed],
                "downtime_s": bl.summary([r.metrics["downtime_s"] for r in rs]),
                "phases": ph,
                "first_step_extra_s": bl.summary(extra_first),
                "lost_steps": bl.summary([r.metrics["lost_steps"] for r in rs]),
                "back_at_fault_step_s": bl.summary([r.metrics.get("back_s") for r in rs]),
                "wall_s": bl.summary([r.wall_s for r in rs]),
                "added_wall_s": bl.summary(
                    [r.wall_s - c_wall["median"] for r in rs] if c_wall["median"] is not None else []
                ),
                "added_span_s": bl.summary(
                    [r.metrics["span_s"] - c_span["median"] for r in rs if "span_s" in r.metrics]
                    if c_span["median"] is not None
                    else []
                ),
                "digest_equal": all(digest_eq) if rs else None,
                "data_exact": all(data_eq) if rs else None,
                "replaced": [r.metrics.get("replaced") for r in rs],
                "spare_assign_delay_s": bl.summary([r.metrics.get("spare_assign_delay_s") for r in rs]),
                "state_bytes": bl.summary([r.metrics.get("state_bytes") for r in rs]),
                "ckpt_load_s": bl.summary([r.metrics.get("ckpt_load_s") for r in rs]),
                "rebuild_parts": {
                    k: bl.summary([r.metrics.get("rebuild_parts", {}).get(k) for r in rs])
                    for k in ("start_and_imports_s", "init_pg_s", "build_s")
                },
                "torchrun_detected": [r.metrics.get("torchrun_detected") for r in rs],
            }
        out["configs"][cfg.key] = entry
    out["ratios"] = ratios(a, out["configs"], configs)
    return out


def ratios(a: argparse.Namespace, summ: dict[str, Any], configs: list[Config]) -> dict[str, Any]:
    """(a)/(b) of the medians; none where either median is not positive (a difference that is
    below the run-to-run noise, such as a negative added job time, has no meaningful ratio)."""
    out: dict[str, Any] = {}
    cl = summ.get("a")
    for cfg in configs:
        if cfg.design != "torchrun" or cl is None:
            continue
        for kind in a.kinds:
            ka, kb = cl["kinds"][kind], summ[cfg.key]["kinds"][kind]

            def ratio(metric: str, ka: dict[str, Any] = ka, kb: dict[str, Any] = kb) -> float | None:
                x, y = ka[metric]["median"], kb[metric]["median"]
                return x / y if x is not None and y is not None and x > 0 and y > 0 else None

            out[f"{kind}/{cfg.key}"] = {
                "kind": kind,
                "baseline": cfg.key,
                "downtime": ratio("downtime_s"),
                "back_at_fault_step": ratio("back_at_fault_step_s"),
                "added_span": ratio("added_span_s"),
                "added_wall": ratio("added_wall_s"),
            }
    return out


def calibration(a: argparse.Namespace, agg: dict[str, Any]) -> dict[str, Any]:
    """The measured medians the goodput simulator reads (see simulate/calibration.py).

    Only keys of that module's Calibration (plus transfer_bytes) are set; everything else measured
    goes in as ``_`` notes. Costs are clamped at 0 (the simulator refuses negative costs).
    """
    cl = agg["configs"].get("a")
    tr = [agg["configs"][k] for k in agg["configs"] if k != "a"]
    crash = [k for k in ("raise", "kill") if k in a.kinds]

    def med(values: list[float | None], clamp: bool = True) -> float | None:
        xs = [v for v in values if v is not None]
        if not xs:
            return None
        m = statistics.median(xs)
        return round(max(0.0, m) if clamp else m, 4)

    out: dict[str, Any] = {
        "_source": f"benchmarks/recovery.py: {a.nproc} CPU ranks, gloo, loopback, one machine; medians over "
        f"{', '.join(crash)} faults, {a.repeats} repeats each",
        "_date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    if cl is not None and crash:
        ph = lambda p: [cl["kinds"][k]["phases"][p]["median"] for k in crash]  # noqa: E731
        out["detect_s"] = med(ph("detect_s"))
        out["_detect_note"] = (
            "checkpointless launcher's detection (the traditional path's own is in recovery.json)"
        )
        out["abort_s"] = med(ph("abort_s"))
        out["rebuild_s"] = med(ph("rebuild_s"))
        out["first_step_s"] = med([cl["kinds"][k]["first_step_extra_s"]["median"] for k in crash])
        out["_first_step_note"] = "first step after recovery minus a normal step"
        out["_other_s"] = med(ph("other_s"), clamp=False)
        if "kill" in crash:
            out["_job_transfer_s"] = med([cl["kinds"]["kill"]["phases"]["transfer_s"]["median"]])
            out["_job_transfer_bytes"] = cl["kinds"]["kill"]["state_bytes"]["median"]
    # The job's own state is ~10 MB, where fixed costs dominate; the bandwidth the simulator
    # scales with comes from the transfer benchmark's largest size when it has been run.
    tj = bl.RESULTS / "transfer.json"
    big = None
    if tj.exists():
        try:
            big = max(json.loads(tj.read_text())["summary"], key=lambda p: p["size"])
        except (ValueError, KeyError, TypeError):
            big = None
    # a replacement is a promoted spare: its model exists, and its optimizer state lands in the
    # arena it paged in while waiting (older result files name the single path "e2e_s")
    e2e = (big.get("spare_e2e_s") or big.get("e2e_s")) if big is not None else None
    if big is not None and e2e and e2e["median"]:
        out["transfer_s"] = round(e2e["median"], 4)
        out["transfer_bytes"] = big["bytes"]
        out["_transfer_note"] = "benchmarks/transfer.py, largest size, end to end into a promoted spare"
    elif out.get("_job_transfer_s") and out.get("_job_transfer_bytes"):
        out["transfer_s"] = out["_job_transfer_s"]
        out["transfer_bytes"] = out["_job_transfer_bytes"]
        out["_transfer_note"] = (
            "the job's own state transfer (run benchmarks/transfer.py for a bandwidth figure)"
        )
    if tr and crash:
        parts = lambda k: [c["kinds"][x]["rebuild_parts"][k]["median"] for c in tr for x in crash]  # noqa: E731
        start, build = med(parts("start_and_imports_s")), med(parts("build_s"))
        if start is not None and build is not None:
            out["restart_s"] = round(start + build, 4)
            out["_restart_note"] = "torchrun: process start + import torch, then model + DDP + AdamW"
        out["_init_pg_s"] = med(parts("init_pg_s"))
        out["_torchrun_detect_s"] = med(
            [c["kinds"][k]["phases"]["detect_s"]["median"] for c in tr for k in crash]
        )
        out["_torchrun_teardown_s"] = med(
            [c["kinds"][k]["phases"]["abort_s"]["median"] for c in tr for k in crash]
        )
        out["_ckpt_load_s"] = med([c["kinds"][k]["ckpt_load_s"]["median"] for c in tr for k in crash])
    saves = [s for c in tr for s in c["no_fault"]["save_s"]["values"]]
    if saves:
        out["save_s"] = round(statistics.median(saves), 4)
        out["_save_note"] = "blocking torch.distributed.checkpoint save of model + AdamW + scheduler + RNG"
    if "hang" in a.kinds:
        out["_hang_timeout_used_s"] = a.hang_timeout
    return {k: v for k, v in out.items() if v is not None}


# -- reporting ---------------------------------------------------------------------------------
def report_tables(a: argparse.Namespace, agg: dict[str, Any], configs: list[Config]) -> str:
    parts = []
    rows = []
    for kind in a.kinds:
        for cfg in configs:
            k = agg["configs"][cfg.key]["kinds"][kind]
            if k["n"] == 0:
                rows.append([KIND_LABEL[kind], cfg.label, "all runs failed", *[""] * 11])
                continue
            ph = k["phases"]
            rows.append(
                [
                    KIND_LABEL[kind],
                    cfg.label,
                    bl.fmt_spread(k["downtime_s"]),
                    *[bl.fmt(ph[p]["median"]) for p in PHASES],
                    bl.fmt_spread(k["lost_steps"], 0),
                    bl.fmt_spread(k["back_at_fault_step_s"]),
                    bl.fmt_spread(k["added_span_s"]),
                    "yes" if k["digest_equal"] else "NO",
                    f"{k['n']}" + (f" ({len(k['failed'])} failed)" if k["failed"] else ""),
                ]
            )
    headers = [
        "fault", "design", "downtime s [min-max]", *[PHASE_LABEL[p] for p in PHASES],
        "lost steps", "back at fault step s", "job time vs (c) s", "weights == (c)", "n",
    ]  # fmt: skip
    parts.append(table_title("Downtime (fault -> next step completed on every rank), medians of repeats"))
    parts.append(bl.table(headers, rows))
    rrows = []
    for key, r in agg["ratios"].items():
        rrows.append(
            [KIND_LABEL[r["kind"]], f"(a) / K={key.split('/b')[1]}", bl.fmt(r["downtime"], 3),
             bl.fmt(r["back_at_fault_step"], 3), bl.fmt(r["added_span"], 3)]
        )  # fmt: skip
    if rrows:
        parts.append(table_title("Ratios (a)/(b) of the medians"))
        parts.append(bl.table(["fault", "ratio", "downtime", "back at fault step", "job time vs (c)"], rrows))
    crows = []
    for cfg in configs:
        nf = agg["configs"][cfg.key]["no_fault"]
        crows.append(
            [cfg.label, bl.fmt_spread(nf["wall_s"], 1), bl.fmt_spread(nf["launch_to_first_step_s"], 1),
             bl.fmt_spread(nf["span_s"], 1), bl.fmt_spread(nf["step_s"], 3),
             bl.fmt_spread(nf["save_s"], 3), ", ".join(d[:12] for d in nf["digests"]) or "-"]
        )  # fmt: skip
    parts.append(table_title("(c) No fault"))
    headers_c = ["design", "launch->exit s", "launch->1st step s", "1st->last step s", "step s", "save s"]
    parts.append(bl.table([*headers_c, "final weights"], crows))
    return "\n\n".join(parts)


def table_title(text: str) -> str:
    return f"### {text}"


def write_markdown(
    a: argparse.Namespace, agg: dict[str, Any], tables: str, info: dict[str, Any], notes: list[str], cmd: str
) -> None:
    lines = [
        "# Recovery: checkpointless versus torchrun + checkpoints",
        "",
        f"- Command: `{cmd}`",
        f"- Date: {info['date']}; took {info['bench_wall_s'] / 60:.1f} min",
        f"- Machine: {info['cpu_model']}, {info['nproc']} CPUs, {info['mem_total_gib']} GiB; "
        f"Python {info['python']}, torch {info['torch']}",
        f"- Load: {info['load_note']}",
        f"- Source tree: git {info.get('git') or 'unknown'}",
        f"- Job: examples/train_gpt.py, {a.nproc} ranks, {a.steps} steps, dim {a.dim}, {a.layers} layers, "
        f"{a.heads} heads, seq {a.seq_len}, global batch {a.global_batch}, seed {a.seed}; "
        f"OMP_NUM_THREADS={a.threads} for every process of both designs",
        f"- Fault: rank {a.fault_rank} as it begins step {a.fault_step}; hang timeout {a.hang_timeout:g} s on "
        "both sides (checkpointless --hang-timeout; the baseline's gloo collective timeout)",
        f"- (a) `checkpointless run --nproc {a.nproc} --spares {a.spares}`; (b) `torchrun --max-restarts 3` "
        f"running benchmarks/baseline/train_ddp_ckpt.py with K in {a.ckpt_every}; (c) each without a fault. "
        f"{a.repeats} repeats, runs interleaved.",
        "",
        "Definitions: *downtime* runs from the moment the fault fired (the faulty rank's own clock, just "
        "before it raises, is killed or stops) to the first step committed after it on every rank. "
        "*detect*: until the launcher (checkpointless) or torchrun's agent (first teardown line in its "
        "log) knew; *abort*: checkpointless, until every survivor had left the step and reported; "
        "torchrun, teardown of all processes, rendezvous and spawn of the new ones; *rebuild*: "
        "checkpointless, forming the new process group; torchrun, interpreter start + import torch + "
        "init_process_group + model/DDP/AdamW; *state*: checkpointless, collecting the state and the "
        "verified peer transfer (layout, stream, XXH3 check, load_state_dict), slowest rank; torchrun, "
        "DCP checkpoint load; *1st batch*: from the start of the first step to the batch being in the "
        "model (checkpointless: the slowest rank, timed by the job at the model's first forward; "
        "torchrun: the resumed DataLoader's first batch); *1st step*: the rest of that step; *other*: "
        "the rest (messages, waits). "
        "*Lost steps*: steps that had been committed before the fault and were committed again. "
        "*Back at fault step*: fault to the step the fault hit being committed on every rank. "
        "*Job time vs (c)*: first-to-last committed step, minus the median of (c) of the same design. "
        "Medians with [min-max] over repeats.",
        "",
        tables,
        "",
        "## Notes",
        "",
        *[f"- {n}" for n in notes],
        "",
        "Raw per-run numbers: `benchmarks/results/recovery.json`. Simulator calibration: "
        "`benchmarks/results/calibration.json`.",
        "",
    ]
    print("\n".join(lines))  # the result file is the JSON; BENCHMARKS.md renders from it


def build_notes(a: argparse.Namespace, agg: dict[str, Any], runs: list[RunRecord]) -> list[str]:
    notes = []
    for key, r in agg["ratios"].items():
        if r["kind"] in ("raise", "kill") and r["downtime"] is not None:
            verdict = "met" if r["downtime"] <= 0.1 else "NOT met"
            notes.append(f"Expected downtime ratio (a)/(b) <= 0.1 for {KIND_LABEL[r['kind']]} vs {key.split('/')[1]}: "
                         f"{r['downtime']:.3f} ({verdict}).")  # fmt: skip
    cl = agg["configs"].get("a")
    if cl is not None:
        lost = [cl["kinds"][k]["lost_steps"]["max"] for k in a.kinds if cl["kinds"][k]["n"]]
        if lost:
            notes.append(f"Expected 0 lost steps for checkpointless: max over runs {max(lost):.0f} "
                         f"({'met' if max(lost) == 0 else 'NOT met'}).")  # fmt: skip
    for c in agg["configs"].values():
        for kind, k in c["kinds"].items():
            if k["n"] and not k["digest_equal"]:
                notes.append(f"{c['label']} {KIND_LABEL[kind]}: final weights differ from (c).")
            if k["n"] and not k["data_exact"]:
                notes.append(f"{c['label']} {KIND_LABEL[kind]}: some step ran on a different batch than (c).")
            if k["failed"]:
                notes.append(f"{c['label']} {KIND_LABEL[kind]}: failed runs: {'; '.join(k['failed'])}.")
        if len(c["no_fault"]["digests"]) > 1:
            notes.append(f"{c['label']}: the no-fault runs themselves ended with different weights.")
    if "hang" in a.kinds:
        notes.append(
            "Hang on the traditional path: the survivors' all-reduce fails after the gloo timeout, torchrun "
            "sends SIGTERM to every worker and waits; a stopped (SIGSTOP) process does not act on SIGTERM, so "
            "the restart waits out the agent's 30 s grace before SIGKILL (in torch 2.13 "
            "LocalElasticAgent._stop_workers calls _shutdown() with its default timeout; --shutdown-timeout "
            "does not apply to restarts). That wait is the 'abort' column."
        )
    notes.append(
        "The baseline resets its gloo timeout to the hang timeout only after the first step of each start "
        "(torch.distributed.distributed_c10d._set_pg_timeout), so a slow start on this shared machine is not "
        "taken for a hang; before that it uses 120 s."
    )
    resume = ", ".join(
        f"K={k} resumes from step {a.fault_step // k * k}"
        + (" (no checkpoint yet: from scratch)" if a.fault_step < k else "")
        + f" and recomputes {a.fault_step - a.fault_step // k * k}"
        for k in a.ckpt_every
    )
    notes.append(f"Fault at step {a.fault_step} of {a.steps}: {resume}.")
    late = [
        f"{KIND_LABEL[r.kind]} #{r.repeat} ({r.metrics['spare_assign_delay_s']:.1f} s)"
        for r in runs
        if r.config.design == "checkpointless" and (r.metrics.get("spare_assign_delay_s") or 0.0) > 0.2
    ]
    if late:
        notes.append(
            "In some checkpointless runs the spare was not ready yet when the fault hit, and the recovery "
            f"waited for it to finish starting: {', '.join(late)}."
        )
    total = sum(r.wall_s for r in runs)
    tr_hang = sum(r.wall_s for r in runs if r.kind == "hang" and r.config.design == "torchrun")
    if total > 0:
        notes.append(
            f"Time: {len(runs)} job launches took {total / 60:.1f} min of job wall time, "
            f"{100 * tr_hang / total:.0f}% of it in the torchrun hang runs (each waits out the 30 s teardown); "
            "job start-up (import torch in every process) is most of the rest."
        )
    spans = [c["no_fault"]["span_s"] for c in agg["configs"].values() if c["no_fault"]["span_s"]["n"]]
    if spans:
        widest = max(x["max"] - x["min"] for x in spans)
        notes.append(
            f"'Job time vs (c)' compares against (c)'s median, whose own first-to-last-step time varies by up to "
            f"{widest:.1f} s between repeats on this shared machine, so it resolves the traditional path's cost "
            "but not checkpointless's sub-second one (negative values are that noise; their ratios are left "
            "out). For checkpointless it also contains the slower steps while the replacement spare for the "
            "next fault starts (imports torch) on the same 2 cores."
        )
    steps = {k: c["no_fault"]["step_s"]["median"] for k, c in agg["configs"].items()}
    if steps.get("a") is not None and any(v is not None for k, v in steps.items() if k != "a"):
        other = [v for k, v in steps.items() if k != "a" and v is not None]
        notes.append(
            f"Normal step time in (c): checkpointless {steps['a']:.3f} s, torchrun DDP {min(other):.3f}-"
            f"{max(other):.3f} s. With {a.nproc} ranks on {os.cpu_count()} cores the ranks share cores; "
            "benchmarks/overhead.py measures this steady-state difference on its own."
        )
    starts = {k: c["no_fault"]["launch_to_first_step_s"]["median"] for k, c in agg["configs"].items()}
    if starts.get("a") is not None and any(v is not None for k, v in starts.items() if k != "a"):
        other = min(v for k, v in starts.items() if k != "a" and v is not None)
        notes.append(
            f"Start-up without faults (launch to first step): checkpointless {starts['a']:.1f} s (every worker "
            f"imports torch and warms up AdamW before generation 0 forms) versus torchrun {other:.1f} s."
        )
    if any(
        r.metrics.get("torchrun_detected") is False
        for r in runs
        if r.config.design == "torchrun" and r.kind != "none"
    ):
        notes.append(
            "Some torchrun runs had no teardown line in the agent's log: their detection is folded into 'abort'."
        )
    return notes


def summarize(
    a: argparse.Namespace,
    runs: list[RunRecord],
    configs: list[Config],
    notes_of: Callable[[argparse.Namespace, dict[str, Any], list[RunRecord]], list[str]],
    info: dict[str, Any],
    load0: tuple[float, float, float],
    t0: float,
) -> tuple[dict[str, Any], str, list[str]]:
    """After the runs (here and in sharded_recovery.py): the machine's wall time and load into
    ``info``, the aggregate, its tables and the notes (each benchmark writes its own), printed."""
    info["bench_wall_s"] = time.monotonic() - t0
    info["load_note"] = bl.load_note(load0, os.getloadavg())
    agg = aggregate(a, runs, configs)
    tables = report_tables(a, agg, configs)
    notes = notes_of(a, agg, runs)
    print()
    print(tables)
    print()
    for n in notes:
        print(f"- {n}")
    return agg, tables, notes


def report_only() -> int:
    saved = json.loads((bl.RESULTS / "recovery.json").read_text())
    a = argparse.Namespace(**saved["params"])
    configs = [Config("a", "checkpointless")] + [Config(f"b{k}", "torchrun", k) for k in a.ckpt_every]
    by_key = {c.key: c for c in configs}
    runs = [
        RunRecord(by_key[r["config"]], r["kind"], r["repeat"], r["rc"], r["wall_s"], r["metrics"], r["error"])
        for r in saved["runs"]
    ]
    agg = saved["summary"]
    agg["ratios"] = ratios(a, agg["configs"], configs)
    tables = report_tables(a, agg, configs)
    notes = build_notes(a, agg, runs)
    saved["notes"] = notes
    bl.write_json(bl.RESULTS / "recovery.json", saved)
    write_markdown(a, agg, tables, saved["machine"], notes, saved["command"])
    bl.write_json(bl.RESULTS / "calibration.json", calibration(a, agg))
    print(tables)
    print(f"\nrewrote {bl.RESULTS / 'calibration.json'}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 1 repeat, K=10, SIGKILL only, 18 steps, fault at 15"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--kinds", help="comma-separated subset of raise,kill,hang (default all three; --quick: kill)"
    )
    ap.add_argument("--ckpt-every", default="10,50", help="checkpoint intervals K of the baseline")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument(
        "--fault-step",
        type=int,
        default=75,
        help="default 75: K/2 steps after a checkpoint for K=10 and K=50, and late enough that the hot "
        "spare (started once generation 0 has formed) is ready",
    )
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="same value for both designs")
    bl.add_model_args(ap)
    ap.add_argument("--run-timeout", type=float, default=420.0, help="limit per job run, seconds")
    ap.add_argument("--work-dir", help="keep the run directories here (default: a temporary dir, removed)")
    ap.add_argument("--out", help="JSON output (default results/recovery.json; --quick: recovery-quick.json)")
    ap.add_argument("--no-calibration", action="store_true", help="do not write calibration.json")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: print the report and rewrite calibration.json from results/recovery.json "
        "(and the current transfer.json)",
    )
    a = ap.parse_args()
    if a.report_only:
        return report_only()
    if a.quick:
        a.repeats, a.ckpt_every, a.steps, a.fault_step = 1, "10", 18, 15
        a.kinds = a.kinds or "kill"
    a.kinds = a.kinds or ",".join(KINDS)
    if a.out is None:
        a.out = str(bl.RESULTS / ("recovery-quick.json" if a.quick else "recovery.json"))
    a.kinds = [k for k in a.kinds.split(",") if k]
    for k in a.kinds:
        if k not in KINDS:
            ap.error(f"unknown fault kind {k!r}; choose from {','.join(KINDS)}")
    a.ckpt_every = [int(x) for x in str(a.ckpt_every).split(",") if x]
    if not 0 < a.fault_step < a.steps:
        ap.error("--fault-step must be inside the job (0 < fault-step < steps)")

    configs = [Config("a", "checkpointless")] + [Config(f"b{k}", "torchrun", k) for k in a.ckpt_every]
    cmd = "python benchmarks/recovery.py " + shlex.join(sys.argv[1:])
    info = bl.machine_info()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="cl-bench-recovery-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: list[RunRecord] = []
    n_total = a.repeats * len(configs) * (1 + len(a.kinds))
    print(f"recovery benchmark: {n_total} job runs in {work}", flush=True)
    try:
        with bl.cleanup_on_exit(), bl.run_bar(n_total, "recovery") as bar:
            for rep, kind, cfg in schedule(a.repeats, ["none", *a.kinds], configs):
                runs.append(collect(a, cfg, kind, rep, work))
                bar.update()
    except KeyboardInterrupt:
        print("interrupted; all job processes were stopped", file=sys.stderr)
        return 130
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    agg, tables, notes = summarize(a, runs, configs, build_notes, info, load0, t0)
    params = {k: v for k, v in vars(a).items() if k not in ("out",)}
    result = {
        "benchmark": "recovery",
        "command": cmd,
        "machine": info,
        "params": params,
        "summary": agg,
        "notes": notes,
        "runs": run_rows(runs),
    }
    bl.write_json(Path(a.out), result)
    if Path(a.out).resolve() == (bl.RESULTS / "recovery.json").resolve():
        write_markdown(a, agg, tables, info, notes, cmd)
        if not a.no_calibration and not a.quick:
            bl.write_json(bl.RESULTS / "calibration.json", calibration(a, agg))
    print(f"\nwrote {a.out}" + ("" if a.quick else " and calibration.json"))
    return 0 if all(r.error is None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
