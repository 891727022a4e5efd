"""The NVML health check: a GPU host passes while its devices show no new ECC or XID errors and
no retired pages (or remapped rows) pending.

It runs in the agent itself: NVML reads the driver's counters and creates no CUDA context, and a
"new" error needs memory across checks (the uncorrected ECC count when the agent started, the XID
events registered for since then). nvidia-ml-py (``import pynvml``) is optional: without it, or
without a driver, the check passes with a detail that says it was skipped. The NVML module is
passed in, so the logic is tested with a fake one (tests/unit/agent/test_health_checks.py).
"""

from __future__ import annotations

import time
from typing import Any

from checkpointless.agent.health import CheckResult

__all__ = ["NvmlWatch", "open_nvml"]

_NAME = "nvml"


def open_nvml() -> Any | None:
    """The pynvml module, initialised; None where nvidia-ml-py or the driver is missing."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # pynvml.NVMLError: no driver, no device
        return None
    return pynvml


class NvmlWatch:
    """One host's NVML baseline: uncorrected ECC counts at the start, and an XID event set."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml  # the pynvml module (or a stand-in), None without NVML
        self.handles: list[Any] = []
        self.baseline: dict[int, int] = {}  # device index -> uncorrected volatile ECC errors at start
        self.events: Any | None = None
        self.why_off = ""
        if nvml is None:
            self.why_off = "skipped: no NVML (nvidia-ml-py not installed, or no NVIDIA driver)"
            return
        try:
            self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        except Exception as e:  # pynvml.NVMLError
            self.why_off = f"skipped: NVML lists no devices ({e})"
            return
        for i, h in enumerate(self.handles):
            count = self._ecc(h)
            if count is not None:
                self.baseline[i] = count
        try:
            self.events = nvml.nvmlEventSetCreate()
            for h in self.handles:
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, self.events)
        except Exception:  # not supported on this device or driver: XIDs go unseen
            self.events = None

    def _ecc(self, handle: Any) -> int | None:
        n = self.nvml
        try:
            return int(
                n.nvmlDeviceGetTotalEccErrors(
                    handle, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
                )
            )
        except Exception:  # ECC off or not supported
            return None

    def _xids(self) -> list[str]:
        """XID events since the last call (each names its device and code)."""
        n, found = self.nvml, list[str]()
        if self.events is None:
            return found
        for _ in range(64):  # bounded: a storm of events is reported by its first few
            try:
                data = n.nvmlEventSetWait_v2(self.events, 0)
            except Exception:  # NVMLError_Timeout: none pending
                break
            found.append(f"XID {int(data.eventData)}")
        return found

    def _pending_retirement(self, handle: Any) -> bool:
        n = self.nvml
        try:
            if n.nvmlDeviceGetRetiredPagesPendingStatus(handle) == n.NVML_FEATURE_ENABLED:
                return True
        except Exception:  # not supported (newer GPUs remap rows instead)
            pass
        try:
            remapped = n.nvmlDeviceGetRemappedRows(handle)
            return bool(remapped[2]) or bool(remapped[3])  # (corrected, uncorrected, pending, failure)
        except Exception:
            return False

    def check(self) -> CheckResult:
        start = time.monotonic()
        if self.nvml is None or not self.handles:
            return CheckResult(_NAME, True, self.why_off or "skipped: no NVIDIA device", 0.0)
        problems = self._xids()
        for i, h in enumerate(self.handles):
            count = self._ecc(h)
            if count is not None and i in self.baseline and count > self.baseline[i]:
                problems.append(f"GPU {i}: {count - self.baseline[i]} new uncorrected ECC error(s)")
            if self._pending_retirement(h):
                problems.append(f"GPU {i}: retired pages or remapped rows pending (reset the GPU)")
        took = time.monotonic() - start
        if problems:
            return CheckResult(_NAME, False, "; ".join(problems), took)
        return CheckResult(_NAME, True, f"{len(self.handles)} GPU(s): no new ECC or XID errors", took)
