"""What sending each rank's generator records to its keeper on another host costs a step
(recovery/rank_rng_peer.py), side by side with the same loop keeping them on this host only.

Per step a rank (1) as the step begins compares the generators it captures anyway with its
kept record, (2) as the step issues its first collective captures and keeps the record of
where the next step starts (~12.7 KB: one write to its shared-memory file and, with the copy
on, one sealed frame to its keeper's connection), (3) as its update begins checks that nothing
drew since, and (4) as it commits checks torch's generators. Both loops do all of that; the
"peer" loop also sends, to a keeper in a process of its own listening on another loopback
address (a second host to the code). The wall time of (1)-(4) per step and the thread CPU time are compared
(medians over interleaved rounds, so that both loops see the same load), and their difference
divided by the overhead benchmark's median step (``--step-ms``, 47.6 ms: 2 ranks, the example
GPT) for the share. ``send_cpu_us`` is the training thread's CPU inside the send (on loopback
it includes the receiving side's kernel work).

    .venv/bin/python benchmarks/rank_rng_peer.py          # 5 rounds of 2000 steps each way

It writes ``benchmarks/results/rank_rng_peer.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl

from checkpointless.recovery.rank_rng import RankRngKeeper, RngRecord, encode_record
from checkpointless.recovery.rank_rng_peer import PeerRecords
from checkpointless.rendezvous.server import KeyServer
from checkpointless.state.snapshot import capture_rng
from checkpointless.state.stream import StreamRoute

SECRET = b"b" * 32


def keeper_process(conn: Connection, owner_address: str) -> None:
    """The keeper (rank 1) in a process of its own, as in a job: its key server on another
    loopback address; answers "newest" with the newest step it holds of rank 0's records."""
    server = KeyServer("127.0.0.2", 0, SECRET)
    server.start()
    keeper = PeerRecords()
    keeper.place(1, 0)
    keeper.resume(0, StreamRoute(server, [owner_address, server.address], SECRET, "x"))
    conn.send(server.address)
    while (msg := conn.recv()) != "stop":
        conn.send(max((r.step for r in keeper.held(0)), default=-1) if msg == "newest" else None)
    server.stop()


def pair(server: KeyServer, keeper_address: str) -> PeerRecords:
    """The owner (rank 0), connected to its keeper in the other process."""
    owner = PeerRecords()
    owner.place(0, 1)
    owner.resume(0, StreamRoute(server, [server.address, keeper_address], SECRET, "x"))
    deadline = time.monotonic() + 10
    while owner.sent_frames == 0 and time.monotonic() < deadline:  # the connection opens
        owner.send(0, encode_record(RngRecord(0, capture_rng())))
        time.sleep(0.01)
    return owner


def one_round(
    steps: int, directory: Path, owner: PeerRecords | None, keeper: Connection | None
) -> dict[str, float]:
    rng = RankRngKeeper()
    rng.configure(directory, 0)
    send_cpu = [0.0]
    if owner is not None:
        send = owner.send

        def timed(step: int, data: bytes) -> None:
            t = time.thread_time()
            send(step, data)
            send_cpu[0] += time.thread_time() - t

        rng.mirror = timed
        frames0 = owner.sent_frames
    spent = 0.0
    cpu0, proc0 = time.thread_time(), time.process_time()
    for index in range(1, steps + 1):
        entry = capture_rng()  # StepRecord.begin's capture: there without this work, not counted
        t0 = time.perf_counter()
        rng.at_entry(index, entry)
        spent += time.perf_counter() - t0
        torch.rand(64)  # the forward draws (dropout, batches)
        t0 = time.perf_counter()
        rng.at_collective(index)  # guard.py: the first gradient all-reduce
        rng.at_update(index)  # the optimizer's pre-hook
        rng.at_commit(index)  # commit.py
        spent += time.perf_counter() - t0
    out = {
        "wall_us": spent / steps * 1e6,
        "thread_cpu_us": (time.thread_time() - cpu0) / steps * 1e6,
        "process_cpu_us": (time.process_time() - proc0) / steps * 1e6,
        "send_cpu_us": send_cpu[0] / steps * 1e6,  # the training thread's CPU inside the send
    }
    if owner is not None and keeper is not None:
        deadline = time.monotonic() + 10
        newest = -1
        while newest < steps + 1 and time.monotonic() < deadline:
            keeper.send("newest")
            newest = keeper.recv()
            time.sleep(0.01)
        out["frames"] = float(owner.sent_frames - frames0)
        out["keeper_newest"] = float(newest)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=47.6, help="the step time to compare with")
    ap.add_argument("--out", default=str(bl.RESULTS / "rank_rng_peer.json"), help="JSON output")
    args = ap.parse_args()
    machine = bl.machine_info()
    t_start = time.monotonic()
    torch.set_num_threads(1)
    server = KeyServer("127.0.0.1", 0, SECRET)
    server.start()
    here, there = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(target=keeper_process, args=(there, server.address))
    child.start()
    rounds: dict[str, list[dict[str, float]]] = {"local": [], "peer": []}
    try:
        owner = pair(server, here.recv())
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
            one_round(200, Path(d), owner, here)  # warm-up
            for i in range(args.rounds):  # interleaved, so both loops see the same load
                for loop in bl.interleaved(("local", "peer"), i):
                    peer = loop == "peer"
                    rounds[loop].append(one_round(args.steps, Path(d), owner if peer else None, here))
        owner.close()
    finally:
        here.send("stop")
        child.join(10)
        server.stop()

    def med(loop: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rounds[loop]), 1)

    machine["bench_wall_s"] = time.monotonic() - t_start
    machine["load_note"] = bl.load_note(machine["loadavg_start"], [round(x, 2) for x in os.getloadavg()])
    extra_wall = med("peer", "wall_us") - med("local", "wall_us")
    result = {
        "benchmark": "rank_rng_peer",
        "command": "python benchmarks/rank_rng_peer.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "params": vars(args),
        "rounds": rounds,
        "local_wall_us_median": med("local", "wall_us"),
        "peer_wall_us_median": med("peer", "wall_us"),
        "local_thread_cpu_us_median": med("local", "thread_cpu_us"),
        "peer_thread_cpu_us_median": med("peer", "thread_cpu_us"),
        "local_process_cpu_us_median": med("local", "process_cpu_us"),
        "peer_process_cpu_us_median": med("peer", "process_cpu_us"),
        "peer_send_cpu_us_median": med("peer", "send_cpu_us"),
        "extra_wall_us_per_step": round(extra_wall, 1),
        "extra_share_of_step": extra_wall / (args.step_ms * 1e3),
        "frames_per_step": [r["frames"] / args.steps for r in rounds["peer"]],
        "keeper_had_the_last_step": all(r["keeper_newest"] == args.steps + 1 for r in rounds["peer"]),
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "rounds")}, indent=1))
    bl.save_result(args.out, result)


if __name__ == "__main__":
    main()
