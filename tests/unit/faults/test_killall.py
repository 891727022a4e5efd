"""The ``killall`` fault: every rank SIGKILLed as one step begins, or half-way through its
update (``site=optimizer``), once all are there.

Parsed like the other kinds, with its own refusals (no rank, no site but step and optimizer, a step
required, not drawn at random). Fired, it announces itself, waits in the injector's ``gather``
(every rank there, its copies written) and dies by SIGKILL even if that wait fails; a forked child
shows it at both sites.
"""

from __future__ import annotations

import os
import signal

import pytest

from checkpointless.errors import ConfigError
from checkpointless.faults.inject import SITES, Injector
from checkpointless.testing import KINDS, FaultSpec, parse_faults

pytestmark = pytest.mark.timeout(10)


def test_killall_is_parsed_for_every_rank_at_its_step() -> None:
    (spec,) = parse_faults(["killall:step=6"], 4)
    assert "killall" in KINDS and spec == FaultSpec("killall", None, 6, "step")
    assert spec.to_text() == "killall:step=6"
    assert parse_faults([" killall : step = 0 "], 1) == [FaultSpec("killall", None, 0)]
    assert parse_faults(["killall:step=6:site=step"], 2) == [spec]  # the default, spelt out


def test_killall_in_the_update_is_parsed_and_written_back() -> None:
    (spec,) = parse_faults(["killall:step=4:site=optimizer"], 3)
    assert spec == FaultSpec("killall", None, 4, "optimizer")
    assert spec.to_text() == "killall:step=4:site=optimizer"
    assert parse_faults([spec.to_text()], 3) == [spec]  # a replacement is told the faults as text
    assert spec.id != parse_faults(["killall:step=4"], 3)[0].id  # both may be in one job


@pytest.mark.parametrize(
    "text,match",
    [
        ("killall", r"'killall' needs step=.*killall:step=6"),
        ("killall:rank=1:step=6", r"rank=1 does not apply; drop it, or write kill:rank=1:step=S"),
        ("killall:step=6:site=nowhere", r"not at site=nowhere; write e.g. killall:step=6:site=optimizer"),
        ("killall:step=6:site=", r"site= has no value"),
        ("killall:step=6:site=Optimizer", r"not at site=Optimizer; write e.g. killall:step=6:site=optimizer"),
        *[
            (f"killall:step=6:site={site}", rf"not at site={site}; .* or kill:rank=R:step=S:site={site}")
            for site in SITES
            if site not in ("step", "optimizer")  # every other site, a new one included
        ],
        ("killall:step=-1", r"step=-1 must be 0 or more"),
        ("killall:step=six", r"step='six' is not an integer"),
        ("killall:step=6:seconds=2", r"seconds= applies to slow faults only"),
        ("killall:steps=6", r"bad fault option 'steps=6'"),
        ("random:kinds=kill,killall", r"killall is not drawn at random.*--inject killall:step=S"),
    ],
)
def test_bad_killall_specs_name_the_value_and_the_fix(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        parse_faults(["kill:rank=1:step=2", text], 4)
    assert repr(text) in str(info.value)  # which of several --inject flags is wrong


def test_killall_fires_at_its_step_on_every_rank_once() -> None:
    specs = parse_faults(["killall:step=6"], 3)
    for rank in range(3):
        injector = Injector(specs, rank, set(), lambda s, at: None)
        assert injector.due("step", 5) is None and injector.due("optimizer", 6) is None
        assert injector.due("step", 6) == specs[0]
    # a replacement told the fault fired (the launcher's ledger) does not fire it again
    assert Injector(specs, 1, {specs[0].id}, lambda s, at: None).due("step", 6) is None


def test_killall_in_the_update_fires_there_only() -> None:
    # the update guard asks due("optimizer", step) to damage the first parameter before it fires
    specs = parse_faults(["killall:step=4:site=optimizer", "killall:step=6"], 3)
    for rank in range(3):
        injector = Injector(specs, rank, set(), lambda s, at: None)
        assert injector.due("step", 4) is None and injector.due("forward", 4) is None
        assert injector.due("optimizer", 3) is None and injector.due("optimizer", 6) is None
        assert injector.due("optimizer", 4) == specs[0] and injector.due("step", 6) == specs[1]


def _fire_in_child(gather_fails: bool, site: str) -> tuple[int, bytes]:
    """Fork a child that fires ``killall:step=6`` at ``site``; return how it ended and what it
    wrote (``a``: announced, ``g``: gathered, ``x``: returned from the fault, which it must not)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery past this point, only os calls
        try:
            os.close(read)

            def gather() -> None:
                os.write(write, b"g")
                if gather_fails:
                    raise RuntimeError("a peer died in the barrier")

            specs = parse_faults([f"killall:step=6:site={site}"], 2)
            Injector(specs, 1, set(), lambda s, at: os.write(write, b"a"), gather).maybe_fire(site, 6)
            os.write(write, b"x")
        finally:
            os._exit(3)
    os.close(write)
    out = b""
    while chunk := os.read(read, 16):
        out += chunk
    os.close(read)
    _, status = os.waitpid(pid, 0)
    return status, out


@pytest.mark.parametrize("site", ["step", "optimizer"])
@pytest.mark.parametrize("gather_fails", [False, True])
def test_killall_announces_gathers_then_dies_by_sigkill(gather_fails: bool, site: str) -> None:
    status, out = _fire_in_child(gather_fails, site)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert out == b"ag"  # the launcher is told first, then the ranks gather, then it dies
