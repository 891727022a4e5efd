"""Adapters that let training frameworks run under checkpointless (see docs/adoption.md).

Each adapter lives in its own module and imports its framework lazily, so that the core package
never depends on it: ``from checkpointless.integrations.lightning import CheckpointlessStrategy``.
"""

from __future__ import annotations

__all__: list[str] = []
