"""The settings of each command, each declared once (issue 35).

A shared lower layer: the launcher, the coordinator, the agents and the protocol read these, and
it imports nothing above it.

* :class:`JobSettings` (``checkpointless run`` and ``checkpointless coordinator``) and
  :class:`AgentSettings` (``checkpointless agent``): frozen dataclasses whose fields carry their
  flag, help, default and checks (:mod:`~checkpointless.settings.spec`);
* :mod:`~checkpointless.settings.argv`: their argparse flags, and the values parsed back;
* :mod:`~checkpointless.settings.jsonform`: a settings object as JSON and back;
* :mod:`~checkpointless.settings.docs`: docs/configuration.md's flag table, generated from them.
"""

from __future__ import annotations

from checkpointless.settings.agent import AgentSettings
from checkpointless.settings.argv import add_flags, values_from
from checkpointless.settings.job import MAX_PROCESSES, JobSettings, checkpoint_root
from checkpointless.settings.jsonform import from_json, to_json

__all__ = [
    "MAX_PROCESSES",
    "AgentSettings",
    "JobSettings",
    "add_flags",
    "checkpoint_root",
    "from_json",
    "to_json",
    "values_from",
]
