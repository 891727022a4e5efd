"""The health checks that need torch or the operator's own code, run in a child of the agent.

``python -m checkpointless.agent.health_probe [--builtins] [--entry MODULE:FUNCTION]... --timeout S``
prints one JSON line per check (name, ok, detail, seconds); the agent reads them
(:func:`checkpointless.agent.health.run_probe`). A child process because:

* torch costs the agent seconds of CPU and hundreds of MiB to import, and a CUDA context would hold
  device memory for the life of the agent, which outlives every worker on the host;
* a wedged driver call, or a user function that never returns, can only be stopped by killing
  the process that made it.

The loopback collective: two threads of this process form a gloo group of size 2 over
127.0.0.1 (a TCPStore for the rendezvous, gloo's TCP transport for the data) and all-reduce a
tensor with a known sum. That proves what a spare needs before its first collective: torch and
gloo load, the rendezvous store works, loopback TCP connects, and data goes through and back
correctly within the deadline. A group of size 1 would prove far less: gloo opens no connection
and moves no data for it. Two processes would prove a little more (two address spaces) for a
second interpreter and torch import, seconds of CPU every interval; threads cost ~30 ms once
torch is imported. Neither proves the network between hosts; the job's own first collective does.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["check_collective", "check_cuda_matmul", "check_entry", "main"]

_ELEMENTS = 1 << 16  # 256 KiB of float32: several gloo messages, still instant
_MATMUL = 256


def _deadline_call(fn: Callable[[float], tuple[bool, str]], timeout: float) -> tuple[bool, str]:
    """``fn(deadline)`` on a daemon thread, waited for up to ``timeout`` seconds."""
    out: list[tuple[bool, str]] = []
    deadline = time.monotonic() + timeout

    def run() -> None:
        try:
            out.append(fn(deadline))
        except Exception as e:  # the check failed; the reason is its detail
            out.append((False, f"{type(e).__name__}: {e}"))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else (False, f"did not finish within {timeout:g} s (--health-timeout)")


def check_collective(deadline: float) -> tuple[bool, str]:
    """An all-reduce between two gloo ranks of this process over 127.0.0.1 (see the module doc)."""
    import torch
    import torch.distributed as dist

    left = timedelta(seconds=max(0.1, deadline - time.monotonic()))
    master = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False, timeout=left)
    sums: dict[int, float] = {}
    errors: list[str] = []

    def rank(r: int) -> None:
        try:
            store = master if r == 0 else dist.TCPStore("127.0.0.1", master.port, 2, False, timeout=left)
            group = _gloo_group(dist, dist.PrefixStore("health/", store), r, left)
            t = torch.full((_ELEMENTS,), float(r + 1))
            group.allreduce([t]).wait()
            sums[r] = float(t.sum().item())
        except Exception as e:  # reported as the check's detail
            errors.append(f"rank {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        return False, "; ".join(errors)
    want = 3.0 * _ELEMENTS  # (1 + 2) in every element
    if len(sums) < 2:
        return False, "the all-reduce did not complete in time"
    if any(v != want for v in sums.values()):
        return False, f"the all-reduce gave {sorted(sums.values())}, expected {want:g} on both ranks"
    return True, f"gloo all-reduce of {_ELEMENTS * 4 >> 10} KiB between 2 ranks over 127.0.0.1"


def _gloo_group(dist: Any, store: Any, rank: int, timeout: timedelta) -> Any:
    """A gloo group bound to the loopback interface (not the host's default one)."""
    pg = dist.ProcessGroupGloo
    if hasattr(pg, "_Options"):
        opts = pg._Options()
        opts._devices = [pg.create_device(hostname="127.0.0.1")]
        opts._timeout = timeout
        return pg(store, rank, 2, opts)
    return pg(store, rank, 2, timeout)


def check_cuda_matmul(deadline: float) -> tuple[bool, str]:
    """On every visible device: ones(n, n) @ (2 * ones(n, n)) must be 2n everywhere (exact in
    float32 and TF32). Passes with "no CUDA" where torch sees no device."""
    import torch

    if not torch.cuda.is_available():
        return True, "no CUDA"
    n = _MATMUL
    for i in range(torch.cuda.device_count()):
        with torch.cuda.device(i):
            a = torch.ones((n, n), device="cuda")
            b = torch.full((n, n), 2.0, device="cuda")
            c = a @ b
            torch.cuda.synchronize()
            bad = int((c != 2.0 * n).sum().item())
            if bad:
                return False, f"cuda:{i}: {bad} of {n * n} elements of a {n}x{n} matmul are wrong"
        if time.monotonic() > deadline:
            return False, f"cuda:{i}: the matmul took past the deadline"
    return True, f"{n}x{n} matmul right on {torch.cuda.device_count()} device(s)"


def check_entry(spec: str) -> tuple[bool, str]:
    """``MODULE:FUNCTION``, called with no arguments: True passes; False, anything else or an
    exception fails."""
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name)
    result = fn()
    if result is True:
        return True, "returned True"
    return False, f"returned {result!r}"


def _entry(spec: str, _deadline: float) -> tuple[bool, str]:
    return check_entry(spec)


def _emit(name: str, start: float, result: tuple[bool, str]) -> None:
    ok, detail = result
    record = {"name": name, "ok": ok, "detail": detail, "seconds": time.monotonic() - start}
    print(json.dumps(record), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkpointless.agent.health_probe")
    ap.add_argument("--builtins", action="store_true", help="the loopback collective and the CUDA checks")
    ap.add_argument("--entry", action="append", default=[], metavar="MODULE:FUNCTION")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds each check may take")
    args = ap.parse_args(argv)
    if args.builtins:
        # the import is this process's start-up, not a check: it counts against the agent's
        # limit for the whole process, never against a check's own deadline
        import torch.distributed  # noqa: F401

        start = time.monotonic()
        _emit("collective", start, _deadline_call(check_collective, args.timeout))
        start = time.monotonic()
        _emit("cuda_matmul", start, _deadline_call(check_cuda_matmul, args.timeout))
    for spec in args.entry:
        start = time.monotonic()
        _emit(f"entry:{spec}", start, _deadline_call(functools.partial(_entry, spec), args.timeout))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
