"""Fault injection: rehearse faults in your own job.

A fault is ``KIND[:key=value...]`` with KIND one of raise, wedge, exit, kill, killall, hang, spin, slow and keys
``rank`` (default any), ``step`` (default first), ``site`` (step, forward, backward, allreduce,
p2p — as the step's first point-to-point send or receive is issued on the rank, a pipeline
stage's activation or gradient, its peer stage left waiting in the matching op —, optimizer —
half-way through the update —, recovery — while rejoining for that step —, section — as a
protected section at the boundary after ``step`` steps returns, past its last collective —, closed
— as the rank passes that section's closing barrier, its peers passing it or still in it, before
anything after the section (the output it held) —, unsettled — as that closing barrier completes
on the rank, which takes it for failed, as when an abort lands on it before it completed and it
does not complete within the settle time: its peers have passed it, it has not —; default step) and ``seconds`` (for slow). Examples::

    kill:rank=1:step=20            SIGKILL rank 1 as it starts step 20
    raise:rank=2:step=5:site=backward
    kill:rank=2:step=4:site=p2p    rank 2 dies as it sends an activation its next stage waits for
    raise:rank=0:step=10:site=section  rank 0 raises as a section after 10 steps returns
    kill:rank=1:step=10:site=closed    rank 1 dies as it passes that section's closing barrier
    raise:rank=0:step=10:site=unsettled  rank 0 fails that barrier, which its peers passed
    hang:rank=3:step=30            SIGSTOP: the process stops answering
    spin:rank=0:step=12            a busy loop that holds the step
    random:seed=7:count=3:kinds=raise,kill:steps=5-40
    killall:step=6                 every process holding a rank SIGKILLed at once as step 6 begins
    killall:step=6:site=optimizer  every rank SIGKILLed at once half-way through step 6's update
    wedge:rank=1:step=8            rank 1 raises at step 8 every time its process runs it

``killall`` takes ``step`` and ``site`` (step or optimizer, no rank). Each rank fires it as it
begins that step, after the previous step's commit, like ``kill``, or with ``site=optimizer``
half-way through that step's update (some parameters already changed, on every rank); but before
it dies it waits (the injector's ``gather``) until every rank has got there and the copies of that
step's state this rank started (a snapshot, a durable checkpoint) are written. So no rank is aborted
into a recovery by a peer that died first, and the job must restore the newest snapshot or
checkpoint: no replica is left. A copy of step N holds the state as step N began, before its
update, so either way the job resumes at step N and trains step N's batches once.

``wedge`` takes ``rank`` and ``step``: a fault that lives in the process (a wedged device context,
leaked handles). The rank raises each time its process runs that step, so every in-process retry
meets it again, until a fresh process takes the rank (``--fresh-process-retries``): that one is
told the fault has fired, as a replacement always is, and trains on.

Every other fault fires once per job: the worker tells the launcher before it fires, and a replacement
that re-runs the step is told which faults have already fired.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from checkpointless.errors import ConfigError

__all__ = ["KINDS", "SITES", "FaultSpec", "InjectedFault", "Injector", "expand_random", "parse_faults"]

KINDS = ("raise", "wedge", "exit", "kill", "killall", "hang", "spin", "slow")
SITES = (
    "step",
    "forward",
    "backward",
    "allreduce",
    "p2p",
    "optimizer",
    "recovery",
    "section",
    "closed",
    "unsettled",
)


class InjectedFault(RuntimeError):
    """The exception that a ``raise`` fault throws into the training step."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int | None = None
    step: int | None = None
    site: str = "step"
    seconds: float = 3.0

    @property
    def id(self) -> str:
        return f"{self.kind}:rank={self.rank}:step={self.step}:site={self.site}"

    def to_text(self) -> str:
        parts = [self.kind]
        if self.rank is not None:
            parts.append(f"rank={self.rank}")
        if self.step is not None:
            parts.append(f"step={self.step}")
        if self.site != "step":
            parts.append(f"site={self.site}")
        if self.kind == "slow":
            parts.append(f"seconds={self.seconds}")
        return ":".join(parts)


_SYNTAX = "KIND:rank=R:step=S[:site=SITE][:seconds=X]"
_KILLALL_SYNTAX = "killall:step=S[:site=optimizer]"
# where every rank can meet before it dies: as the step begins, and inside the update, which
# every rank reaches after the step's all-reduce; the other sites are inside a collective, a
# pipeline stage's send, a recovery or a section, where the ranks do not all get to in step
_KILLALL_SITES = ("step", "optimizer")
_RANDOM_SYNTAX = "random:seed=S:count=N:kinds=a,b:steps=LO-HI[:ranks=LO-HI]"
_FIELDS = ("rank", "step", "site", "seconds")
_RANDOM_FIELDS = ("seed", "count", "kinds", "steps", "ranks")


def _fields(item: str, parts: list[str], allowed: tuple[str, ...], syntax: str) -> dict[str, str]:
    """``["rank=1", "step=2"]`` -> ``{"rank": "1", "step": "2"}``; every malformed part is an error."""
    out: dict[str, str] = {}
    for part in parts:
        key, sep, val = part.partition("=")
        key, val = key.strip(), val.strip()
        if not sep or key not in allowed:
            raise ConfigError(
                f"bad fault option {part!r} in {item!r}; use {', '.join(k + '=' for k in allowed)} "
                f"(syntax {syntax})"
            )
        if not val:
            raise ConfigError(f"fault {item!r}: {key}= has no value; write e.g. {syntax}")
        if key in out:  # silently keeping the last one would rehearse a fault the user did not mean
            raise ConfigError(f"fault {item!r} gives {key}= twice; keep one")
        out[key] = val
    return out


def _int(item: str, key: str, val: str, low: int = 0) -> int:
    try:
        number = int(val)
    except ValueError:
        raise ConfigError(f"fault {item!r}: {key}={val!r} is not an integer; write e.g. {key}=3") from None
    if number < low:
        raise ConfigError(f"fault {item!r}: {key}={number} must be {low} or more")
    return number


def _range(item: str, key: str, val: str, high: int | None = None) -> tuple[int, int]:
    lo_text, sep, hi_text = val.partition("-")
    if not lo_text or (sep and not hi_text):
        raise ConfigError(f"fault {item!r}: {key}={val!r} is not a range; write e.g. {key}=5-40")
    lo = _int(item, key, lo_text)
    hi = _int(item, key, hi_text) if sep else lo
    if hi < lo:
        raise ConfigError(f"fault {item!r}: {key}={val} is reversed; write the smaller end first ({hi}-{lo})")
    if high is not None and hi > high:
        raise ConfigError(f"fault {item!r}: {key}={val} goes past {high}, the largest possible value")
    return lo, hi


def expand_random(text: str, world_size: int, total_steps: int | None = None) -> list[FaultSpec]:
    """``random:seed=S:count=N:kinds=a,b:steps=LO-HI[:ranks=LO-HI]`` -> concrete faults (pure)."""
    kind, *parts = text.split(":")
    if kind.strip() != "random":
        raise ConfigError(f"fault {text!r} is not a random fault; write {_RANDOM_SYNTAX}")
    opts = _fields(text, parts, _RANDOM_FIELDS, _RANDOM_SYNTAX)
    seed = _int(text, "seed", opts.get("seed", "0"))
    kinds = [k.strip() for k in opts.get("kinds", "raise,kill").split(",")]
    for k in kinds:
        if k not in KINDS:
            raise ConfigError(f"unknown fault kind {k!r} in {text!r}; choose from {', '.join(KINDS)}")
        if k == "killall":  # a random fault has one rank; this one has every rank
            raise ConfigError(
                f"fault {text!r}: killall is not drawn at random; drop it from kinds= and give it "
                f"its own --inject {_KILLALL_SYNTAX}"
            )
    lo, hi = _range(text, "steps", opts.get("steps", f"1-{max(1, (total_steps or 50) - 1)}"))
    rlo, rhi = _range(text, "ranks", opts.get("ranks", f"0-{world_size - 1}"), high=world_size - 1)
    count = _int(text, "count", opts.get("count", "1"))
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(lo, hi + 1), min(count, hi - lo + 1)))
    return [FaultSpec(kind=rng.choice(kinds), rank=rng.randint(rlo, rhi), step=s) for s in steps]


def _parse_one(item: str, world_size: int) -> FaultSpec:
    kind, *parts = item.split(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise ConfigError(
            f"unknown fault kind {kind!r} in {item!r}; choose from {', '.join(KINDS)} (syntax {_SYNTAX})"
        )
    fields = _fields(item, parts, _FIELDS, _SYNTAX)
    if kind == "killall":
        _check_killall(item, fields)
    if kind == "wedge" and not {"rank", "step"} <= fields.keys():
        raise ConfigError(
            f"fault {item!r}: wedge needs rank= and step=, the rank whose process raises at that "
            "step until it is replaced; write e.g. wedge:rank=1:step=8"
        )
    site = fields.get("site", "step")
    if site not in SITES:
        raise ConfigError(f"unknown fault site {site!r} in {item!r}; choose from {', '.join(SITES)}")
    rank = _int(item, "rank", fields["rank"]) if "rank" in fields else None
    if rank is not None and rank >= world_size:
        raise ConfigError(
            f"fault {item!r} targets rank {rank}, but the job has {world_size} ranks (0..{world_size - 1})"
        )
    step = _int(item, "step", fields["step"]) if "step" in fields else None
    seconds = 3.0
    if "seconds" in fields:
        if kind != "slow":
            raise ConfigError(f"fault {item!r}: seconds= applies to slow faults only; drop it")
        try:
            seconds = float(fields["seconds"])
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise ConfigError(
                f"fault {item!r}: seconds={fields['seconds']!r} must be a finite number > 0; write e.g. seconds=2"
            )
    return FaultSpec(kind=kind, rank=rank, step=step, site=site, seconds=seconds)


def _check_killall(item: str, fields: dict[str, str]) -> None:
    """``killall`` kills every rank as one step begins or inside its update: it has a step and
    maybe a site (step or optimizer), and no rank."""
    if "rank" in fields:
        raise ConfigError(
            f"fault {item!r}: killall kills every rank, so rank={fields['rank']} does not apply; "
            f"drop it, or write kill:rank={fields['rank']}:step=S to kill one rank"
        )
    site = fields.get("site", "step")
    if site not in _KILLALL_SITES:
        raise ConfigError(
            f"fault {item!r}: killall fires as its step begins (site=step, the default) or half-way "
            f"through its update (site=optimizer), not at site={site}; write e.g. "
            f"killall:step=6:site=optimizer, or kill:rank=R:step=S:site={site} to kill one rank there"
        )
    if "step" not in fields:  # at "the first step" there would be no snapshot to restore
        raise ConfigError(
            f"fault {item!r} needs step=: the step every rank dies as it begins; write e.g. killall:step=6"
        )


def parse_faults(texts: list[str], world_size: int = 1, total_steps: int | None = None) -> list[FaultSpec]:
    """Parse fault specs; a bad one raises :class:`ConfigError` naming the spec, the field and the fix."""
    if world_size < 1:
        raise ConfigError(f"faults need a job of at least one rank (got world size {world_size})")
    out: list[FaultSpec] = []
    for text in texts:
        item = text.strip()
        if not item:
            raise ConfigError(f"empty fault spec {text!r}; write e.g. kill:rank=1:step=20 ({_SYNTAX})")
        if item.split(":", 1)[0].strip() == "random":
            out.extend(expand_random(item, world_size, total_steps))
        else:
            out.append(_parse_one(item, world_size))
    return out


class Injector:
    """Fires the faults meant for this rank at the matching (site, step), once each."""

    def __init__(
        self,
        specs: list[FaultSpec],
        rank: int,
        fired: set[str],
        announce: Callable[[FaultSpec, int], None],
        gather: Callable[[], None] = lambda: None,
    ) -> None:
        self.specs = list(specs)
        self.rank = rank
        self.fired = set(fired)
        self.announced: set[str] = set()  # wedge faults this process has announced (once each)
        self._announce = announce
        # before a killall: returns once every rank is at this step and this rank's copies of
        # the step's state are written (or waiting failed: the rank dies all the same)
        self._gather = gather

    def due(self, site: str, step: int) -> FaultSpec | None:
        for s in self.specs:
            if s.id in self.fired or s.site != site:
                continue
            if (s.rank is None or s.rank == self.rank) and (s.step is None or s.step == step):
                return s
        return None

    def maybe_fire(self, site: str, step: int) -> None:
        spec = self.due(site, step)
        if spec is not None:
            self.fire(spec, step)

    def fire(self, spec: FaultSpec, step: int) -> None:
        if spec.kind == "wedge":  # not fired here: this process raises again on every retry
            if spec.id not in self.announced:
                self.announced.add(spec.id)
                self._announce(spec, step)
            raise InjectedFault(f"injected fault {spec.to_text()} at step {step}")
        self.fired.add(spec.id)
        self._announce(spec, step)  # the launcher must know before we die, so no replacement repeats it
        if spec.kind == "raise":
            raise InjectedFault(f"injected fault {spec.to_text()} at step {step}")
        if spec.kind == "exit":
            os._exit(17)
        if spec.kind == "killall":
            try:
                self._gather()
            except Exception:  # a peer failed meanwhile: this rank still dies at this step
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        if spec.kind == "spin":
            while True:  # holds the GIL in short slices: heartbeats go on, the step does not
                pass
        if spec.kind == "slow":
            time.sleep(spec.seconds)
