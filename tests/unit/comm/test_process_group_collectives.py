"""Every c10d collective, DTensor and DCP over process groups that survive a recovery.

FSDP2 issues only all-gathers, reduce-scatters and all-reduces, but the code that users run
beside it on the same mesh reaches the rest: DTensor's ``distribute_tensor`` scatters or
broadcasts and ``redistribute`` all-to-alls, ``full_tensor`` and functional collectives are
called from C++ with the group resolved by name, ``torch.distributed.checkpoint`` gathers and
scatters objects, pipeline stages send and receive. Four real processes (gloo, CPU) run one
battery of all of them on a 1-D mesh's group, once on torch's own gloo group and once on ours
before and after a reconfiguration to the next generation; every rank's results must be bit for
bit the same in all three. Then a rank waiting in a receive and one waiting in a functional
all-reduce for a stopped peer are woken by an abort.
"""

from __future__ import annotations

import datetime
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.ranks import spawn_ranks

pytestmark = pytest.mark.timeout(180)

WORLD = 4


def _bytes(t: Any) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(__import__("torch").uint8).numpy())


def _battery(rank: int, mesh: Any, ckpt: Path) -> dict[str, Any]:
    """Every collective once; what each rank got, as bytes (or plain values)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    pg = mesh.get_group(0)
    g = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {}

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    t = rnd(5)
    dist.broadcast(t, group_src=2, group=pg)
    out["broadcast"] = _bytes(t)
    t = rnd(5)
    dist.all_reduce(t, group=pg)
    out["all_reduce"] = _bytes(t)
    t = rnd(5)
    dist.reduce(t, group_dst=1, op=dist.ReduceOp.MAX, group=pg)
    out["reduce"] = _bytes(t) if rank == 1 else b""
    parts = [torch.empty(3) for _ in range(WORLD)]
    dist.all_gather(parts, rnd(3), group=pg)
    out["all_gather"] = b"".join(_bytes(p) for p in parts)
    flat = torch.empty(3 * WORLD)
    dist.all_gather_into_tensor(flat, rnd(3), group=pg)
    out["all_gather_into_tensor"] = _bytes(flat)
    one = torch.empty(3)
    dist.reduce_scatter_tensor(one, rnd(3 * WORLD), group=pg)
    out["reduce_scatter_tensor"] = _bytes(one)
    dist.reduce_scatter(one, [rnd(3) for _ in range(WORLD)], group=pg)
    out["reduce_scatter"] = _bytes(one)
    # ours carries a reduce-scatter as the all-reduce gloo's is made of: the same sums in the
    # same order, bit for bit, also where the order shows (magnitudes from 1e-5 to 1e5, four
    # ranks, sizes that gloo's all-reduce cuts differently), on a 2-D input, in bfloat16, for MAX
    for rows in (1, 700, 20_000):
        spread = rnd(WORLD * rows, 3) * torch.exp(rnd(WORLD * rows, 3) * 4)
        part = torch.empty(rows, 3)
        dist.reduce_scatter_tensor(part, spread, group=pg)
        out[f"reduce_scatter_tensor_{rows}x3"] = _bytes(part)
    half = torch.empty(9, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(half, rnd(9 * WORLD).to(torch.bfloat16), group=pg)
    out["reduce_scatter_tensor_bf16"] = _bytes(half)
    dist.reduce_scatter_tensor(one, rnd(3 * WORLD), op=dist.ReduceOp.MAX, group=pg)
    out["reduce_scatter_tensor_max"] = _bytes(one)
    parts = [torch.empty(2) for _ in range(WORLD)]
    dist.gather(rnd(2), parts if rank == 2 else None, group_dst=2, group=pg)
    out["gather"] = b"".join(_bytes(p) for p in parts) if rank == 2 else b""
    one = torch.empty(2)
    dist.scatter(one, [rnd(2) for _ in range(WORLD)] if rank == 3 else None, group_src=3, group=pg)
    out["scatter"] = _bytes(one)
    parts = [torch.empty(2) for _ in range(WORLD)]
    dist.all_to_all(parts, [rnd(2) for _ in range(WORLD)], group=pg)
    out["all_to_all"] = b"".join(_bytes(p) for p in parts)
    # uneven: rank r sends r+1 elements to every peer and receives p+1 from peer p
    recv = torch.empty(sum(p + 1 for p in range(WORLD)))
    dist.all_to_all_single(
        recv, rnd(WORLD * (rank + 1)), [p + 1 for p in range(WORLD)], [rank + 1] * WORLD, pg
    )
    out["all_to_all_single"] = _bytes(recv)
    # a ring of sends and receives (even ranks send first: gloo's send can block on a full pair)
    nxt, prv = (rank + 1) % WORLD, (rank - 1) % WORLD
    got, mine = torch.empty(4), rnd(4)
    if rank % 2 == 0:
        dist.send(mine, group_dst=nxt, group=pg)
        dist.recv(got, group_src=prv, group=pg)
    else:
        dist.recv(got, group_src=prv, group=pg)
        dist.send(mine, group_dst=nxt, group=pg)
    out["send_recv"] = _bytes(got)
    if rank == 0:  # everyone else sends to rank 0, which takes them in any order
        senders = []
        for _ in range(WORLD - 1):
            got = torch.empty(1)
            senders.append(dist.recv(got, group=pg))
            out[f"recv_any_from_{senders[-1]}"] = got.item()
        out["recv_any_senders"] = sorted(senders)
    else:
        dist.send(torch.tensor([float(rank)]), group_dst=0, group=pg)
    dist.barrier(group=pg)
    # objects (what DCP's planners exchange)
    objs: list[Any] = [None] * WORLD
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank}, group=pg)
    out["all_gather_object"] = objs
    gathered: list[Any] | None = [None] * WORLD if rank == 1 else None
    dist.gather_object(("r", rank), gathered, group_dst=1, group=pg)
    out["gather_object"] = gathered
    lst: list[Any] = [{"from": 0}] if rank == 0 else [None]
    dist.broadcast_object_list(lst, group_src=0, group=pg)
    out["broadcast_object_list"] = lst
    sc: list[Any] = [None]
    dist.scatter_object_list(
        sc, [f"to{p}" for p in range(WORLD)] if rank == 2 else None, group_src=2, group=pg
    )
    out["scatter_object_list"] = sc
    # functional collectives: called from C++, the group resolved by its registered name
    out["funcol_all_reduce"] = _bytes(funcol.all_reduce(rnd(4), "sum", mesh).wait())
    out["funcol_all_gather"] = _bytes(funcol.all_gather_tensor(rnd(2, 3), 0, mesh).wait())
    out["funcol_reduce_scatter"] = _bytes(funcol.reduce_scatter_tensor(rnd(8, 2), "sum", 0, mesh).wait())
    out["funcol_all_to_all"] = _bytes(funcol.all_to_all_single(rnd(8), None, None, mesh).wait())
    # DTensor: scatter (Shard), broadcast (Replicate), all-to-all (Shard(0) -> Shard(1)), gather
    torch.manual_seed(7)  # the same full tensor on every rank; rank 0's is what is distributed
    full = torch.randn(8, 8)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    out["dtensor_shard"] = _bytes(sharded.to_local())
    out["dtensor_replicate"] = _bytes(distribute_tensor(full, mesh, [Replicate()]).to_local())
    out["dtensor_redistribute"] = _bytes(sharded.redistribute(mesh, [Shard(1)]).to_local())
    out["dtensor_full"] = _bytes(sharded.full_tensor())
    # FSDP2 trained two steps, saved with DCP, loaded into a fresh sharded model: the same shards
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(rnd(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    dcp.save(model.state_dict(), checkpoint_id=str(ckpt), process_group=pg)
    torch.manual_seed(99)
    fresh = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    fully_shard(fresh, mesh=mesh)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(ckpt), process_group=pg)
    fresh.load_state_dict(sd)
    out["dcp_roundtrip"] = all(
        _bytes(a.to_local()) == _bytes(b.to_local())
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    out["fsdp_shards"] = b"".join(_bytes(p.to_local()) for p in model.parameters())
    return out


def _abort_waits(rank: int, store: Any, rm: Any, mesh: Any) -> dict[str, Any]:
    """Rank 3 stops (alive, never sends, never joins); rank 0 waits in a receive from it and the
    others in a functional all-reduce. A thread aborts the groups; each wait must end at once."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    pg = mesh.get_group(0)
    info: dict[str, Any] = {}
    if rank == 3:
        store.set("stopped", "1")
        store.wait([f"caught{r}" for r in range(3)], datetime.timedelta(seconds=60))
        rm.abort("stopped")
        return info
    store.wait(["stopped"], datetime.timedelta(seconds=60))
    fired: dict[str, float] = {}

    def aborter() -> None:
        time.sleep(0.5)  # let the main thread block in its wait
        fired["t"] = time.monotonic()
        info["pending"] = rm.abort("peer stopped")

    th = threading.Thread(target=aborter, daemon=True)
    th.start()
    try:
        if rank == 0:
            dist.recv(torch.empty(4), group_src=3, group=pg)
        else:
            funcol.all_reduce(torch.ones(4), "sum", mesh).wait()
    except Exception as e:
        info["latency"] = time.monotonic() - fired["t"]
        info["error"] = f"{type(e).__name__}: {e}"
    th.join(5)
    store.set(f"caught{rank}", "1")
    return info


def _run(rank: int, port: int, mode: str, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    from checkpointless.comm.mesh import make_device_mesh

    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=datetime.timedelta(seconds=60))
    if mode == "torch":
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
        return {
            "gen0": _battery(
                rank, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",)), Path(tmp) / "t"
            )
        }
    rm = make_device_mesh(("shard",), (WORLD,), rank, WORLD, store)
    rm.configure(0, store, time.monotonic() + 30)
    res: dict[str, Any] = {"gen0": _battery(rank, rm.device_mesh, Path(tmp) / "o0")}
    if mode == "abort":
        res["abort"] = _abort_waits(rank, store, rm, rm.device_mesh)
    rm.configure(1, store, time.monotonic() + 30)  # the next generation, under the same objects
    rm.release_graveyard()
    res["gen1"] = _battery(rank, rm.device_mesh, Path(tmp) / "o1")
    return res


def _launch(mode: str, tmp: Path) -> dict[int, dict[str, Any]]:
    return spawn_ranks(_run, WORLD, (mode, str(tmp)), timeout=150, what=mode)


def test_every_collective_matches_torch_groups_across_generations(tmp_path: Path) -> None:
    theirs = _launch("torch", tmp_path / "torch")
    ours = _launch("ours", tmp_path / "ours")
    for rank in range(WORLD):
        ref = theirs[rank]["gen0"]
        assert ref["dcp_roundtrip"], f"rank {rank}: DCP on torch's groups did not round-trip"
        assert ref["recv_any_senders" if rank == 0 else "all_reduce"]
        for gen in ("gen0", "gen1"):
            got = ours[rank][gen]
            assert got.keys() == ref.keys()
            differ = sorted(k for k in ref if got[k] != ref[k])
            assert not differ, f"rank {rank} {gen}: differs from torch's gloo group in {differ}"
    # the battery really moved data between ranks (a no-op group would pass the comparison of
    # two no-ops): all-gathered parts differ per rank, and rank 0 heard from every peer
    assert len({theirs[r]["gen0"]["scatter"] for r in range(WORLD)}) == WORLD
    assert theirs[0]["gen0"]["recv_any_senders"] == [1, 2, 3]
    assert theirs[1]["gen0"]["gather_object"] == [("r", r) for r in range(WORLD)]


def test_abort_wakes_a_receive_and_a_functional_collective(tmp_path: Path) -> None:
    res = _launch("abort", tmp_path)
    for rank in range(3):
        info = res[rank]["abort"]
        assert "error" in info, f"rank {rank}: its wait for a stopped peer completed"
        assert "aborted" in info["error"], info["error"]
        assert info["latency"] < 1.0, f"rank {rank} left {info['latency']:.2f} s after the abort"
        assert info["pending"] >= 1, f"rank {rank} was not waiting on the group when it was aborted"
    # and the next generation works on the same objects
    assert res[0]["gen1"]["dcp_roundtrip"]
