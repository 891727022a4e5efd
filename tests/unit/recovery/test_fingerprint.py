"""recovery/fingerprint.py: what each rank writes for `checkpointless audit`, and nothing without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpointless.config import ENV
from checkpointless.errors import ConfigError
from checkpointless.recovery.fingerprint import from_environ
from checkpointless.recovery.loop import LoopControl

pytestmark = pytest.mark.timeout(30)


def test_nothing_is_written_without_the_audits_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV.AUDIT_DIR, raising=False)
    assert from_environ() is None


def test_a_line_per_commit_with_inputs_grads_and_state_and_the_loop_ends_at_k(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ENV.AUDIT_DIR, str(tmp_path / "fp"))
    monkeypatch.setenv(ENV.AUDIT_STEPS, "2")
    log = from_environ()
    assert log is not None
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loop = LoopControl()
    for step in range(2):
        log.begin_step()
        x = torch.full((2, 3), float(step))
        log.add_inputs((x, {"mask": x > 0}))
        net(x).sum().backward()
        log.add_grads(opt)
        opt.step()
        log.at_commit(1, step, [net], [opt], loop)
        assert loop.stop_at == (2 if step == 1 else -1)  # ends after K = 2 committed steps
    (f,) = (tmp_path / "fp").glob("fingerprints-*.jsonl")
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    assert [(d["step"], d["rank"]) for d in lines] == [(0, 1), (1, 1)]
    assert all(d["state"] and d["grads"] and d["inputs"] for d in lines)
    assert lines[0]["inputs"] != lines[1]["inputs"] and lines[0]["state"] != lines[1]["state"]


def test_a_step_without_an_update_records_no_gradients(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ENV.AUDIT_DIR, str(tmp_path))
    monkeypatch.delenv(ENV.AUDIT_STEPS, raising=False)
    log = from_environ()
    assert log is not None and log.steps is None
    log.at_commit(0, 0, [], [], LoopControl())
    (f,) = tmp_path.glob("fingerprints-*.jsonl")
    d = json.loads(f.read_text())
    assert d["grads"] is None and d["inputs"] is None


@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_a_bad_step_count_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bad: str
) -> None:
    monkeypatch.setenv(ENV.AUDIT_DIR, str(tmp_path))
    monkeypatch.setenv(ENV.AUDIT_STEPS, bad)
    with pytest.raises(ConfigError, match=ENV.AUDIT_STEPS):
        from_environ()
