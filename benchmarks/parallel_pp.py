"""The pipeline-parallel job of benchmarks/parallel_recovery.py: its two designs' commands and notes.

``tests/scripts/pp_mlp.py --schedule 1f1b`` (the PP job of tests/e2e/test_pp_e2e.py): an MLP cut
in two ``PipelineStage``s over "pp", ``Schedule1F1B`` over 4 microbatches, two replicas over "dp"
averaging their gradients; 2 x 2 = 4 ranks, rank r is (dp, pp) = (r // 2, r % 2).

* (a) ``checkpointless run --nproc 4 --spares 1``: the kill aborts every stage's schedule, a hot
  spare takes the killed rank and receives its stage (module and AdamW state) from the rank that
  holds the same stage in the other replica, and the step is replayed;
* (b) ``torchrun --max-restarts 3 benchmarks/baseline/train_pp_ckpt.py``: the same stages,
  schedule, batches and optimizer on plain gloo, each rank's stage saved by DCP every K steps;
  the kill makes torchrun restart every worker from the newest checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import _harness as bl
import parallel_measure as pm
import shardlib as sl
from _harness import downtime as dt
from sharded_recovery import kill_notes

__all__ = ["PP", "build_notes", "launch"]

PP_MLP = bl.REPO / "tests" / "scripts" / "pp_mlp.py"
BASELINE = bl.REPO / "benchmarks" / "baseline" / "train_pp_ckpt.py"
PP = 2  # stages; rank r holds stage r % PP of replica r // PP


def command(a: argparse.Namespace, cfg: dt.Config, kind: str, run_dir: Path) -> list[str]:
    inject = dt.inject_spec(a, kind)
    job = [
        "--steps",
        str(a.steps),
        "--hidden",
        str(a.pp_hidden),
        "--digest-out",
        str(run_dir / "digest.{rank}"),
    ]
    if cfg.design == "checkpointless":
        return [
            bl.PYTHON, "-m", "checkpointless", "run", "--nproc", str(a.nproc), "--spares", str(a.spares),
            "--run-dir", str(run_dir), "--port-base", str(sl.port_base(run_dir)), "--port-range", "200",
            "--hang-timeout", str(a.hang_timeout), *inject, str(PP_MLP), "--schedule", "1f1b", *job,
        ]  # fmt: skip
    return [
        bl.TORCHRUN, "--nproc-per-node", str(a.nproc), "--max-restarts", "3", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{bl.free_port()}", str(BASELINE), "--ckpt-every", str(cfg.ckpt_every),
        "--log-dir", str(run_dir), "--hang-timeout", str(a.hang_timeout), *inject, *job,
    ]  # fmt: skip


def launch(a: argparse.Namespace, cfg: dt.Config, kind: str, run_dir: Path) -> bl.Finished:
    return pm.launch_sampled(command(a, cfg, kind, run_dir), run_dir, a, kind)


def build_notes(a: argparse.Namespace, agg: dict[str, Any], runs: list[dt.RunRecord]) -> list[str]:
    return kill_notes(
        a,
        agg,
        runs,
        holds=f"rank r holds stage r % {PP} of replica r // {PP}: a source must hold the same stage.",
        killed=f" (stage {a.fault_rank % PP})",
    )
