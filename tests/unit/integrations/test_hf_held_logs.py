"""Trainer's log lines held in the boundary's section are shown once, through a callback that
raises as they are shown (``HeldLogs.show``, integrations/_hf_boundary.py): called again after
the recovery, it goes on from the callback that raised, and no callback gets an entry twice."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the `hf` extra is not installed")

from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler

from checkpointless.integrations._hf_boundary import HeldLogs

pytestmark = pytest.mark.timeout(30)


class Seen(TrainerCallback):
    """Records each entry its ``on_log`` was given; raises once on the entry ``fail_on``."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.seen: list[int] = []
        self.fail_on = fail_on

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs["n"] == self.fail_on:
            self.fail_on = None
            raise RuntimeError("the tracker is unreachable")
        self.seen.append(logs["n"])


def test_a_callback_raising_as_held_lines_are_shown_resumes_at_itself() -> None:
    first, flaky, last = Seen(), Seen(fail_on=1), Seen()
    handler = CallbackHandler([first, flaky, last], None, None, None, None)
    held = HeldLogs()
    args, state, control = SimpleNamespace(), TrainerState(), TrainerControl(should_log=True)
    for n in range(3):
        held.on_log(args, state, control, {"n": n})
    assert not (first.seen or flaky.seen or last.seen)  # nothing shown inside the section
    with pytest.raises(RuntimeError, match="unreachable"):
        held.show(handler, args, state, control)
    assert (first.seen, flaky.seen, last.seen) == ([0, 1], [0], [0])
    assert handler.callbacks == [first, flaky, last]  # the handler's own list is put back
    out = held.show(handler, args, state, control)  # after the recovery: from the raising one on
    assert first.seen == flaky.seen == last.seen == [0, 1, 2]
    assert out is control and not control.should_log
    held.show(handler, args, state, control)  # everything shown: nothing again
    assert first.seen == [0, 1, 2]


def test_accelerate_lines_held_in_a_protected_function_resume_at_the_one_that_raised() -> None:
    from checkpointless.integrations._hf_accelerate_held import HeldOutput

    shown: list[str] = []
    calls = {"log": 0}

    def log(values: dict[str, Any], step: int | None, kwargs: dict[str, Any] | None) -> None:
        calls["log"] += 1  # a tracker's record: unreachable the first time
        if calls["log"] == 1:
            raise RuntimeError("the tracker is unreachable")
        shown.append(f"log {values} {step}")

    held = HeldOutput(lambda text, flush, file: shown.append(text), log)
    assert not held.print(("outside",), {})  # not inside a protected function: shown at once
    held.begin()
    assert held.print(("a", 1), {"sep": "-", "flush": True})
    assert held.log({"x": 1.5}, 3, None)
    assert held.print(("end",), {"end": ""})
    assert shown == []  # nothing shown inside the section
    with pytest.raises(RuntimeError, match="unreachable"):
        held.closed()
    assert shown == ["a-1\n"]
    held.closed()  # after the recovery: from the raising one on
    assert shown == ["a-1\n", "log {'x': 1.5} 3", "end"]
    held.closed()  # everything shown: nothing again
    assert len(shown) == 3


def test_held_lines_travel_as_json_to_a_replacement_that_shows_them_once() -> None:
    from checkpointless.integrations._hf_accelerate_held import HeldOutput
    from checkpointless.integrations._hf_boundary import ClosingLines, HeldLogs

    closing = ClosingLines()
    assert closing.encode() is None  # nothing held
    closing.logs = HeldLogs()
    assert closing.encode() is None
    state, control = TrainerState(), TrainerControl(should_log=True)
    closing.logs.on_log(SimpleNamespace(), state, control, {"n": 0, "eval_loss": 1.25})
    successor = ClosingLines()
    successor.restore(closing.encode() or b"")
    assert successor.logs is not None and successor.logs.logs == [{"n": 0, "eval_loss": 1.25}]
    seen = Seen()
    handler = CallbackHandler([seen], None, None, None, None)
    successor.logs.show(handler, SimpleNamespace(), state, control)
    assert seen.seen == [0]

    shown: list[str] = []
    held = HeldOutput(
        lambda text, flush, file: shown.append(text), lambda v, s, k: shown.append(f"{v} {s} {k}")
    )
    held.begin()
    held.print(("saved", 3), {"flush": True})
    held.log({"epoch": 1, "loss": 0.5}, 10, {"jsonl": {"a": 1}})
    data = held.encode()
    assert data is not None and shown == []
    lost = HeldOutput(
        lambda text, flush, file: shown.append(text), lambda v, s, k: shown.append(f"{v} {s} {k}")
    )
    lost.restore(data)
    lost.closed()
    assert shown == ["saved 3\n", "{'epoch': 1, 'loss': 0.5} 10 {'jsonl': {'a': 1}}"]
    held.begin()
    held.print(("to a file",), {"file": object()})  # not kept: shown in this process only
    assert held.encode() is None
