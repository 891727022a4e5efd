"""Helpers for tests that run real jobs under the launcher."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import zygote

# re-exported: the tests that start jobs take the paths from here with the job helpers
from .paths import EXAMPLE as EXAMPLE
from .paths import ROOT as ROOT
from .paths import SCRIPTS as SCRIPTS
from .zygote import Process

# small enough that a 3-4 rank job runs in seconds on two cores
TINY = [
    "--steps",
    "10",
    "--dim",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--seq-len",
    "16",
    "--global-batch",
    "12",
]


@dataclass
class JobResult:
    rc: int
    output: str
    run_dir: Path
    digests: dict[int, str]  # rank -> SHA-256 of that rank's final weights (ranks that wrote one)

    @property
    def digest(self) -> str | None:
        """The final weights' digest when every rank wrote the same one, else None."""
        values = set(self.digests.values())
        return values.pop() if len(values) == 1 else None

    def trained_batches(self) -> dict[tuple[int, int], str]:
        """(rank, step) -> digest of the batch it trained on, from the script's
        ``batch rank=R step=S DIGEST`` lines; a replay must train on the same batch."""
        out: dict[tuple[int, int], str] = {}
        # exactly 16 hex digits: lines printed by two ranks at once can be glued together
        for rank, step, digest in re.findall(r"batch rank=(\d+) step=(\d+) ([0-9a-f]{16})", self.output):
            key = (int(rank), int(step))
            assert out.get(key, digest) == digest, f"rank/step {key} trained on two different batches"
            out[key] = digest
        return out

    def assert_same_weights(self, ref: JobResult, nproc: int) -> None:
        """Every rank ended with the fault-free run's weights, and so all ranks agree."""
        ref_values = set(ref.digests.values())
        assert len(ref_values) == 1 and sorted(ref.digests) == list(range(nproc)), (
            f"the fault-free run's ranks disagree or are missing: {ref.digests}"
        )
        want = ref_values.pop()
        assert sorted(self.digests) == list(range(nproc)), (
            f"ranks {sorted(set(range(nproc)) - set(self.digests))} wrote no final digest"
        )
        wrong = {r: d[:16] for r, d in self.digests.items() if d != want}
        assert not wrong, f"final weights differ from the fault-free run's ({want[:16]}) on ranks {wrong}"

    def events(self, name: str = "events.jsonl") -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        # a rank's log is rotated (recovery/commit_log.py): its older file first
        for path in (self.run_dir / f"{name}.1", self.run_dir / name):
            if path.exists():
                out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == kind]

    def startup_faults(self) -> list[dict[str, Any]]:
        """Faults that start-up absorbed: a fault in step 0 can land before the coordinator has
        heard every rank form generation 0, and is then part of forming it, not a recovery."""
        return [f for e in self.of("started") for f in e.get("faults", [])]

    def commits(self) -> list[dict[str, Any]]:
        """Every rank's ``commit`` events, a replayed step's each time it committed; in degraded
        mode a held slot's ``slot_commit`` (in its holder's log) counts as that slot's commit."""
        out: list[dict[str, Any]] = []
        for f in sorted(self.run_dir.glob("rank-*.jsonl")):
            for e in self.events(f.name):
                if e["event"] == "commit":
                    out.append(e)
                elif e["event"] == "slot_commit":
                    out.append({**e, "rank": e["slot"]})
        return out

    def batches(self) -> dict[tuple[int, int], str]:
        """(rank, step) -> batch digest of the committed step (last write wins: a replayed
        step that committed twice must have committed the same batch)."""
        out: dict[tuple[int, int], str] = {}
        for e in self.commits():
            key = (e["rank"], e["step"])
            assert out.get(key, e["batch"]) == e["batch"], f"rank/step {key} committed two batches"
            out[key] = e["batch"]
        return out

    def assert_same_batches(self, ref: JobResult, lost: Collection[int] | None = None) -> None:
        """Every (rank, step) this run logged trained the fault-free run's batch. With ``lost``
        (ranks killed at an arbitrary moment): a lost rank may have committed a step in the
        collective and died before its line was written, so at most one line per lost rank may
        be missing, and no other rank's (its replica's line proves the batch was trained)."""
        got, want = self.batches(), ref.batches()
        wrong = sorted(k for k in got if got[k] != want.get(k))
        assert not wrong, f"ranks trained on other samples than the fault-free run at {wrong}"
        if lost is not None:
            missing = sorted(set(want) - set(got))
            assert {r for r, _ in missing} <= set(lost) and len(missing) <= len(lost), missing

    def cut_steps(self) -> set[int]:
        """The steps a recovery round cut in on (each plan after the first resumes at its target:
        the step before it may have been rolled forward after its update, so no pass of it ended
        cleanly to print its line or commit again)."""
        return {p["target_step"] - 1 for p in self.of("plan") if p["generation"] > 0}

    def recovery_from(self, rank: int, step: int) -> dict[str, Any] | None:
        """The recovery from the fault of ``rank`` at ``step`` (its own fault, not a peer's comm
        error it caused), for a job with several faults; None if no recovery names it."""
        found = [
            r
            for r in self.of("recovery")
            if any(f["rank"] == rank and f.get("step") == step and f["kind"] != "comm" for f in r["faults"])
        ]
        assert len(found) <= 1, f"two recoveries from the fault of rank {rank} at step {step}: {found}"
        return found[0] if found else None

    def fired(self, spec: str) -> bool:
        """Whether the injected fault ``spec`` (as given to --inject) fired: its id is the spec
        with the defaults filled in (``kill:rank=1:step=4`` fires as ``...:site=step``)."""
        return any(e["id"] == spec or e["id"].startswith(spec + ":") for e in self.of("fault_injected"))

    def assert_each_fault_recovered(self, merged: list[tuple[str, dict[int, int]]]) -> None:
        """A job of several faults (a merged test): each fault of ``merged`` fired and was
        recovered from in a round of its own, whose plan's sources were ``{receiver: source}``."""
        for fault, receivers in merged:
            rank, step = fault_at(fault)
            rec = self.recovery_from(rank, step)
            assert self.fired(fault) and rec is not None, (fault, self.output[-4000:])
            plans = [
                {r: s for r, s in e.get("sources", [])}
                for e in self.of("plan")
                if e["generation"] == rec["generation"]
            ]
            assert plans and plans[0] == receivers, (fault, plans)

    def pids(self) -> list[int]:
        p = self.run_dir / "pids"
        return [int(x) for x in p.read_text().split()] if p.exists() else []

    def left_behind(self, grace: float = 10.0) -> list[int]:
        """The job's processes still alive ``grace`` s from now (sooner if none is). A process
        killed as the job ends (a fenced host's workers, when its agent is stopped last) is gone
        only once the kernel has torn down its memory, which takes a moment under load; a process
        that was really left behind is still there after the grace."""
        deadline = time.monotonic() + grace
        while True:
            left = [p for p in self.pids() if alive(p)]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)


def fault_at(spec: str) -> tuple[int, int]:
    """(rank, step) of an --inject fault spec such as ``kill:rank=1:step=4``."""
    fields = dict(part.split("=", 1) for part in spec.split(":")[1:] if "=" in part)
    return int(fields["rank"]), int(fields["step"])


@dataclass
class RunningJob:
    """A launcher started by :func:`start_job`; its output goes to ``log`` (read at the end)."""

    proc: Process  # a subprocess.Popen, or a launcher forked from the zygote (helpers/zygote.py)
    run_dir: Path
    log: Path
    started: float  # time.monotonic() at launch

    def finish(self, timeout: float) -> JobResult:
        """Wait for the launcher (at most ``timeout`` s from the launch); kill its group if late."""
        try:
            self.proc.wait(timeout=max(0.1, self.started + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            raise AssertionError(f"job did not finish within {timeout} s:\n{self.output()[-6000:]}") from None
        digests = read_digests(self.run_dir.parent, self.run_dir.name + ".digest-")
        return JobResult(self.proc.returncode, self.output(), self.run_dir, digests)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_job(
    run_dir: Path,
    data: Path,
    nproc: int = 3,
    spares: int = 1,
    faults: list[str] | None = None,
    extra: list[str] | None = None,
    script_args: list[str] | None = None,
    script: Path = EXAMPLE,
    hang_timeout: float = 8,
    env: dict[str, str] | None = None,
) -> RunningJob:
    """Launch the example under the launcher without waiting for it."""
    # one file per rank: "{rank}" is filled in by the example
    digest_pattern = run_dir.parent / (run_dir.name + ".digest-{rank}")
    for old in run_dir.parent.glob(run_dir.name + ".digest-*"):
        old.unlink()  # a stale digest from an earlier run must not pass for this one's
    cmd = [
        sys.executable,
        "-m",
        "checkpointless",
        "run",
        "--nproc",
        str(nproc),
        "--spares",
        str(spares),
        "--run-dir",
        str(run_dir),
        "--hang-timeout",
        str(hang_timeout),
    ]
    for f in faults or []:
        cmd += ["--inject", f]
    cmd += extra or []
    cmd += [str(script), *(script_args if script_args is not None else TINY), "--data", str(data)]
    cmd += ["--digest-out", str(digest_pattern)]
    log = run_dir.parent / (run_dir.name + ".out")
    # a file, not a pipe: a caller that is busy injecting faults must not stall the job's output
    with open(log, "wb") as out:
        full_env = {**os.environ, **(env or {})}
        proc: Process | None = zygote.launch(cmd, str(ROOT), full_env, out.fileno())
        if proc is None:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=full_env
            )
    return RunningJob(proc, run_dir, log, time.monotonic())


def run_job(
    run_dir: Path,
    data: Path,
    nproc: int = 3,
    spares: int = 1,
    faults: list[str] | None = None,
    extra: list[str] | None = None,
    script_args: list[str] | None = None,
    timeout: float = 150,
    script: Path = EXAMPLE,
    env: dict[str, str] | None = None,
) -> JobResult:
    """Run the example under the launcher to the end (``env``: added to this process's)."""
    job = start_job(run_dir, data, nproc, spares, faults, extra, script_args, script, env=env)
    return job.finish(timeout)


def torchrun_env() -> dict[str, str]:
    """This environment for a job under plain torchrun: nothing of a surrounding checkpointless
    job may leak in, so it is torchrun alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINTLESS_", "TORCHELASTIC_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crash prints every thread's Python stack
    return env


def read_digests(folder: Path, prefix: str) -> dict[int, str]:
    """rank -> digest from the files ``<folder>/<prefix><rank>``."""
    out: dict[int, str] = {}
    for f in folder.glob(prefix + "*"):
        suffix = f.name[len(prefix) :]
        if suffix.isdigit():
            out[int(suffix)] = f.read_text().strip()
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def assert_batches_but_cut(
    got: dict[tuple[int, int], str], want: dict[tuple[int, int], str], cut: set[int], what: str = "committed"
) -> None:
    """Every (slot, step) of ``got`` has the fault-free run's batch (``want``), and a (slot, step)
    of ``want`` is missing from ``got`` only at a step of ``cut`` (``JobResult.cut_steps`` and the
    faults' own steps): the weights, compared besides, say those steps' updates are exact."""
    assert {k: want[k] for k in got} == got, f"a {what} (slot, step) had another batch than without the fault"
    missing = sorted(set(want) - set(got))
    assert all(step in cut for _, step in missing), (what, missing, sorted(cut))
