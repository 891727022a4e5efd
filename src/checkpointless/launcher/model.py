"""The launcher's settings: ``checkpointless run``'s flags, declared once in
:class:`checkpointless.settings.JobSettings`.

``LaunchConfig`` is that class under the launcher's name; its flags, help, checks, JSON and
documented defaults are all generated from its fields (:mod:`checkpointless.settings`).
"""

from __future__ import annotations

from typing import Any

from checkpointless.settings import MAX_PROCESSES, JobSettings, checkpoint_root, from_json, to_json

__all__ = ["MAX_PROCESSES", "LaunchConfig", "checkpoint_root", "config_from_json", "config_to_json"]

LaunchConfig = JobSettings


def config_to_json(cfg: JobSettings) -> dict[str, Any]:
    """The job's settings as JSON: the fields that travel to other hosts."""
    return to_json(cfg)


def config_from_json(raw: dict[str, Any]) -> JobSettings:
    """The settings :func:`config_to_json` sent; fields this side does not know are dropped."""
    return from_json(JobSettings, raw)
