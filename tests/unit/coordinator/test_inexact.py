"""A rank that resumed without its own per-rank state says so (protocol ``Inexact``): the
coordinator writes an ``inexact`` event and a warning, and ``job_end`` accounts for every one."""

from __future__ import annotations

import json

import pytest

from checkpointless.coordinator import Log
from checkpointless.protocol import Done, Inexact, ProtocolError, decode, encode
from tests.unit.coordinator.test_coordinator import Harness, start_job

pytestmark = pytest.mark.timeout(10)


def test_inexact_travels_typed_and_checked() -> None:
    msg = Inexact(step=9, what="rng", detail="no record")
    assert decode(json.loads(json.dumps(encode(msg)))) == msg
    with pytest.raises(ProtocolError, match="step"):
        decode({"type": "inexact", "step": "9", "what": "rng"})
    with pytest.raises(ProtocolError, match="what"):
        decode({"type": "inexact", "step": 9})


def test_an_inexact_resume_is_an_event_a_warning_and_in_the_jobs_account() -> None:
    h = Harness()
    start_job(h)
    h.msg(1, Inexact(step=7, what="rng", detail="no record of rank 1's own generators"))
    assert h.events("inexact") == [
        {"rank": 1, "step": 7, "what": "rng", "detail": "no record of rank 1's own generators"}
    ]
    assert any(
        isinstance(c, Log) and c.level == "warning" and "rank 1 resumed step 7" in c.text for c in h.log
    )
    for wid in range(3):
        h.msg(wid, Done(step=9))
        h.c.on_exit(wid, 0, False, "exited with code 0", "", h.now, 0)
    h.advance(0.01)
    end = h.events("job_end")[-1]
    assert end["status"] == "ok" and [x["rank"] for x in end["inexact"]] == [1]
    assert any(isinstance(c, Log) and "may differ from the run without the faults" in c.text for c in h.log)


def test_a_job_without_any_ends_with_an_empty_account() -> None:
    h = Harness()
    start_job(h)
    for wid in range(3):
        h.msg(wid, Done(step=9))
        h.c.on_exit(wid, 0, False, "exited with code 0", "", h.now, 0)
    h.advance(0.01)
    assert h.events("job_end")[-1]["inexact"] == []
