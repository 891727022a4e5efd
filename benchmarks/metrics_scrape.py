"""/metrics at 1k and 100k committed steps: scrape latency, and the server's CPU per scrape.

The metrics (``JobMetrics``) are fed a synthetic history in process: rank 0's commits 10 ms apart,
a fault and its recovery every 10k steps from step 500 (the records a launcher and rank 0 write). No job runs:
what is measured is the metrics' own cost, which is all a scrape adds to the coordinator's
process. The bounded server (observe/httpd.py) then answers ``GET /metrics`` from a client in
this process, one request at a time: first with its body cache off (``cache_s=0``), so every
scrape collects every metric, goodput included; then with the default cache (0.25 s).

- latency: client-side, connect to last byte (p50, p99);
- CPU per scrape: the server thread's own CPU clock, over all scrapes, divided by their number;
- before: what the previous server did per scrape, ``build_ledger`` over every event and commit
  (timed directly, CPU time), for the same history.

Scrapes are paced 10 ms apart.

    .venv/bin/python benchmarks/metrics_scrape.py       # ~1 min; writes results/metrics_scrape.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from checkpointless.observe.ledger import build_ledger
from checkpointless.observe.metrics import JobMetrics

__all__ = ["main"]

OUT = Path(__file__).resolve().parent / "results" / "metrics_scrape.json"
# one scrape every 10 ms: far more than any Prometheus, and under the server's accept budget
# (400 a second), whose pauses would otherwise be what the latency measures
PACE_S = 0.01
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def history(n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(events, rank 0's commits) of a job that committed ``n`` steps."""
    t = 1001.0
    events: list[dict[str, Any]] = [
        {"event": "job_start", "time": 1000.0, "nproc": 2},
        {"event": "started", "generation": 0, "time": t},
    ]
    commits = []
    for step in range(n):
        t += 0.01
        gen = step // 10_000
        commits.append({"event": "commit", "rank": 0, "step": step, "generation": gen, "time": t})
        if step % 10_000 == 500:  # a recovery in either history: the same metric families
            fault = {"time": t + 0.005, "rank": 1, "kind": "killed"}
            events += [
                {"event": "fault", "generation": gen - 1, **fault},
                {"event": "plan", "generation": gen, "receivers": [1], "time": t + 0.01},
                {"event": "spare_assigned", "rank": 1, "worker": 2, "generation": gen, "time": t + 0.02},
                {
                    "event": "recovery", "generation": gen, "time": t + 0.3, "downtime_s": 0.295,
                    "detect_s": 0.001, "collect_s": 0.05, "rebuild_s": 0.1, "transfer_s": 0.05,
                    "first_step_s": 0.05, "faults": [fault], "state_bytes": 1000,
                },
            ]  # fmt: skip
            t += 0.3
    return events, commits


def _scrape(port: int) -> float:
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(REQUEST)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200") and b"checkpointless_goodput_ratio" in data, data[:200]
    return time.perf_counter() - t


def measure(n: int, scrapes: int) -> dict[str, Any]:
    events, commits = history(n)
    c0 = time.process_time()
    build_ledger(events, commits, now=time.time())
    before = time.process_time() - c0
    with tempfile.TemporaryDirectory() as d:
        jm = JobMetrics(Path(d))
        for e in events:
            jm.on_event(e)
        with open(Path(d) / "rank-0.jsonl", "w") as f:
            f.writelines(json.dumps(c) + "\n" for c in commits)
        while jm.steps._value.get() < n:  # the follower's pass, as in a job (4 MiB a pass)
            jm.pump(Path(d) / "rank-0.jsonl")
        # this benchmark's own copy of the history is no part of a coordinator: drop it, or the
        # garbage collector's passes over it would be charged to the scrapes
        del events, commits
        gc.collect()
        port = jm.serve("127.0.0.1", 0)
        server = jm.server
        assert server is not None
        clock = time.pthread_getcpuclockid(server._thread.ident or 0)
        runs = {}
        for cache_s in (0.0, 0.25):  # every scrape collects (the worst case); the default cache
            server.cache_s = cache_s
            for _ in range(20):
                _scrape(port)  # warm up
            cpu0 = time.clock_gettime(clock)
            lat = []
            for _ in range(scrapes):
                lat.append(_scrape(port))
                time.sleep(PACE_S)
            runs[cache_s] = (sorted(lat), time.clock_gettime(clock) - cpu0)
        held = jm.meter.held()
        jm.close()
    lat, cpu = runs[0.0]
    return {
        "steps": n,
        "scrapes": scrapes,
        "p50_ms": round(1e3 * lat[len(lat) // 2], 3),
        "p99_ms": round(1e3 * lat[int(len(lat) * 0.99)], 3),
        "server_cpu_per_scrape_ms": round(1e3 * cpu / scrapes, 3),
        "server_cpu_per_scrape_cached_ms": round(1e3 * runs[0.25][1] / scrapes, 3),
        "records_held": held,
        "before_ledger_per_scrape_ms": round(1e3 * before, 1),
    }


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scrapes", type=int, default=500)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    rows = [measure(n, a.scrapes) for n in (1_000, 100_000)]
    result = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{_cpu()} x{os.cpu_count()} (shared), {platform.python_implementation()} {platform.python_version()}",
        "command": "python benchmarks/metrics_scrape.py",
        "rows": rows,
        "cpu_ratio_100k_over_1k": round(
            rows[1]["server_cpu_per_scrape_ms"] / max(rows[0]["server_cpu_per_scrape_ms"], 1e-9), 2
        ),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['steps']:>7} steps: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
            f"server CPU {r['server_cpu_per_scrape_ms']} ms/scrape, {r['server_cpu_per_scrape_cached_ms']} cached "
            f"(before: ledger {r['before_ledger_per_scrape_ms']} ms)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
