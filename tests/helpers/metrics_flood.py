"""Hammer a /metrics endpoint with slow and fast clients; print what they saw as one JSON line.

    python tests/helpers/metrics_flood.py HOST PORT SECONDS SLOW FAST

A slow client sends half a request and waits for the server to drop it, then comes back; a fast
client sends ``GET /metrics`` and reads the answer, again and again. Used by
tests/e2e/test_metrics_hardening.py (a separate process, as a real scraper would be) and by
benchmarks/metrics_scrape.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n"


async def _slow(host: str, port: int, until: float, held: list[float]) -> None:
    while time.monotonic() < until:
        try:
            r, w = await asyncio.open_connection(host, port)
            w.write(REQUEST[:20])  # half a request line, never finished
            await w.drain()
            t = time.monotonic()  # connected: the time in the kernel's SYN queue is not the server's
            await asyncio.wait_for(r.read(), timeout=max(0.1, until - time.monotonic()))
            held.append(time.monotonic() - t)  # the server closed it
            w.close()
        except (OSError, asyncio.TimeoutError):
            await asyncio.sleep(0.05)


async def _fast(host: str, port: int, until: float, ok: list[float], errors: list[int]) -> None:
    while time.monotonic() < until:
        t = time.monotonic()
        try:
            r, w = await asyncio.open_connection(host, port)
            w.write(REQUEST)
            await w.drain()
            data = await asyncio.wait_for(r.read(), timeout=10)
            w.close()
            if data.startswith(b"HTTP/1.1 200") and b"checkpointless_goodput_ratio" in data:
                ok.append(time.monotonic() - t)
            else:
                errors.append(1)
        except (OSError, asyncio.TimeoutError):
            errors.append(1)
            await asyncio.sleep(0.01)


async def flood(host: str, port: int, seconds: float, slow: int, fast: int) -> dict[str, float]:
    until = time.monotonic() + seconds
    held: list[float] = []
    ok: list[float] = []
    errors: list[int] = []
    await asyncio.gather(
        *[_slow(host, port, until, held) for _ in range(slow)],
        *[_fast(host, port, until, ok, errors) for _ in range(fast)],
    )
    ok.sort()
    return {
        "fast_ok": len(ok),
        "fast_errors": len(errors),
        "p50_s": ok[len(ok) // 2] if ok else -1.0,
        "p99_s": ok[int(len(ok) * 0.99)] if ok else -1.0,
        "slow_dropped": len(held),
        "slow_held_max_s": max(held, default=0.0),
    }


if __name__ == "__main__":
    host, port, seconds, slow, fast = (
        sys.argv[1],
        int(sys.argv[2]),
        float(sys.argv[3]),
        *map(int, sys.argv[4:6]),
    )
    print(json.dumps(asyncio.run(flood(host, port, seconds, slow, fast))), flush=True)
