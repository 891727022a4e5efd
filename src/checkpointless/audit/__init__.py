"""``checkpointless audit``: is a script bitwise the same through faults? (an optional tool: the
core never imports it; it runs jobs through the command line and reads their fingerprints)."""

from __future__ import annotations

from checkpointless.audit.run import main

__all__ = ["main"]
