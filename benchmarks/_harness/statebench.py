"""What benchmarks/snapshot.py (shared-memory snapshots) and benchmarks/checkpoint.py (durable DCP
checkpoints) share: both time the example GPT's training step with and without a save started as
each step begins, and both measure a restore in real jobs under the launcher.

Part 1 helpers: the bench-size model (``bench_model``), a timed block of steps (``timed_steps``:
wall and process CPU time per step, the writer's background work settled inside the window) and
the warm-up plus alternating off/on blocks (``alternate``). Part 2 helpers: the token corpus the
jobs read, their command line (3 ranks, 3 spares, 12 steps), and ``run_killed_job``, which
SIGKILLs one rank or all of them once a save exists and returns the launcher's ``recovery``
event. The savers and the moment a save "exists" differ, so the scripts pass those in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from checkpointless.data import make_synthetic_corpus, prepare_main

__all__ = [
    "EXAMPLE",
    "RECOVERY_KEYS",
    "REPO",
    "BenchModel",
    "alternate",
    "bench_model",
    "job_command",
    "prepare_corpus",
    "run_killed_job",
    "timed_steps",
]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_gpt.py"
# the launcher's recovery event fields both benchmarks report
RECOVERY_KEYS = (
    "downtime_s",
    "collect_s",
    "rebuild_s",
    "transfer_s",
    "first_batch_s",
    "first_step_s",
    "transport",
)
_T = TypeVar("_T")


def _gpt_module() -> Any:
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass
class BenchModel:
    """The example GPT at bench size (dim 128, 4 layers), AdamW, and one fixed batch."""

    gpt: torch.nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    objects: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.objects = {"model": self.gpt, "optimizer": self.opt}  # what collect_state saves

    def step(self) -> None:
        loss = F.cross_entropy(self.gpt(self.x).reshape(-1, 256), self.y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def bench_model() -> BenchModel:
    # one thread and a fixed seed: the two arms differ only by the save
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gpt = _gpt_module().GPT(256, 128, 4, 4, 64, 0.1)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    x = torch.randint(0, 256, (8, 64))
    y = torch.randint(0, 256, (8, 64))
    return BenchModel(gpt, opt, x, y)


def timed_steps(steps: int, one_step: Callable[[], None], settle: Callable[[], None]) -> tuple[float, float]:
    """Wall and process CPU seconds per step of ``steps`` calls of ``one_step``; ``settle`` (wait
    for the writer to go idle) runs inside the window, so the background work is counted."""
    t0, c0 = time.monotonic(), time.process_time()
    for _ in range(steps):
        one_step()
    settle()
    return (time.monotonic() - t0) / steps, (time.process_time() - c0) / steps


def alternate(blocks: int, block: Callable[[bool], _T]) -> tuple[list[_T], list[_T]]:
    """A warm-up block, then ``blocks`` pairs of (without, with) the save: alternating, so both
    arms see the same drift in the machine's load. Returns (off, on)."""
    block(False)
    off: list[_T] = []
    on: list[_T] = []
    for _ in range(blocks):
        off.append(block(False))
        on.append(block(True))
    return off, on


def prepare_corpus(work: Path) -> Path:
    """A small tokenized corpus under ``work`` for the jobs' ``--data``."""
    make_synthetic_corpus(work / "corpus.jsonl", num_docs=400, seed=0)
    prepare_main([str(work / "corpus.jsonl"), "-o", str(work / "corpus.tokens"), "--quiet"])
    return work / "corpus.tokens"


def job_command(run_dir: Path, corpus: Path, launcher_args: list[str]) -> list[str]:
    """3 ranks and 3 spares (enough for every rank killed at once), 12 steps of the bench model."""
    return [
        sys.executable, "-m", "checkpointless", "run", "--nproc", "3", "--spares", "3", "--run-dir", str(run_dir),
        *launcher_args,
        str(EXAMPLE), "--steps", "12", "--dim", "128", "--layers", "4", "--heads", "4", "--seq-len", "64",
        "--global-batch", "12", "--data", str(corpus),
    ]  # fmt: skip


def run_killed_job(
    run_dir: Path, cmd: list[str], workers_once_saved: Callable[[str], list[int] | None], kill_all: bool
) -> dict[str, Any]:
    """Run ``cmd`` and, once ``workers_once_saved`` (given the launcher's events so far) returns the
    workers' pids in rank order, SIGKILL rank 1 or every rank; the launcher's last ``recovery``
    event's fields, or ``{"recovery": None}`` when there was none."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )

    def killer() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            ev = run_dir / "events.jsonl"
            text = ev.read_text() if ev.exists() else ""
            # only whole lines: the launcher may be half-way through writing one
            workers = workers_once_saved(text) if text.endswith("\n") else None
            if workers is not None:
                for i, pid in enumerate(workers):
                    if kill_all or i == 1:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                return
            time.sleep(0.01)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    t.join(timeout=5)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    rec = [e for e in events if e["event"] == "recovery"]
    return {
        "rc": proc.returncode,
        **({k: rec[-1].get(k) for k in RECOVERY_KEYS} if rec else {"recovery": None}),
    }
