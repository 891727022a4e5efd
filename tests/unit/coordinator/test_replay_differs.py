"""A replay that recorded another loss than its interrupted attempt (protocol ``ReplayDiffers``,
recovery/replay_check.py): the coordinator writes a ``replay_differs`` event and a warning, and
``job_end`` accounts for it with the inexact resumes."""

from __future__ import annotations

import json

import pytest

from checkpointless.coordinator import Log
from checkpointless.protocol import Done, ProtocolError, ReplayDiffers, decode, encode
from tests.unit.coordinator.test_coordinator import Harness, start_job

pytestmark = pytest.mark.timeout(10)


def test_replay_differs_travels_typed_and_checked() -> None:
    msg = ReplayDiffers(step=4, interrupted="0.6931", replayed="0.7012", generation=1)
    assert decode(json.loads(json.dumps(encode(msg)))) == msg
    with pytest.raises(ProtocolError, match="step"):
        decode({"type": "replay_differs", "step": "4", "interrupted": "1", "replayed": "2"})


def test_a_replay_that_differs_is_an_event_a_warning_and_in_the_jobs_account() -> None:
    h = Harness()
    start_job(h)
    h.msg(0, ReplayDiffers(step=4, interrupted="0.5", replayed="0.25", generation=1))
    assert h.events("replay_differs") == [
        {"rank": 0, "step": 4, "generation": 1, "interrupted": "0.5", "replayed": "0.25"}
    ]
    assert any(
        isinstance(c, Log) and c.level == "warning" and "step 4 replayed to loss 0.25" in c.text
        for c in h.log
    )
    for wid in range(3):
        h.msg(wid, Done(step=9))
        h.c.on_exit(wid, 0, False, "exited with code 0", "", h.now, 0)
    h.advance(0.01)
    end = h.events("job_end")[-1]
    assert [(x["rank"], x["step"], x["what"]) for x in end["inexact"]] == [(0, 4, "replay")], end
    assert any(isinstance(c, Log) and "may differ from the run without the faults" in c.text for c in h.log)
