"""Helpers shared by the sharded benchmarks (sharded_overhead.py, sharded_recovery.py,
sharded_transfer.py): the mesh argument, the two launch commands for one FSDP2/HSDP job, and the
per-rank shard digests folded into one.

The same job runs two ways: ``checkpointless run ... examples/train_gpt.py --fsdp R,S`` (our
launcher, resilient groups under torch's ``fully_shard``) and ``torchrun
benchmarks/baseline/train_fsdp_ckpt.py --fsdp R,S`` (torch's own gloo groups from
``init_device_mesh``, optional DCP checkpoints). Both log per-rank ``commit`` events into
``<run_dir>/rank-<r>.jsonl`` and write one shard digest per rank, so everything downstream
(step times, downtime, bitwise checks) reads both the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
from pathlib import Path

import _harness as bl

__all__ = [
    "FSDP_BASELINE",
    "add_model_args",
    "buddy_flag_known",
    "checkpointless_command",
    "combine_digests",
    "model_args",
    "parse_mesh",
    "port_base",
    "torchrun_command",
]

FSDP_BASELINE = bl.BENCH / "baseline" / "train_fsdp_ckpt.py"


def parse_mesh(text: str) -> tuple[int, int]:
    """``R,S`` (or ``RxS``) -> (R, S), or a ValueError naming the bad value and the form."""
    parts = text.replace("x", ",").replace("X", ",").split(",")
    try:
        r, s = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"bad mesh {text!r}: use R,S such as 2,2 (HSDP) or 1,2 (FSDP)") from None
    if r < 1 or s < 1:
        raise ValueError(f"bad mesh {text!r}: R and S must be at least 1")
    return r, s


add_model_args = bl.add_model_args  # the example GPT's size flags, as every benchmark takes them


def model_args(a: argparse.Namespace, mesh: tuple[int, int]) -> list[str]:
    return [
        "--steps", str(a.steps), "--dim", str(a.dim), "--layers", str(a.layers), "--heads", str(a.heads),
        "--seq-len", str(a.seq_len), "--seed", str(a.seed), "--global-batch", str(a.global_batch),
        "--fsdp", f"{mesh[0]},{mesh[1]}",
    ]  # fmt: skip


def port_base(run_dir: Path) -> int:
    # a window of 200 ports per run, spread by pid so that two benchmarks at once rarely collide
    return 40000 + (os.getpid() * 11 + len(str(run_dir))) % 40 * 200


def checkpointless_command(
    a: argparse.Namespace,
    mesh: tuple[int, int],
    run_dir: Path,
    *,
    spares: int,
    launcher_args: list[str] | None = None,
) -> list[str]:
    return [
        bl.PYTHON, "-m", "checkpointless", "run", "--nproc", str(mesh[0] * mesh[1]), "--spares", str(spares),
        "--run-dir", str(run_dir), "--port-base", str(port_base(run_dir)), "--port-range", "200",
        *(launcher_args or []), str(bl.EXAMPLE), *model_args(a, mesh),
        "--digest-out", str(run_dir / "digest.{rank}"),
    ]  # fmt: skip


def plain_command(a: argparse.Namespace, mesh: tuple[int, int], run_dir: Path) -> list[str]:
    """The torchrun baseline's script, unchanged, under ``checkpointless run --plain``: our launcher
    and root-less rendezvous, none of our code in the training loop."""
    return [
        bl.PYTHON, "-m", "checkpointless", "run", "--plain", "--nproc", str(mesh[0] * mesh[1]),
        "--max-restarts", "0", "--run-dir", str(run_dir / "launcher"), "--port-base", str(port_base(run_dir)),
        "--port-range", "200", str(FSDP_BASELINE), *model_args(a, mesh), "--ckpt-every", "0",
        "--log-dir", str(run_dir), "--digest-out", str(run_dir / "digest.{rank}"),
    ]  # fmt: skip


def torchrun_command(
    a: argparse.Namespace,
    mesh: tuple[int, int],
    run_dir: Path,
    *,
    ckpt_every: int,
    max_restarts: int = 0,
    script_args: list[str] | None = None,
) -> list[str]:
    return [
        bl.TORCHRUN, "--nproc-per-node", str(mesh[0] * mesh[1]), "--max-restarts", str(max_restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{bl.free_port()}", str(FSDP_BASELINE),
        *model_args(a, mesh), "--ckpt-every", str(ckpt_every), "--log-dir", str(run_dir),
        *(script_args or []), "--digest-out", str(run_dir / "digest.{rank}"),
    ]  # fmt: skip


def combine_digests(run_dir: Path, world: int) -> str | None:
    """One digest over every rank's shard digest (``digest.<r>``), written to ``run_dir/digest``
    (where benchmarks/recovery.py reads a run's final weights); None if a rank wrote none."""
    per_rank = []
    for r in range(world):
        f = run_dir / f"digest.{r}"
        if not f.exists():
            return None
        per_rank.append(f"{r}:{f.read_text().strip()}")
    combined = hashlib.sha256("\n".join(per_rank).encode()).hexdigest()
    (run_dir / "digest").write_text(combined + "\n")
    return combined


def buddy_flag_known() -> bool:
    """Whether ``checkpointless run`` has ``--buddy-copies`` (another branch adds it)."""
    out = subprocess.run(
        [bl.PYTHON, "-m", "checkpointless", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=bl.bench_env(),
        cwd=bl.REPO,
    )
    return "--buddy-copies" in out.stdout
