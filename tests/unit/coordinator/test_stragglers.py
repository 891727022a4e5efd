"""The straggler-host rule (coordinator/rules/stragglers.py) as pure functions: threshold, window,
hysteresis, no false positive on noise; and the coordinator applying it to heartbeats."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.coordinator import Command, Coordinator, Emit, Kill, Log, Send
from checkpointless.coordinator.rules.stragglers import (
    StragglerRule,
    StragglerState,
    Verdict,
    host_ratios,
    judge,
)
from checkpointless.errors import ConfigError
from checkpointless.launcher.model import LaunchConfig
from checkpointless.protocol import Assign, Heartbeat, SpareReady
from tests.helpers.coordinator import formed_host_job
from tests.helpers.paths import SCRIPTS

SCRIPT = str(SCRIPTS / "slow_steps.py")


def _run(samples: list[dict[int, list[float]]], rule: StragglerRule) -> list[tuple[int, Verdict]]:
    """Feed one sample per step; return (step, verdict) for every change."""
    state = StragglerState()
    out = []
    for i, busy in enumerate(samples):
        state, verdicts = judge(state, host_ratios(busy), rule)
        out.extend((i, v) for v in verdicts)
    return out


@pytest.mark.timeout(10)
def test_ratio_is_against_the_other_hosts_median() -> None:
    r = host_ratios({0: [1.0, 1.2], 1: [3.0, 3.4], 2: [1.1, 0.9]})
    assert r[1].ratio == pytest.approx(3.2 / 1.05)
    assert r[0].ratio == pytest.approx(1.1 / 2.1)  # host 1 inflates the others' median: median(3.2, 1.0)
    assert host_ratios({0: [1.0, 2.0]}) == {}  # one host: nothing to compare with
    assert host_ratios({0: [1.0], 1: []}) == {}  # a host without figures is left out


@pytest.mark.timeout(10)
def test_a_persistently_slow_host_is_reported_once_after_the_window() -> None:
    rule = StragglerRule(ratio=1.5, window=4)
    samples = [{0: [1.0, 1.0], 1: [2.0, 2.1]} for _ in range(10)]
    got = _run(samples, rule)
    assert [(i, v.host, v.reported) for i, v in got] == [(3, 1, True)]  # 4th sample, never again
    assert got[0][1].ratio == pytest.approx(2.05)
    assert len(got[0][1].window) == 4


@pytest.mark.timeout(10)
def test_below_threshold_or_broken_window_is_not_reported() -> None:
    rule = StragglerRule(ratio=1.5, window=3)
    assert _run([{0: [1.0], 1: [1.45]}] * 10, rule) == []  # just under the threshold
    # slow two steps in three: never three in a row
    pattern = [{0: [1.0], 1: [2.0]}, {0: [1.0], 1: [2.0]}, {0: [1.0], 1: [1.0]}] * 5
    assert _run(pattern, rule) == []
    # a host missing for one step loses its window
    gap = [{0: [1.0], 1: [2.0]}, {0: [1.0], 1: [2.0]}, {0: [1.0]}, {0: [1.0], 1: [2.0]}]
    assert _run(gap, rule) == []


@pytest.mark.timeout(10)
def test_hysteresis_clears_only_below_the_clear_ratio_for_a_window() -> None:
    rule = StragglerRule(ratio=2.0, window=2)  # clear below 1.5
    slow, near, fine = {0: [1.0], 1: [2.5]}, {0: [1.0], 1: [1.8]}, {0: [1.0], 1: [1.0]}
    got = _run([slow, slow, near, near, near, slow, slow, fine, fine, slow, slow], rule)
    # near (1.8) between clear and ratio: stays reported, no repeat report; cleared after two fine
    assert [(i, v.reported) for i, v in got] == [(1, True), (8, False), (10, True)]


@pytest.mark.timeout(10)
def test_rule_rejects_bad_settings_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="--straggler-ratio must be above 1"):
        StragglerRule(ratio=1.0)
    with pytest.raises(ConfigError, match="--straggler-window"):
        StragglerRule(ratio=1.5, window=0)
    with pytest.raises(ConfigError, match="clear ratio"):
        StragglerRule(ratio=1.5, clear_ratio=1.6)


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), hosts=st.integers(2, 6), noise=st.floats(0.0, 0.15))
def test_no_false_positive_on_noise(seed: int, hosts: int, noise: float) -> None:
    """Equal hosts with up to +-15 % jitter per rank and step, and an occasional 3x spike on one
    rank (a collection pause): never a straggler at the default rule."""
    rng = random.Random(seed)
    samples = []
    for _ in range(60):
        busy = {h: [rng.uniform(1 - noise, 1 + noise) for _ in range(4)] for h in range(hosts)}
        if rng.random() < 0.1:
            busy[rng.randrange(hosts)][0] *= 3.0
        samples.append(busy)
    assert _run(samples, StragglerRule()) == []


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), slow=st.floats(1.7, 5.0))
def test_a_slow_host_among_noise_is_the_only_one_reported(seed: int, slow: float) -> None:
    rng = random.Random(seed)
    samples = [
        {h: [rng.uniform(0.9, 1.1) * (slow if h == 2 else 1.0) for _ in range(2)] for h in range(3)}
        for _ in range(30)
    ]
    got = _run(samples, StragglerRule())
    assert [(v.host, v.reported) for _, v in got] == [(2, True)]


# -- the coordinator applying the rule ---------------------------------------------------------


def _steps(c: Coordinator, first: int, last: int, slow: float) -> list[Command]:
    """Heartbeats of steps first..last: host 1's ranks are ``slow`` times as busy."""
    out: list[Command] = []
    now = 102.0 + first
    for step in range(first, last + 1):
        for wid in range(4):
            busy = 0.1 * (slow if wid >= 2 else 1.0)
            c.on_message(
                wid, Heartbeat(step=step, progress_age=0.01, step_time=0.3, busy_time=busy), now, 1e9
            )
        for host in range(3):
            c.on_agent_seen(host, now)
        c.tick(now, 1e9 + now)
        out += c.drain()
        now += 0.2
    return out


def _emitted(out: list[Command], name: str) -> list[dict[str, Any]]:
    return [x.fields for x in out if isinstance(x, Emit) and x.event == name]


@pytest.mark.timeout(10)
def test_coordinator_reports_a_slow_host_once_with_its_ratio() -> None:
    c, _ = formed_host_job(straggler_ratio=1.5, straggler_window=3)
    out = _steps(c, 1, 10, slow=3.0)
    got = _emitted(out, "straggler")
    assert len(got) == 1, got
    assert got[0]["host"] == 1 and got[0]["ranks"] == [2, 3] and got[0]["address"] == "10.0.0.1"
    assert got[0]["ratio"] == pytest.approx(3.0) and len(got[0]["window"]) == 3
    assert any(isinstance(x, Log) and "straggler host 10.0.0.1" in x.text for x in out)
    assert not [x for x in out if isinstance(x, Kill)], "report only: nothing is moved without the flag"
    assert not _emitted(_steps(c, 11, 20, slow=1.0), "straggler")
    assert _emitted(c.drain() or [], "straggler_cleared") == []  # (cleared while stepping above)


@pytest.mark.timeout(10)
def test_coordinator_never_reports_equal_hosts_or_without_the_flag() -> None:
    assert not _emitted(_steps(formed_host_job(straggler_ratio=1.5)[0], 1, 30, slow=1.2), "straggler")
    assert not _emitted(_steps(formed_host_job()[0], 1, 30, slow=4.0), "straggler")  # off by default


@pytest.mark.timeout(10)
def test_swap_moves_the_slow_hosts_ranks_to_the_spare_host() -> None:
    c, _ = formed_host_job(straggler_ratio=1.5, straggler_window=3, swap_stragglers=True)
    out = _steps(c, 1, 3, slow=3.0)
    assert _emitted(out, "straggler_swap") == [{"host": 1, "address": "10.0.0.1", "ranks": [2, 3]}]
    killed = sorted(x.worker_id for x in out if isinstance(x, Kill))
    assert killed == [2, 3] and all(x.host == 1 for x in out if isinstance(x, Kill))
    assert c.hosts[1].lost, "the slow host is fenced like a lost one"
    assert [e["ranks"] for e in _emitted(out, "host_lost")] == [[2, 3]]
    assert {e["kind"] for e in _emitted(out, "fault")} == {"killed"}, "moved, not judged hung"
    # the round runs in the same tick: the spare host's processes are assigned at once
    new = {x.message.rank: x.worker_id for x in out if isinstance(x, Send) and isinstance(x.message, Assign)}
    assert new == {2: 4, 3: 5}, "the spare host's processes take ranks 2 and 3"


@pytest.mark.timeout(10)
def test_a_swap_waits_for_the_spare_host_and_happens_once_it_is_ready() -> None:
    # reported while one of the spare host's two spares is still starting: nothing moves (the
    # rule reports a host once), and the move happens at the first step after the spare is ready
    c, _ = formed_host_job(ready=1, straggler_ratio=1.5, straggler_window=3, swap_stragglers=True)
    out = _steps(c, 1, 5, slow=3.0)
    assert len(_emitted(out, "straggler")) == 1 and not _emitted(out, "straggler_swap")
    waits = [x.text for x in out if isinstance(x, Log) and "not moving ranks [2, 3] yet" in x.text]
    assert len(waits) == 1, "the wait is logged once, not at every step"
    assert not [x for x in out if isinstance(x, Kill)]
    c.on_message(5, SpareReady(), 107.0, 1e9)
    out = _steps(c, 6, 7, slow=3.0)
    assert _emitted(out, "straggler_swap") == [{"host": 1, "address": "10.0.0.1", "ranks": [2, 3]}]
    assert sorted(x.worker_id for x in out if isinstance(x, Kill)) == [2, 3]
    new = {x.message.rank: x.worker_id for x in out if isinstance(x, Send) and isinstance(x.message, Assign)}
    assert new == {2: 4, 3: 5}


@pytest.mark.timeout(10)
def test_a_due_move_is_dropped_when_the_host_recovers() -> None:
    c, _ = formed_host_job(ready=1, straggler_ratio=1.5, straggler_window=3, swap_stragglers=True)
    _steps(c, 1, 4, slow=3.0)
    assert c.stragglers is not None and set(c.stragglers.due_moves) == {1}
    out = _steps(c, 5, 8, slow=1.0)  # as fast as the others again: cleared
    assert _emitted(out, "straggler_cleared") and not c.stragglers.due_moves
    c.on_message(5, SpareReady(), 110.0, 1e9)
    assert not _emitted(_steps(c, 9, 11, slow=1.0), "straggler_swap"), "a recovered host is not moved"


@pytest.mark.timeout(10)
def test_flags_are_checked_with_the_fix() -> None:
    for flags, match in (
        ({"straggler_ratio": 0.8}, "--straggler-ratio must be 0"),
        ({"straggler_ratio": 1.5, "straggler_window": 0}, "--straggler-window"),
        ({"swap_stragglers": True}, "--swap-stragglers needs --straggler-ratio"),
    ):
        with pytest.raises(ConfigError, match=match):
            LaunchConfig(script=SCRIPT, nproc=2, **flags).validate()
    with pytest.raises(ConfigError, match="--spare-nodes 1"):
        LaunchConfig(script=SCRIPT, nproc=2, straggler_ratio=1.5, swap_stragglers=True).validate()
