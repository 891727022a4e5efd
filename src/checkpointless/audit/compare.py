"""The audit's judgement, pure: per-step fingerprints of several runs in, findings out.

A run's fingerprints map (rank, step) to what each rank committed at that step: a digest of its
parameters and optimizer state after the update, and one of the gradients the update read
(recovery/fingerprint.py writes them). Two fault-free runs must agree everywhere; each run with a
fault must agree with the fault-free one everywhere. The first (step, rank) where a run differs
names the step at which the script's result stopped being a function of its inputs, and what
differs there (the gradients, or only the state) hints at why.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "Difference",
    "Finding",
    "Fingerprint",
    "Report",
    "RunPrints",
    "first_difference",
    "judge",
    "parse_lines",
]


@dataclass(frozen=True)
class Fingerprint:
    """What one rank committed at one step."""

    step: int
    rank: int
    state: str
    grads: str | None = None
    inputs: str | None = None


@dataclass
class RunPrints:
    """One run's fingerprints: (rank, step) -> every record of it (a step committed again after a
    recovery is recorded again; each record must match)."""

    label: str
    fault: str | None = None
    rc: int = 0
    fired: bool = True  # the run's fault fired (a fault that never fired proves nothing)
    prints: dict[tuple[int, int], list[Fingerprint]] = field(default_factory=dict)

    def add(self, fp: Fingerprint) -> None:
        self.prints.setdefault((fp.rank, fp.step), []).append(fp)


@dataclass(frozen=True)
class Difference:
    """The first (step, rank) where a run differs from the reference, and in what."""

    step: int
    rank: int
    what: str  # "inputs" (the batch), "grads", "state" or "missing"


@dataclass(frozen=True)
class Finding:
    """A run that differs from the reference: where first, and the likely cause."""

    label: str
    fault: str | None
    difference: Difference | None  # None: no step differs, but the run failed (rc)
    rc: int
    cause: str


@dataclass(frozen=True)
class Report:
    """The audit's verdict: ``ok`` when the fault-free runs agree and every faulted run matches."""

    steps: int
    ranks: int
    deterministic: bool
    findings: tuple[Finding, ...]
    runs: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.deterministic and not self.findings


def parse_lines(lines: Iterable[str]) -> list[Fingerprint]:
    """The fingerprints of a fingerprint file's lines (blank lines skipped)."""
    out = []
    for line in lines:
        if not line.strip():
            continue
        d = json.loads(line)
        grads, inputs = d.get("grads"), d.get("inputs")
        out.append(
            Fingerprint(
                int(d["step"]),
                int(d["rank"]),
                str(d["state"]),
                None if grads is None else str(grads),
                None if inputs is None else str(inputs),
            )
        )
    return out


def first_difference(ref: RunPrints, other: RunPrints) -> Difference | None:
    """The earliest (step, then rank) at which ``other`` differs from ``ref``: a step of the
    reference that ``other`` lacks, or a record of it with other gradients or state."""
    for rank, step in sorted(ref.prints, key=lambda k: (k[1], k[0])):
        want = ref.prints[(rank, step)][-1]
        got = other.prints.get((rank, step))
        if not got:
            return Difference(step, rank, "missing")
        if want.inputs is not None and any(g.inputs != want.inputs for g in got):
            return Difference(step, rank, "inputs")
        if want.grads is not None and any(g.grads != want.grads for g in got):
            return Difference(step, rank, "grads")
        if any(g.state != want.state for g in got):
            return Difference(step, rank, "state")
    return None


def _cause_without_faults(d: Difference) -> str:
    if d.what == "missing":
        return "one of the fault-free runs did not commit this step (did it fail? see its output)"
    start = "the first step already differs: " if d.step == 0 else ""
    if d.what == "inputs":
        return (
            f"{start}the model was given a different batch: a data order or augmentation that is "
            "not a function of the step (a shuffle seeded from the time or the process id, or not "
            "seeded); see docs/adoption.md"
        )
    if d.what == "state" and d.step > 0:
        return (
            "the same gradients gave a different update: a non-deterministic optimizer kernel "
            "(try torch.use_deterministic_algorithms(True)) or state changed outside the step"
        )
    return (
        f"{start}the script is not deterministic without faults: randomness seeded from the time "
        "or the process id (or not seeded), a data order that is not a function of the step, "
        "a non-deterministic kernel (torch.use_deterministic_algorithms(True) finds those), or "
        "a file an earlier run left that the script resumes from (give it a path with {run}); "
        "see docs/adoption.md"
    )


def _cause_with_fault(d: Difference, fault: str | None, fault_step: int | None) -> str:
    if d.what == "missing":
        return (
            "the faulted run did not commit this step: the job failed to recover from the fault "
            "(see its output and events.jsonl)"
        )
    if fault_step is not None and d.step < fault_step:
        return (
            f"differs before the fault (step {fault_step}): the script is not reliably "
            "deterministic even without faults (rerun the audit with more fault-free steps)"
        )
    after = f"after the fault ({fault}) the job did not resume the fault-free run: "
    if d.what == "inputs":
        return (
            after + "the model was given another batch, so the data order depends on something "
            "other than the step (a loader or iterator position the job does not restore, or a "
            "generator of the script's own); derive the batch from step.index; see docs/adoption.md"
        )
    return (
        after + "state the job does not restore (an object not given to job.track()), "
        "per-rank randomness the job cannot see (a generator of the script's own instead of "
        "job.generator), or a data order that depends on something other than the step; "
        "see docs/adoption.md"
    )


def _limit(rc: int) -> str:
    return ", the time limit" if rc == 124 else ""


def _fault_step(fault: str | None) -> int | None:
    for part in (fault or "").split(":"):
        key, _, val = part.partition("=")
        if key == "step" and val.isdigit():
            return int(val)
    return None


def judge(free_a: RunPrints, free_b: RunPrints, faulted: Iterable[RunPrints]) -> Report:
    """Compare the second fault-free run with the first, then each faulted run with the first.
    While the fault-free runs differ, a faulted run's difference says nothing: none is judged."""
    keys = free_a.prints.keys()
    steps = 1 + max((s for _, s in keys), default=-1)
    ranks = 1 + max((r for r, _ in keys), default=-1)
    faulted = list(faulted)
    labels = tuple(r.label for r in (free_a, free_b, *faulted))
    findings: list[Finding] = []
    for run in (free_a, free_b):
        if run.rc != 0 or not run.prints:
            findings.append(
                Finding(
                    run.label,
                    None,
                    None,
                    run.rc,
                    f"the fault-free run failed (exit code {run.rc}{_limit(run.rc)}) or recorded no step",
                )
            )
    if findings:
        return Report(steps, ranks, False, tuple(findings), labels)
    d = first_difference(free_a, free_b) or first_difference(free_b, free_a)
    if d is not None:
        finding = Finding(free_b.label, None, d, free_b.rc, _cause_without_faults(d))
        return Report(steps, ranks, False, (finding,), labels)
    for run in faulted:
        d = first_difference(free_a, run)
        if d is not None:
            findings.append(
                Finding(
                    run.label, run.fault, d, run.rc, _cause_with_fault(d, run.fault, _fault_step(run.fault))
                )
            )
        elif not run.fired:
            findings.append(
                Finding(
                    run.label,
                    run.fault,
                    None,
                    run.rc,
                    "the fault never fired: every step matched, but nothing was tested (a step outside the script's loop?)",
                )
            )
        elif run.rc != 0:
            findings.append(
                Finding(
                    run.label,
                    run.fault,
                    None,
                    run.rc,
                    f"every step matched, but the run ended with exit code {run.rc}",
                )
            )
    return Report(steps, ranks, True, tuple(findings), labels)
