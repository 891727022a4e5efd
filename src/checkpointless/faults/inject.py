"""Fault injection: rehearse faults in your own job.

A fault is ``KIND[:key=value...]`` with KIND one of raise, exit, kill, hang, spin, slow and keys
``rank`` (default any), ``step`` (default first), ``site`` (step, forward, backward, allreduce,
optimizer — half-way through the update —, recovery — while rejoining for that step —; default
step) and ``seconds`` (for slow). Examples::

    kill:rank=1:step=20            SIGKILL rank 1 as it starts step 20
    raise:rank=2:step=5:site=backward
    hang:rank=3:step=30            SIGSTOP: the process stops answering
    spin:rank=0:step=12            a busy loop that holds the step
    random:seed=7:count=3:kinds=raise,kill:steps=5-40

Each fault fires once per job: the worker tells the launcher before it fires, and a replacement
that re-runs the step is told which faults have already fired.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from checkpointless.errors import ConfigError

__all__ = ["KINDS", "SITES", "FaultSpec", "InjectedFault", "Injector", "expand_random", "parse_faults"]

KINDS = ("raise", "exit", "kill", "hang", "spin", "slow")
SITES = ("step", "forward", "backward", "allreduce", "optimizer", "recovery")


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


def _range(text: str, what: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition("-")
        return int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"bad {what} range {text!r} in a random fault; write e.g. {what}=5-40") from None


def expand_random(text: str, world_size: int, total_steps: int | None = None) -> list[FaultSpec]:
    """``random:seed=S:count=N:kinds=a,b:steps=LO-HI[:ranks=LO-HI]`` -> concrete faults (pure)."""
    opts = dict(kv.split("=", 1) for kv in text.split(":")[1:] if "=" in kv)
    rng = random.Random(int(opts.get("seed", 0)))
    kinds = opts.get("kinds", "raise,kill").split(",")
    for k in kinds:
        if k not in KINDS:
            raise ConfigError(f"unknown fault kind {k!r} in {text!r}; choose from {', '.join(KINDS)}")
    lo, hi = _range(opts.get("steps", f"1-{max(1, (total_steps or 50) - 1)}"), "steps")
    rlo, rhi = _range(opts.get("ranks", f"0-{world_size - 1}"), "ranks")
    count = int(opts.get("count", 1))
    steps = sorted(rng.sample(range(lo, hi + 1), min(count, hi - lo + 1)))
    return [FaultSpec(kind=rng.choice(kinds), rank=rng.randint(rlo, rhi), step=s) for s in steps]


def parse_faults(texts: list[str], world_size: int = 1, total_steps: int | None = None) -> list[FaultSpec]:
    """Parse fault specs; a bad one raises :class:`ConfigError` naming it and the syntax."""
    out: list[FaultSpec] = []
    for text in texts:
        item = text.strip()
        if item.startswith("random"):
            out.extend(expand_random(item, world_size, total_steps))
            continue
        kind, *kvs = item.split(":")
        if kind not in KINDS:
            raise ConfigError(
                f"unknown fault kind {kind!r} in {item!r}; choose from {', '.join(KINDS)} "
                "(syntax KIND:rank=R:step=S[:site=SITE][:seconds=X])"
            )
        fields: dict[str, str] = {}
        for kv in kvs:
            key, sep, val = kv.partition("=")
            if not sep or key not in ("rank", "step", "site", "seconds"):
                raise ConfigError(f"bad fault option {kv!r} in {item!r}; use rank=, step=, site= or seconds=")
            fields[key] = val
        site = fields.get("site", "step")
        if site not in SITES:
            raise ConfigError(f"unknown fault site {site!r} in {item!r}; choose from {', '.join(SITES)}")
        try:
            spec = FaultSpec(
                kind=kind,
                rank=int(fields["rank"]) if "rank" in fields else None,
                step=int(fields["step"]) if "step" in fields else None,
                site=site,
                seconds=float(fields.get("seconds", 3.0)),
            )
        except ValueError:
            raise ConfigError(f"fault {item!r}: rank and step must be integers, seconds a number") from None
        if spec.rank is not None and not 0 <= spec.rank < world_size:
            raise ConfigError(f"fault {item!r} targets rank {spec.rank}, but the job has {world_size} ranks")
        out.append(spec)
    return out


class Injector:
    """Fires the faults meant for this rank at the matching (site, step), once each."""

    def __init__(
        self, specs: list[FaultSpec], rank: int, fired: set[str], announce: Callable[[FaultSpec], None]
    ) -> None:
        self.specs = list(specs)
        self.rank = rank
        self.fired = set(fired)
        self._announce = announce

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
        self.fired.add(spec.id)
        self._announce(spec)  # the launcher must know before we die, so no replacement repeats it
        if spec.kind == "raise":
            raise InjectedFault(f"injected fault {spec.to_text()} at step {step}")
        if spec.kind == "exit":
            os._exit(17)
        if spec.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        if spec.kind == "spin":
            while True:  # holds the GIL in short slices: heartbeats go on, the step does not
                pass
        if spec.kind == "slow":
            time.sleep(spec.seconds)
