"""Helpers for rehearsing faults in tests and drills, kept out of the training API.

A training script needs only ``checkpointless.init`` and what it returns; a test that plans faults
by (rank, step), or catches the exception a ``raise`` fault throws, imports them from here::

    from checkpointless.testing import FaultSpec, InjectedFault, parse_faults

The same specs are what ``checkpointless run --inject`` takes (docs/fault-model.md).
"""

from __future__ import annotations

from checkpointless.faults.inject import KINDS, SITES, FaultSpec, InjectedFault, parse_faults

__all__ = ["KINDS", "SITES", "FaultSpec", "InjectedFault", "parse_faults"]
