"""A hot spare decides its DTensor optimizer step's sharding while it waits, not after a fault.

Why: a replacement's first optimizer step over DTensor parameters (the 3-D job's AdamW) took
~1.5 s where a steady one takes ~0.1 s, and every survivor waited for it. torch decides each
operator's output sharding once per (operator, input specs) and caches the decision for the
process (torch 2.13: a native cache in front of ``ShardingPropagator.propagate_op_sharding``,
whose Python cache is per thread); working one out for a 3-D mesh enumerates every
placement strategy (~25 ms of CPU per operator and spec here), and a fresh process has none. The
decision depends on the mesh's layout and the tensors' global specs, not on the rank, so:

- rank 0 describes its tracked optimizers' DTensors once (:func:`describe`: the meshes' layouts,
  each parameter's and gradient's placements, global shape and dtype, the hyperparameters), and
  the launcher hands the description to every spare with its ``Prepare``;
- the spare (:func:`prewarm`, on its main thread, where the training will run) builds meshes equal
  to the job's (same rank map, layout and names; no process groups) and runs the same optimizer
  twice over zero DTensors of those specs: its cache then holds the decisions the real step needs.

A cached decision carries the mesh it was worked out on: an out-of-place operator's result lives
on that stand-in mesh. So a replacement, as it tracks its optimizer (:func:`adopt`), turns each
stand-in into a copy of the job's equal mesh (its groups, its coordinates): a result that lands on
it then communicates as the real mesh does. Nothing else differs: a cached decision is what the
replacement would have worked out itself, so every rank's state stays bitwise the fault-free run's.
A spec the description misses (or a description that cannot be made) costs what it costs today.
The warm-up costs the spare about the CPU of that first step, once, when the description arrives
(rank 0's first commit); a spare given a rank meanwhile takes it when the warm-up ends. A
stand-in is not functional before ``adopt``: only the optimizer's own operators are decided on
one, and a model's set-up does not communicate on their results.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh_module
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from checkpointless.events import get_logger

__all__ = ["adopt", "describe", "prewarm"]

log = get_logger()

# the stand-in meshes this process warmed on: a replacement makes them copies of the job's own
_STAND_INS: list[DeviceMesh] = []


class _Unsupported(Exception):
    """Something the description cannot carry: that optimizer is left out (no warm-up for it)."""


def describe(tracked: list[torch.optim.Optimizer]) -> dict[str, Any] | None:
    """The tracked optimizers over DTensors, as JSON for a spare; None when there is none."""
    meshes: list[DeviceMesh] = []
    specs: list[list[Any]] = []
    optimizers = []
    for obj in tracked:
        if getattr(torch.optim, type(obj).__name__, None) is not type(obj):
            continue  # only torch's own optimizers: a spare rebuilds them by name
        try:
            optimizers.append(_optimizer(obj, meshes, specs))
        except Exception as e:  # _Unsupported, or torch's internals moved: no warm-up, no harm
            log.debug("no spare warm-up for %s: %s: %s", type(obj).__name__, type(e).__name__, e)
    if not any(g["params"] for o in optimizers for g in o["groups"]):
        return None
    return {"meshes": [_mesh(m) for m in meshes], "specs": specs, "optimizers": optimizers}


def _optimizer(
    opt: torch.optim.Optimizer, meshes: list[DeviceMesh], specs: list[list[Any]]
) -> dict[str, Any]:
    groups = []
    for group in opt.param_groups:
        hyper = {k: _plain(k, v) for k, v in group.items() if k not in ("params", "param_names")}
        params = []
        for p in group["params"]:
            if not isinstance(p, DTensor):
                raise _Unsupported("a parameter is not a DTensor")
            grad = p.grad if isinstance(p.grad, DTensor) else p  # its spec: FSDP2's is the parameter's
            params.append([_spec(p, meshes, specs), _spec(grad, meshes, specs)])
        groups.append({"hyper": hyper, "params": params})
    return {"name": type(opt).__name__, "groups": groups}


def _plain(key: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple) and all(isinstance(x, (int, float)) for x in value):
        return list(value)
    raise _Unsupported(f"hyperparameter {key!r} is a {type(value).__name__}")


def _spec(t: DTensor, meshes: list[DeviceMesh], specs: list[list[Any]]) -> int:
    mesh = t.device_mesh
    index = next((i for i, m in enumerate(meshes) if m == mesh), None)  # FSDP2 makes equal copies
    if index is None:
        if _stand_in(_mesh(mesh)) != mesh:  # what a spare would build must equal the job's mesh
            raise _Unsupported(f"its mesh {mesh} cannot be rebuilt from its layout")
        meshes.append(mesh)
        index = len(meshes) - 1
    if not t.is_contiguous():
        raise _Unsupported("a non-contiguous DTensor")
    row = [index, [_placement(p) for p in t.placements], list(t.shape), str(t.dtype).removeprefix("torch.")]
    if row not in specs:
        specs.append(row)
    return specs.index(row)


def _placement(p: Placement) -> list[Any]:
    if type(p) is Replicate:
        return ["R"]
    if type(p) is Shard:
        return ["S", p.dim]
    if type(p) is _StridedShard:
        return ["SS", p.dim, p.split_factor]
    if type(p) is Partial:
        return ["P", p.reduce_op]
    raise _Unsupported(f"placement {p}")


def _mesh(mesh: DeviceMesh) -> dict[str, Any]:
    axes = [[list(a.shape), list(a.stride)] for a in mesh._layout.axes]
    return {
        "device": mesh.device_type,
        "ranks": list(mesh._flatten_rank_map),
        "axes": axes,
        "names": list(mesh.mesh_dim_names or ()),
    }


def _stand_in(d: dict[str, Any]) -> DeviceMesh:
    """A mesh equal to the described one (torch compares rank map, layout, names), without groups."""
    from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout

    layout = _MeshLayout(tuple(_FlatLayout(tuple(s), tuple(st)) for s, st in d["axes"]))
    ranks = torch.tensor(d["ranks"], dtype=torch.int)
    names = tuple(d["names"]) or None
    return DeviceMesh(
        d["device"],
        _layout=layout,
        _rank_map=ranks,
        mesh_dim_names=names,
        _init_backend=False,
        _rank=int(d["ranks"][0]),
    )


def _placement_of(row: list[Any]) -> Placement:
    kind = row[0]
    if kind == "R":
        return Replicate()
    if kind == "S":
        return Shard(int(row[1]))
    if kind == "SS":
        return _StridedShard(int(row[1]), split_factor=int(row[2]))
    if kind == "P":
        return Partial(str(row[1]))
    raise ValueError(f"unknown placement {row!r}")


def prewarm(recipe: dict[str, Any]) -> None:
    """As a spare: run the described optimizers' steps on stand-in DTensors (module docstring)."""
    t0 = time.monotonic()
    devices = {d["device"] for d in recipe["meshes"]} - {"cpu"}
    if not all(getattr(getattr(torch, d, None), "is_initialized", lambda: False)() for d in devices):
        # the stand-ins would allocate on a device this spare has not touched: a context of its
        # own on the host's first GPU, which the rank it takes may not even be given
        log.info("no warm-up on %s: this spare has not set up that device", sorted(devices))
        return
    with _rank_of_spare(recipe):
        steps = _run(recipe)
    log.info(
        "warmed %d optimizer step(s) over %d DTensor spec(s) in %.2f s",
        steps,
        len(recipe["specs"]),
        time.monotonic() - t0,
    )


@contextlib.contextmanager
def _rank_of_spare(recipe: dict[str, Any]) -> Iterator[None]:
    """A spare has no default group, and torch asks it for the rank to find a sub-mesh's own
    slice (``DeviceMesh.mesh``): answer a rank of every described mesh while it warms up."""
    if dist.is_initialized() or not recipe["meshes"]:
        yield
        return
    rank = int(recipe["meshes"][0]["ranks"][0])
    with mock.patch.object(device_mesh_module, "get_rank", lambda group=None: rank):
        yield


def _run(recipe: dict[str, Any]) -> int:
    meshes = [_stand_in(d) for d in recipe["meshes"]]
    # listed before any step: a decision cached on one, even by a step that then fails, must
    # find its mesh adopted in a replacement
    _STAND_INS.extend(meshes)

    def zeros(i: int) -> DTensor:
        mesh, placements, shape, dtype = recipe["specs"][i]
        return torch.distributed.tensor.zeros(
            *shape,
            dtype=getattr(torch, dtype),
            device_mesh=meshes[mesh],
            placements=[_placement_of(p) for p in placements],
        )

    steps = 0
    for o in recipe["optimizers"]:
        groups = []
        for g in o["groups"]:
            params = []
            for p_spec, g_spec in g["params"]:
                # a leaf DTensor, not an nn.Parameter: making one detaches, and a replacement
                # building its model would get that decision, and a stand-in mesh, before adopt()
                p = zeros(p_spec).requires_grad_()
                p.grad = zeros(g_spec)
                params.append(p)
            groups.append({**g["hyper"], "params": params})
        opt = getattr(torch.optim, o["name"])(groups)
        for _ in range(2):  # the first makes the state (exp_avg, ...), the second is a steady step
            opt.step()
            steps += 1
    return steps


def adopt(opt: torch.optim.Optimizer) -> None:
    """As a replacement tracking ``opt``: each stand-in equal to one of its parameters' meshes
    becomes a copy of it (groups, coordinates), so results cached on the stand-in work as on it."""
    if not _STAND_INS:
        return
    for group in opt.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            real = p.device_mesh
            for m in _STAND_INS:
                if m is not real and m == real:
                    m.__dict__.update(real.__dict__)
                    # and its root is the job's root mesh, the one object that recovery by
                    # coordinates (script_mesh.py) and torch's sub-meshes compare against
                    m._root_mesh = real._get_root_mesh()
