"""The agent's host health checks (agent/health.py, health_probe.py, health_nvml.py,
health_watch.py): each check's verdict and detail, its deadline, the child process's report, the
NVML watch against a fake NVML, and the schedule's reports."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from checkpointless.agent.health import (
    CheckResult,
    HealthConfig,
    HostHealth,
    check_memory,
    check_room,
    parse_probe_output,
    run_checks,
    run_command,
    with_deadline,
)
from checkpointless.agent.health_nvml import NvmlWatch
from checkpointless.agent.health_watch import HealthWatch
from checkpointless.errors import ConfigError
from checkpointless.protocol import HealthReport
from checkpointless.settings import JobSettings
from checkpointless.settings.checks import check_health_checks

pytestmark = pytest.mark.timeout(60)

# a module a py: check can name: this test file, importable as tests.unit.agent.test_health_checks
HERE = "tests.unit.agent.test_health_checks"


def healthy() -> bool:
    return True


def unwell() -> str:
    return "the fans are loud"


def test_memory_and_room_checks() -> None:
    assert check_memory(1 << 20) == (True, "1 MiB allocated and written")
    ok, detail = check_room(Path("/tmp"), 1, "run directory")
    assert ok and "GiB free in /tmp" in detail
    ok, detail = check_room(Path("/tmp"), 1 << 62, "run directory")
    assert not ok and "below" in detail and "--health-min-free-gib" in detail
    ok, detail = check_room(Path("/nonexistent/run"), 1, "run directory")
    assert not ok and detail == "run directory /nonexistent/run is not a directory on this host"


def test_a_check_past_its_deadline_fails_without_holding_the_caller() -> None:
    release = threading.Event()

    def blocked() -> tuple[bool, str]:
        release.wait(30)  # a hung NFS mount, say
        return True, "late"

    start = time.monotonic()
    r = with_deadline("slow", blocked, 0.2)
    release.set()
    assert not r.ok and r.detail == "did not finish within 0.2 s (--health-timeout)"
    assert time.monotonic() - start < 5
    boom = with_deadline("boom", lambda: (_ for _ in ()).throw(MemoryError("no room")), 5)
    assert not boom.ok and boom.detail == "MemoryError: no room"


def test_shell_commands_pass_by_exit_code_with_their_output_as_detail() -> None:
    assert run_command("echo all good", 5).detail == "exit 0: all good"
    r = run_command("echo 'GPU 3 missing' >&2; exit 1", 5)
    assert not r.ok and r.detail == "exit 1: GPU 3 missing" and r.name.startswith("command:")
    start = time.monotonic()
    slow = run_command("sleep 30 & sleep 30", 0.3)  # its children are killed with it
    assert not slow.ok and "did not finish within 0.3 s" in slow.detail
    assert time.monotonic() - start < 5


def test_probe_output_missing_checks_fail_with_the_reason() -> None:
    out = '{"name": "collective", "ok": true, "detail": "fine", "seconds": 0.05}\nnoise from a check\n'
    got = parse_probe_output(out, ["collective", "entry:m:f"], "killed after 30 s")
    assert got == [
        CheckResult("collective", True, "fine", 0.05),
        CheckResult("entry:m:f", False, "killed after 30 s", 0.0),
    ]


def test_run_checks_with_entry_points_and_commands(tmp_path: Path) -> None:
    cfg = HealthConfig(
        run_dir=tmp_path,
        shm_dir=tmp_path,
        checks=(f"py:{HERE}:healthy", f"py:{HERE}:unwell", "exit 3"),
        builtins="basic",  # the torch probe is tested below, once
        timeout=20,
        min_free_bytes=1,
    )
    h = run_checks(cfg, clock=lambda: 7.0)
    names = [r.name for r in h.results]
    assert names == [
        "memory",
        "room:/dev/shm",
        "room:run_dir",
        f"entry:{HERE}:healthy",
        f"entry:{HERE}:unwell",
        "command:exit 3",
    ]
    assert [r.ok for r in h.results] == [True, True, True, True, False, False]
    assert not h.ok and h.finished == 7.0
    assert h.summary() == f"entry:{HERE}:unwell: returned 'the fans are loud'; command:exit 3: exit 3"
    report = h.report(now=9.5)
    assert isinstance(report, HealthReport) and report.age == 2.5 and report.passed[4] is False


@pytest.mark.timeout(120)
def test_the_builtin_probe_runs_a_loopback_collective_and_skips_cuda_on_cpu(tmp_path: Path) -> None:
    cfg = HealthConfig(run_dir=tmp_path, shm_dir=tmp_path, builtins="all", timeout=30, min_free_bytes=1)
    h = run_checks(cfg, NvmlWatch(None))
    by = {r.name: r for r in h.results}
    assert by["collective"].ok, by["collective"]
    assert "127.0.0.1" in by["collective"].detail and by["collective"].seconds < 10
    assert by["nvml"].ok and by["nvml"].detail.startswith("skipped")
    import torch

    if not torch.cuda.is_available():
        assert by["cuda_matmul"] == CheckResult("cuda_matmul", True, "no CUDA", by["cuda_matmul"].seconds)
    assert h.ok, h.summary()


class FakeNvml:
    """The few pynvml calls the watch makes, with counters a test can move."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_FEATURE_ENABLED = 1
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, gpus: int = 2) -> None:
        self.ecc = [0] * gpus
        self.pending = [0] * gpus
        self.xids: list[int] = []

    def nvmlDeviceGetCount(self) -> int:
        return len(self.ecc)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        assert (kind, counter) == (1, 0)
        return self.ecc[h]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        return self.pending[h]

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        raise RuntimeError("not supported")

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, h: int, kinds: int, events: str) -> None:
        assert kinds == 8

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Any:
        if not self.xids:
            raise TimeoutError("none")
        return SimpleNamespace(eventData=self.xids.pop(0))


def test_nvml_fails_on_new_ecc_errors_xids_and_pending_retirements() -> None:
    nvml = FakeNvml()
    nvml.ecc[1] = 4  # errors from before the agent started are the baseline, not news
    watch = NvmlWatch(nvml)
    first = watch.check()
    assert first.ok and first.detail == "2 GPU(s): no new ECC or XID errors"
    nvml.ecc[1] = 6
    nvml.xids = [79]
    nvml.pending[0] = 1
    bad = watch.check()
    assert not bad.ok
    assert bad.detail == (
        "XID 79; GPU 0: retired pages or remapped rows pending (reset the GPU); "
        "GPU 1: 2 new uncorrected ECC error(s)"
    )
    assert NvmlWatch(None).check().ok  # no NVML: skipped, passing


def test_the_watch_reports_at_once_then_every_interval_and_to_a_new_coordinator(tmp_path: Path) -> None:
    sent: list[HealthReport] = []
    runs: list[float] = []

    def fake_run(cfg: HealthConfig, nvml: object) -> HostHealth:
        runs.append(time.monotonic())
        return HostHealth((CheckResult("memory", len(runs) > 1, "d", 0.01),), time.monotonic())

    watch = HealthWatch(
        HealthConfig(run_dir=tmp_path, interval=0.2), lambda m: sent.append(m) or True, None, fake_run
    )
    watch.start()
    deadline = time.monotonic() + 10
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    watch.stop()
    assert [m.ok for m in sent[:2]] == [False, True]
    later: list[HealthReport] = []
    watch.set_sender(lambda m: later.append(m) or True)
    assert len(later) == 1 and later[0].names == ["memory"] and later[0].age >= 0


def test_health_check_flags_are_checked() -> None:
    check_health_checks(["nvidia-smi -L", "py:mychecks:gpu_ok"])
    for bad in ("py:mychecks", "py::f", "  "):
        with pytest.raises(ConfigError, match="--health-check"):
            check_health_checks([bad])
    job = JobSettings(script=sys.argv[0], health_check=["true"], health_interval=5.0)
    cfg = HealthConfig.from_job(job, Path("/run"), {"CHECKPOINTLESS_SHM_DIR": "/dev/shm/h1"})
    assert cfg.checks == ("true",) and cfg.interval == 5.0 and cfg.shm_dir == Path("/dev/shm/h1")
    assert cfg.min_free_bytes == 1 << 30
