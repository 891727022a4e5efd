"""The job's settings checked together: rules that tie one flag to another (each field's own
rules are its ``flag``'s, settings/spec.py). Each raises :class:`~checkpointless.errors.ConfigError`
naming the flags and the fix; :meth:`JobSettings.validate` runs them."""

from __future__ import annotations

from typing import Protocol

from checkpointless.errors import ConfigError

__all__ = ["Together", "check_together"]


class Together(Protocol):
    """The settings these rules read (``JobSettings`` has them: no import of it here, which
    imports this module)."""

    @property
    def plain(self) -> bool: ...
    @property
    def agents_needed(self) -> int: ...
    @property
    def local_agent(self) -> bool: ...
    @property
    def rendezvous(self) -> str: ...
    @property
    def min_replicas(self) -> int: ...
    @property
    def nproc(self) -> int: ...
    @property
    def swap_stragglers(self) -> bool: ...
    @property
    def straggler_ratio(self) -> float: ...
    @property
    def spare_nodes(self) -> int: ...
    @property
    def port_base(self) -> int: ...
    @property
    def port_range(self) -> int: ...


def check_together(s: Together) -> None:
    """The rules between flags that do not depend on the host (see ``JobSettings.validate``)."""
    if s.plain and (s.agents_needed > 1 or not s.local_agent):
        raise ConfigError("--plain runs on one machine; drop --nnodes/--spare-nodes or --plain")
    if s.plain and s.rendezvous != "rootless":
        raise ConfigError("--plain gives the script a root-less env:// rendezvous; drop --rendezvous tcp")
    if s.min_replicas > s.nproc:
        raise ConfigError(
            f"--min-replicas {s.min_replicas} is more than the job's {s.nproc} ranks "
            "(--nproc); it can be at most --nproc (which never goes on degraded)"
        )
    if s.swap_stragglers and not s.straggler_ratio:
        raise ConfigError("--swap-stragglers needs --straggler-ratio (e.g. --straggler-ratio 1.5)")
    if s.swap_stragglers and s.spare_nodes < 1:
        raise ConfigError("--swap-stragglers needs a spare host to move to; add --spare-nodes 1")
    last = s.port_base + s.port_range - 1
    if last > 65535:
        raise ConfigError(
            f"--port-base {s.port_base} plus --port-range {s.port_range} ends at port "
            f"{last}, past 65535; lower either (or CHECKPOINTLESS_PORT_BASE / CHECKPOINTLESS_PORT_RANGE)"
        )
