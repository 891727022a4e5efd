"""The settings classes (issue 35): a flag is declared once, as a field, and the parser, its help,
the validation, the agents' welcome and the documented defaults all follow that field."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from checkpointless.cli import build_parser
from checkpointless.errors import ConfigError
from checkpointless.protocol import AgentWelcome, ProtocolError, decode, encode
from checkpointless.settings import AgentSettings, JobSettings, from_json, to_json, values_from
from checkpointless.settings.docs import render
from checkpointless.settings.spec import default_of, flag_fields, option
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.timeout(60)

SCRIPT = str(ROOT / "tests" / "scripts" / "slow_steps.py")


def _options(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {
        a.option_strings[-1]: a
        for a in sub.choices[command]._actions
        if a.option_strings and a.dest != "help"
    }


@pytest.mark.parametrize(
    ("command", "cls"), [("run", JobSettings), ("coordinator", JobSettings), ("agent", AgentSettings)]
)
def test_every_option_is_a_field_and_every_flag_field_an_option(command: str, cls: type) -> None:
    fields = {option(f, fl): (f, fl) for f, fl in flag_fields(cls) if not fl.positional}
    assert len(fields) == len([1 for _, fl in flag_fields(cls) if not fl.positional])  # names unique
    opts = _options(command)
    assert set(opts) == set(fields)
    for name, (f, fl) in fields.items():
        default = opts[name].default
        if default_of(f) is dataclasses.MISSING:
            assert opts[name].required, name
        elif fl.env or fl.unset:
            assert default is None, name  # resolved after parsing: the environment, --nproc
        elif fl.invert:
            assert default is False, name  # the switch is off; the field it sets is True
        else:
            assert default == default_of(f), name


def test_a_changed_default_changes_the_cli_and_fails_the_docs_check(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert render(doc) == doc  # the table is what the settings generate
    (field,) = [f for f in dataclasses.fields(JobSettings) if f.name == "hang_timeout"]
    monkeypatch.setattr(field, "default", 12.0)
    assert _options("run")["--hang-timeout"].default == 12.0
    assert "(default 12)" in _options("run")["--hang-timeout"].help
    assert render(doc) != doc


def test_parsed_flags_become_the_settings() -> None:
    args = build_parser().parse_args(
        [
            "run",
            "--nnodes",
            "2",
            "--nproc",
            "3",
            "--spare-nodes",
            "1",
            "--no-fork-server",
            "--inject",
            "kill:rank=1",
            "--run-dir",
            "r",
            SCRIPT,
            "--steps",
            "5",
        ]
    )
    cfg = JobSettings.from_flags(values_from(JobSettings, args), local_agent=False)
    assert (cfg.nproc, cfg.spares, cfg.per_node, cfg.nnodes) == (6, 3, 3, 2)  # --nproc is per host here
    assert cfg.fork_server is False and cfg.faults == ["kill:rank=1"] and cfg.run_dir == Path("r")
    assert cfg.script == SCRIPT and cfg.script_args == ["--steps", "5"] and not cfg.local_agent
    one = JobSettings.from_flags(
        values_from(JobSettings, build_parser().parse_args(["run", SCRIPT])), local_agent=True
    )
    assert one == JobSettings(script=SCRIPT, nproc_per_node=2)  # the defaults are the fields'


def test_the_environment_gives_the_port_defaults_and_the_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHECKPOINTLESS_PORT_BASE", "31000")
    monkeypatch.delenv("CHECKPOINTLESS_PORT_RANGE", raising=False)
    got = values_from(JobSettings, build_parser().parse_args(["run", "--port-range", "7", SCRIPT]))
    assert (got["port_base"], got["port_range"]) == (31000, 7)
    monkeypatch.setenv("CHECKPOINTLESS_PORT_RANGE", "x")
    with pytest.raises(ConfigError, match="CHECKPOINTLESS_PORT_RANGE='x' is not an integer"):
        values_from(JobSettings, build_parser().parse_args(["run", SCRIPT]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"nproc": 0}, "--nproc must be at least 1 (got 0)"),
        (
            {"hang_timeout": float("nan")},
            "--hang-timeout must be a finite number (got nan); e.g. --hang-timeout 10",
        ),
        (
            {"first_step_timeout": -1.0},
            "--first-step-timeout must be a positive number of seconds (got -1.0); e.g. --first-step-timeout 600",
        ),
        ({"lease": float("inf")}, "--lease must be at least 1 second (got inf); e.g. --lease 5"),
        (
            {"straggler_ratio": 0.8},
            "--straggler-ratio must be 0 (off) or above 1 (got 0.8); e.g. --straggler-ratio 1.5",
        ),
        ({"nproc_per_node": -1}, "--nproc-per-node must be at least 1 (got -1)"),
        ({"buddy_copies": "always"}, "--buddy-copies must be auto, on or off (got 'always')"),
        (
            {"buddy_every": 0},
            "--buddy-every must be a number of steps, 1 or more (got 0); 1 copies every step",
        ),
        ({"rendezvous": "x"}, "--rendezvous must be rootless or tcp (got 'x')"),
        ({"control_port": 70000}, "--control-port 70000 is not a port"),
    ],
)
def test_each_field_refuses_its_bad_values_by_name(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        JobSettings(script=SCRIPT, **change).validate()  # type: ignore[arg-type]
    assert str(e.value).startswith(message), str(e.value)


def test_the_welcome_carries_the_settings_typed_and_leaves_the_local_ones_home() -> None:
    job = JobSettings(
        script="/abs/t.py",
        script_args=["-x"],
        nproc=4,
        run_dir=Path("/tmp/r"),
        lease=2.5,
        python="/my/python",
    )
    welcome = AgentWelcome(agent_id=1, job_id="j", control="h:1", run_dir="/r", shm_key="k", job=job, term=3)
    wire = json.loads(json.dumps(encode(welcome)))
    assert (
        "python" not in wire["job"]
        and "local_agent" not in wire["job"]
        and wire["job"]["run_dir"] == "/tmp/r"
    )
    back = decode(wire)
    assert isinstance(back, AgentWelcome) and back.job == dataclasses.replace(job, python=JobSettings.python)
    assert isinstance(back.job.run_dir, Path)
    for bad in ({"nproc": "4"}, {"run_dir": 3}, {"lease": True}):
        with pytest.raises(ProtocolError, match=r"agent_welcome\.job"):
            decode({**wire, "job": {**wire["job"], **bad}})
    with pytest.raises(ProtocolError, match="missing field 'script'"):
        decode({**wire, "job": {"nproc": 2}})
    # a newer coordinator's extra setting is ignored, as for a message's fields
    assert decode({**wire, "job": {**wire["job"], "shiny": 1}}) == back
    assert from_json(JobSettings, to_json(job) | {"shiny": 1}) == dataclasses.replace(
        job, python=JobSettings.python
    )
