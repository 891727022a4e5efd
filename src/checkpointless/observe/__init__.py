"""Operator visibility: ``status`` and ``report`` from a run directory, Prometheus metrics, and
the launcher's progress line. Modules, one concept each: ``runfiles`` (reading a run directory),
``ledger`` (where wall time went: a pure function of the events), ``compare`` (checkpoint-restart
estimate), ``report`` and ``status`` (commands), ``timeline`` (PNG), ``metrics`` (Prometheus) and
``hooks`` (what the launcher starts). Nothing is imported here, so the launcher pays for none of
it unless asked."""

from __future__ import annotations

__all__: list[str] = []
