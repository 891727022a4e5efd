"""Chaos soak (`make soak`; excluded from `make test`): real jobs, faults from outside the job.

Each scenario starts the example on 4 workers with hot spares and, while it trains, signals the
job's own processes from this test (``os.kill`` on the pids the launcher records in
``<run_dir>/pids`` and announces in its ``spawn`` / ``spare_assigned`` events): SIGKILL and SIGSTOP,
alone and in bursts, at random moments, including before generation 0 has formed, during a
recovery, and on a spare that was just handed a rank. Some scenarios add exceptions through
``--inject``. Every run must end as the fault-free run does: exit status 0, every rank's final
weights bitwise equal to the fault-free run's, every (rank, step) trained on the same batch, and
nothing left behind (processes, /dev/shm entries, secret or temporary files).

The schedule is a pure function of (scenario, seed) and is printed with every failure. To
reproduce one, run e.g. ``CHECKPOINTLESS_SOAK_SEED=7 pytest -m soak tests/e2e/test_soak.py -k bursts``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from checkpointless.observe.runfiles import LogTail
from tests.helpers.jobs import TINY, JobResult, alive, start_job
from tests.helpers.reference import ReferenceRuns

pytestmark = pytest.mark.soak

NPROC = 4
STEPS = 240
SOAK_ARGS = [*TINY[:1], str(STEPS), *TINY[2:]]  # TINY's model, more steps: room for the faults
assert TINY[0] == "--steps"
# A chaos run hits the same step again and again on purpose; the launcher's "same step keeps
# failing" guard is for bad nodes, so it gets more room here. Start-up limit: a SIGSTOP before a
# worker connects is only noticed by it.
# The fault budget (--max-repeat-faults) likewise: chaos kills the same rank again and again.
LAUNCH_EXTRA = ["--max-step-failures", "10", "--max-repeat-faults", "50", "--start-timeout", "60"]
HANG_TIMEOUT = 4.0
JOB_TIMEOUT = 480.0
TRIGGER_TIMEOUT = 90.0  # a strike whose moment never comes is skipped after this long


@dataclass(frozen=True)
class Strike:
    """One fault from outside the job.

    ``trigger``: "launch" (``at`` s after the launcher starts), "step" (once some rank has
    committed step ``at``), "fault" (``at`` s after the launcher records its next fault: lands
    inside that recovery) or "assigned" (``at`` s after the next spare is handed a rank).
    ``targets``: "rank:N", "spare" (an idle spare), "assigned" (the spare just handed a rank) or
    "all" (every rank at once).
    """

    trigger: str
    at: float
    sig: str  # "KILL" or "STOP"
    targets: tuple[str, ...]

    def text(self) -> str:
        when = f"step {int(self.at)}" if self.trigger == "step" else f"{self.at:.2f}s after {self.trigger}"
        return f"SIG{self.sig} {'+'.join(self.targets)} at {when}"


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int
    spares: int
    strikes: tuple[Strike, ...]
    inject: tuple[str, ...] = ()

    def describe(self) -> str:
        lines = [
            f"scenario {self.name} seed {self.seed}: {NPROC} workers, {self.spares} spares, {STEPS} steps"
        ]
        lines += [f"  --inject {s}" for s in self.inject]
        lines += [f"  {s.text()}" for s in self.strikes]
        return "\n".join(lines)


def _rank(rng: random.Random) -> str:
    return f"rank:{rng.randrange(NPROC)}"


def _steps(rng: random.Random, n: int, lo: int = 3, hi: int = STEPS - 20) -> list[int]:
    return sorted(rng.sample(range(lo, hi), n))


def plan(name: str, seed: int) -> Scenario:
    """The scenario's schedule: a pure function of its name and seed."""
    rng = random.Random(f"{name}/{seed}")
    kill = "KILL"
    if name == "startup":
        # before generation 0 has formed (imports take seconds), then more during training
        launch = [Strike("launch", rng.uniform(0.5, 6.0), sig, (_rank(rng),)) for sig in ("KILL", "STOP")]
        later = [Strike("step", s, kill, (_rank(rng),)) for s in _steps(rng, 6)]
        return Scenario(name, seed, 2, tuple(sorted(launch, key=lambda s: s.at) + later))
    if name == "kills":
        return Scenario(name, seed, 2, tuple(Strike("step", s, kill, (_rank(rng),)) for s in _steps(rng, 12)))
    if name == "hangs":
        sigs = ["STOP"] * 3 + ["KILL"] * 3
        rng.shuffle(sigs)
        return Scenario(
            name,
            seed,
            2,
            tuple(Strike("step", s, g, (_rank(rng),)) for s, g in zip(_steps(rng, 6), sigs, strict=True)),
        )
    if name == "exceptions":
        sites = ["step", "forward", "backward", "allreduce", "optimizer"]
        inject = tuple(
            f"raise:rank={rng.randrange(NPROC)}:step={s}:site={rng.choice(sites)}" for s in _steps(rng, 8)
        )
        strikes = tuple(Strike("step", s, kill, (_rank(rng),)) for s in _steps(rng, 3))
        return Scenario(name, seed, 2, strikes, inject)
    if name == "during-recovery":
        out: list[Strike] = []
        for i, s in enumerate(_steps(rng, 6)):
            out.append(Strike("step", s, kill, (_rank(rng),)))
            if i % 3 == 2:  # the spare that was just handed the rank dies while receiving state
                out.append(Strike("assigned", rng.uniform(0.0, 0.5), kill, ("assigned",)))
            else:  # another rank dies while the survivors are still recovering
                out.append(
                    Strike(
                        "fault", rng.uniform(0.0, 1.0), rng.choice(["KILL", "KILL", "STOP"]), (_rank(rng),)
                    )
                )
        return Scenario(name, seed, 2, tuple(out))
    if name == "bursts":
        out = []
        for s in _steps(rng, 4):
            ranks = rng.sample(range(NPROC), rng.choice([2, 2, 3]))
            out.append(
                Strike("step", s, rng.choice(["KILL", "KILL", "STOP"]), tuple(f"rank:{r}" for r in ranks))
            )
        return Scenario(name, seed, 3, tuple(out))
    if name == "spares":
        out = []
        for i, s in enumerate(_steps(rng, 6)):
            out.append(Strike("step", s, kill, ("spare",) if i % 2 == 0 else (_rank(rng),)))
        return Scenario(name, seed, 2, tuple(out))
    if name == "mixed":
        sites = ["forward", "backward", "allreduce", "optimizer"]
        inject = tuple(
            f"raise:rank={rng.randrange(NPROC)}:step={s}:site={rng.choice(sites)}" for s in _steps(rng, 3)
        )
        out = [Strike("launch", rng.uniform(0.5, 6.0), kill, (_rank(rng),))]
        for s in _steps(rng, 6):
            kind = rng.choice(["one", "one", "burst", "recovery", "spare"])
            if kind == "burst":
                out.append(Strike("step", s, kill, tuple(f"rank:{r}" for r in rng.sample(range(NPROC), 2))))
            elif kind == "spare":
                out.append(Strike("step", s, kill, ("spare",)))
            else:
                out.append(Strike("step", s, rng.choice(["KILL", "STOP"]), (_rank(rng),)))
                if kind == "recovery":
                    out.append(Strike("fault", rng.uniform(0.0, 1.0), kill, (_rank(rng),)))
        return Scenario(name, seed, 2, tuple(out), inject)
    if name == "all-replicas":
        # every replica at once: no survivor holds the state, so the replacements restore the
        # newest shared-memory snapshot and replay from it (still bitwise)
        return Scenario(name, seed, 4, (Strike("step", _steps(rng, 1, 20, STEPS - 40)[0], kill, ("all",)),))
    raise ValueError(f"unknown soak scenario {name!r}")


# (name, seed); CHECKPOINTLESS_SOAK_SEED replaces every seed, to reproduce or to explore
SCENARIOS = [
    ("startup", 1),
    ("kills", 2),
    ("kills", 3),
    ("hangs", 4),
    ("exceptions", 5),
    ("during-recovery", 6),
    ("bursts", 7),
    ("spares", 8),
    ("mixed", 9),
    ("mixed", 10),
    ("all-replicas", 11),
]
_SEED = os.environ.get("CHECKPOINTLESS_SOAK_SEED")
if _SEED is not None:
    SCENARIOS = [(name, int(_SEED)) for name, _ in SCENARIOS]


class _Tail:
    """The complete JSON lines appended to a file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0
        self.rest = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        return [json.loads(x) for x in lines if x.strip()]


@dataclass
class _Watch:
    """The job as seen from outside, from its event files: who holds which rank, how far it got."""

    run_dir: Path
    events: _Tail = field(init=False)
    ranks: dict[Path, LogTail] = field(default_factory=dict)
    pid_of: dict[int, int] = field(default_factory=dict)  # worker id -> pid
    spares: set[int] = field(default_factory=set)  # worker ids started as spares
    holder: dict[int, int] = field(default_factory=dict)  # rank -> worker id
    assigned: list[int] = field(default_factory=list)  # worker ids handed a rank, in order
    faults: int = 0
    started: bool = False
    max_step: int = -1

    def __post_init__(self) -> None:
        self.events = _Tail(self.run_dir / "events.jsonl")

    def poll(self) -> None:
        for e in self.events.read():
            kind = e["event"]
            if kind == "spawn":
                self.pid_of[e["worker"]] = e["pid"]
                if e["role"] == "spare":
                    self.spares.add(e["worker"])
                elif e["worker"] < NPROC:
                    self.holder[e["worker"]] = e["worker"]  # the launcher starts rank r as worker r
            elif kind == "spare_assigned":
                self.holder[e["rank"]] = e["worker"]
                self.assigned.append(e["worker"])
            elif kind == "fault":
                self.faults += 1
            elif kind == "started":
                self.started = True
        for f in self.run_dir.glob("rank-*.jsonl"):
            tail = self.ranks.setdefault(f, LogTail(f))  # follows the log across its rotations
            for e in map(json.loads, tail.poll()):
                if e["event"] == "commit":
                    self.max_step = max(self.max_step, e["step"])

    def rank_pid(self, rank: int) -> int | None:
        w = self.holder.get(rank)
        return self.pid_of.get(w) if w is not None else None

    def idle_spares(self) -> list[int]:
        held = set(self.holder.values())
        return [self.pid_of[w] for w in sorted(self.spares - held) if alive(self.pid_of[w])]


@dataclass
class _Chaos:
    """Fires a scenario's strikes, in order, at a running job; logs what it did."""

    scenario: Scenario
    watch: _Watch
    launched: float
    hit: set[int] = field(default_factory=set)  # pids signalled so far
    log: list[str] = field(default_factory=list)
    fired: int = 0  # processes signalled

    def _targets(self, strike: Strike, assigned_before: int) -> list[int]:
        w = self.watch
        pids: list[int] = []
        for t in strike.targets:
            if t == "all":
                pids += [p for r in range(NPROC) if (p := w.rank_pid(r)) is not None]
            elif t == "spare":
                pids += [p for p in w.idle_spares() if p not in self.hit][:1]
            elif t == "assigned":
                pids += [w.pid_of[x] for x in w.assigned[assigned_before:][:1]]
            else:
                # the planned rank if its process can still be hit, else another rank's
                want = int(t.split(":")[1])
                order = [want] + [r for r in range(NPROC) if r != want]
                for r in order:
                    p = w.rank_pid(r)
                    if p is not None and p not in self.hit and p not in pids and alive(p):
                        pids.append(p)
                        break
        return [p for p in dict.fromkeys(pids) if alive(p) and p not in self.hit]

    def _wait(self, strike: Strike, job_alive: Any) -> tuple[bool, int]:
        """Block until the strike's moment (or give up); return (due, spares assigned before)."""
        w = self.watch
        faults0, assigned0 = w.faults, len(w.assigned)
        armed: float | None = None
        deadline = time.monotonic() + TRIGGER_TIMEOUT
        while time.monotonic() < deadline and job_alive():
            w.poll()
            if w.max_step >= STEPS - 4:
                return False, assigned0  # the job is finishing: a fault now tests nothing new
            now = time.monotonic()
            if strike.trigger == "launch" and now >= self.launched + strike.at:
                return True, assigned0
            if strike.trigger == "step" and w.max_step >= strike.at:
                return True, assigned0
            if armed is None and (
                (strike.trigger == "fault" and w.faults > faults0)
                or (strike.trigger == "assigned" and len(w.assigned) > assigned0)
            ):
                armed = now
            if armed is not None and now >= armed + strike.at:
                return True, assigned0
            time.sleep(0.02)
        return False, assigned0

    def run(self, job_alive: Any) -> None:
        for strike in self.scenario.strikes:
            due, assigned0 = self._wait(strike, job_alive)
            t = time.monotonic() - self.launched
            if not due:
                self.log.append(f"{t:7.2f}s skipped {strike.text()} (the job ended or its moment never came)")
                continue
            pids = self._targets(strike, assigned0)
            sig = signal.SIGKILL if strike.sig == "KILL" else signal.SIGSTOP
            for p in pids:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    continue
                self.hit.add(p)
                self.fired += 1
            state = f"gen0 {'formed' if self.watch.started else 'NOT formed'}, max step {self.watch.max_step}"
            self.log.append(f"{t:7.2f}s {strike.text()} -> pids {pids} ({state})")


_FIRED: dict[str, int] = {}


def _leftovers(res: JobResult) -> list[str]:
    """What the job left behind: live processes, shared memory, secret or half-written files."""
    run_dir = res.run_dir
    found: list[str] = []
    deadline = time.monotonic() + 10  # the launcher's reaper may still be on its way out
    while True:
        procs = [p for p in res.pids() if alive(p)]
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    cmd = (d / "cmdline").read_bytes()
                except OSError:
                    continue
                if str(run_dir).encode() in cmd and alive(int(d.name)):
                    procs.append(int(d.name))
        if not procs or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if procs:
        found.append(f"processes still alive: {sorted(set(procs))}")
    starts = res.of("job_start")
    if starts and Path(starts[0]["shm"]).exists():
        found.append(f"shared memory {starts[0]['shm']}")
    if (run_dir / "secret").exists():
        found.append("the job's secret file")
    found += [f"temporary file {p}" for p in run_dir.parent.glob("*.tmp")]
    found += [f"temporary file {p}" for p in run_dir.parent.glob(".*.tmp")]
    return found


def _evidence(res: JobResult, chaos: _Chaos) -> str:
    keep = {
        "fault",
        "plan",
        "spare_assigned",
        "spare_lost",
        "recovery",
        "job_end",
        "started",
        "fault_injected",
    }
    events = [
        json.dumps({k: v for k, v in e.items() if k not in ("job",)})
        for e in res.events()
        if e["event"] in keep
    ]
    return (
        f"\n{chaos.scenario.describe()}\nwhat the soak did:\n"
        + "\n".join(chaos.log)
        + "\nlauncher events:\n"
        + "\n".join(events[-40:])
        + "\nlast output:\n"
        + res.output[-4000:]
    )


def _soak(tmp_path: Path, corpus: Path, scenario: Scenario) -> tuple[JobResult, _Chaos]:
    print(scenario.describe(), flush=True)
    run_dir = tmp_path / "run"
    job = start_job(
        run_dir,
        corpus,
        nproc=NPROC,
        spares=scenario.spares,
        faults=list(scenario.inject),
        extra=LAUNCH_EXTRA,
        script_args=SOAK_ARGS,
        hang_timeout=HANG_TIMEOUT,
    )
    chaos = _Chaos(scenario, _Watch(run_dir), job.started)
    try:
        chaos.run(lambda: job.proc.poll() is None)
    finally:
        res = job.finish(JOB_TIMEOUT)
    injected = len(res.of("fault_injected"))
    _FIRED[f"{scenario.name}/{scenario.seed}"] = chaos.fired + injected
    print("\n".join(chaos.log), flush=True)
    print(
        f"{chaos.fired} processes signalled, {injected} injected faults fired, "
        f"{len(res.of('recovery'))} recoveries, rc {res.rc}",
        flush=True,
    )
    return res, chaos


def _check(res: JobResult, ref: JobResult, chaos: _Chaos) -> None:
    why = _evidence(res, chaos)
    assert res.rc == 0, f"the job failed (exit status {res.rc}){why}"
    res.assert_same_weights(ref, NPROC)
    got, want = res.batches(), ref.batches()
    wrong = sorted(k for k in got if got[k] != want.get(k))
    assert not wrong, f"(rank, step) {wrong[:10]} trained on other samples than the fault-free run{why}"
    missing = sorted(set(want) - set(got))
    if missing:
        # Seen in the soak: a rank SIGKILLed after its step's all-reduce but before it wrote its
        # commit line. The step counted (the others committed it, the weights match), only the
        # record is gone. Tolerated where that explains it, reported so it stays visible.
        faulted = {e["rank"] for e in res.of("fault")}
        done = {s for _, s in got}
        unexplained = [(r, s) for r, s in missing if r not in faulted or s not in done]
        assert not unexplained, f"(rank, step) {unexplained[:10]} never committed{why}"
        print(f"commit records lost by killed ranks (the step itself committed): {missing}", flush=True)
    if chaos.fired:
        assert res.of("recovery"), f"faults fired but no recovery was recorded{why}"
    left = _leftovers(res)
    assert not left, f"left behind: {left}{why}"


@pytest.mark.timeout(JOB_TIMEOUT + 120)
@pytest.mark.parametrize("name,seed", SCENARIOS, ids=[f"{n}-seed{s}" for n, s in SCENARIOS])
def test_chaos_soak(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    corpus: Path,
    name: str,
    seed: int,
    reference: ReferenceRuns,
) -> None:
    ref = reference(NPROC, script_args=SOAK_ARGS, timeout=300)
    scenario = plan(name, seed)
    res, chaos = _soak(tmp_path, corpus, scenario)
    _check(res, ref, chaos)


def test_plans_are_reproducible_and_large_enough() -> None:
    """Pure: the same seed gives the same schedule, and the planned faults add up to 100+."""
    assert plan("mixed", 9) == plan("mixed", 9) and plan("mixed", 9) != plan("mixed", 10)
    planned = 0
    for name, seed in SCENARIOS:
        s = plan(name, seed)
        planned += len(s.inject) + sum(NPROC if t == "all" else 1 for k in s.strikes for t in k.targets)
    assert planned >= 100, planned


@pytest.mark.timeout(30)
def test_soak_fired_at_least_100_faults() -> None:
    """Runs last: the whole suite must really have hit the jobs with 100 faults or more."""
    if len(_FIRED) < len(SCENARIOS):
        pytest.skip(f"only {len(_FIRED)} of {len(SCENARIOS)} scenarios ran")
    total = sum(_FIRED.values())
    assert total >= 100, f"the soak fired only {total} faults: {_FIRED}"
