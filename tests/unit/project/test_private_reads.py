"""No module reads another class's private attributes (issue 35).

A static scan of the source's syntax trees, nothing imported: every access ``x._name`` where
``x`` is not ``self`` or ``cls`` must be one of two things.

* A read of one of *our* private attributes (assigned as ``self._name`` or declared in a class
  body: a field, a slot, a method) from inside a class that declares it: an ``__eq__`` reading
  ``other._name`` of its own class is fine, any other module or class is not (the owner gets a
  public method or property instead).
* A read of another library's internals (torch's, Hugging Face's, ``os._exit``), named in
  :data:`THIRD_PARTY` with the reason, so that a new one is seen in review.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.timeout(60)

PACKAGE = ROOT / "src" / "checkpointless"

# module (dotted, under src/) -> the private names it reads of another library's objects, and why.
# The one place where a private read is let through; keep each entry to the module that needs it.
THIRD_PARTY: dict[str, dict[str, str]] = {
    "checkpointless.agent.health_probe": {
        "_Options": "torch's gloo options class: the probe's group binds to the loopback interface",
        "_devices": "torch's gloo options: the device (interface) gloo listens on",
        "_timeout": "torch's gloo options carry the timeout only here",
    },
    "checkpointless.comm.data_parallel": {
        "_execution_engine": "torch autograd's engine: the only way to queue the end-of-backward callback",
        "_foreach_copy_": "torch's fused copy of a list of tensors (what DDP's own bucketing uses)",
    },
    "checkpointless.comm.torch_ddp": {
        "_Options": "torch's gloo options class: the one-rank group DDP's logger looks up",
        "_threads": "torch's gloo options: one worker thread for a group that never communicates",
        "_devices": "torch's gloo options: the device (loopback) of that group",
        "_register_backend": "c10d's only way to give a group a backend that getBackend(GLOO) finds",
        "_reset_state": "DDP's reducer: torch's own reset after an abandoned iteration (no public one)",
        "_push_all_rebuilt_params": "DDP's reducer: regroup buckets in parameter order (static-graph path)",
    },
    "checkpointless.comm.handle": {
        "_timeout": "torch's ProcessGroupNCCL.Options/ProcessGroupGloo._Options carry the timeout only here",
        "_Options": "torch's gloo options class, the one way to bind gloo to the job's interface",
        "_devices": "torch's gloo options: the device (interface) gloo listens on",
    },
    "checkpointless.rendezvous.foreign_reads": {
        "_DummyThread": "the stdlib's class of a thread Python did not start (gloo's worker), where a "
        "store read must not raise",
    },
    "checkpointless.comm.mesh": {
        "_get_default_group": "torch c10d's default group, which a device mesh adopts",
        # FSDP2's per-module state, reset after an aborted step (there is no public reset)
        "_get_fsdp_state": "FSDP2 module state",
        "_state_ctx": "FSDP2 module state",
        "_training_state": "FSDP2 module and parameter-group state",
        "_modules_to_run_forward": "FSDP2 module state",
        "_comm_ctx": "FSDP2 module state",
        "_fsdp_param_group": "FSDP2 module state (torch before 2.9: one group per module)",
        "_all_gather_result": "FSDP2 parameter-group state",
        "_post_reduce_event": "FSDP2 parameter-group state",
        "_all_reduce_state": "FSDP2 parameter-group state",
        "_reshard_after_forward_event": "FSDP2 parameter-group state",
        "_wait_all_gather_streams_on_event": "FSDP2 parameter-group state",
        "_partial_reduce_output": "FSDP2 parameter-group state",
        "_post_forward_indices": "FSDP2 parameter-group state",
        "_to_sharded": "FSDP2 parameter-group state",
    },
    "checkpointless.comm.process_group": {
        # c10d calls these private names on a group; ours forwards them to the backend's group
        "_allgather_base": "torch c10d's all-gather into one tensor, on the backend's group",
        "_reduce_scatter_base": "torch c10d's reduce-scatter of one tensor, on the backend's group",
    },
    "checkpointless.comm.work": {
        "_source_rank": "torch's dist.Work hook for a receive from any source (gloo's work knows)",
    },
    "checkpointless.faults.inject": {"_exit": "os._exit: a crash that runs no clean-up"},
    "checkpointless.state.rng_read": {
        # the global generators, read from their memory: the public getters cost more than the
        # rest of a rank's keeping, and every read is checked against them once per process
        "_rand": "NumPy's global RandomState (np.random.mtrand._rand), behind np.random.*",
        "_bit_generator": "NumPy's RandomState's bit generator: its state address and lock",
        "_inst": "Python's global random.Random (random._inst), behind random.*",
    },
    "checkpointless.integrations._hf_internals": {
        # transformers.Trainer's internals that its training loop calls between steps
        "_tr_loss": "transformers.Trainer",
        "_total_loss_scalar": "transformers.Trainer",
        "_get_num_items_in_batch": "transformers.Trainer",
        "_load_rng_state": "transformers.Trainer",
        "_get_collator_with_removed_columns": "transformers.Trainer",
        "_remove_unused_columns": "transformers.Trainer",
        "_evaluate": "transformers.Trainer",
        "_determine_best_metric": "transformers.Trainer",
        "_save_checkpoint": "transformers.Trainer",
        "_set_sync_gradients": "accelerate's GradientState",
    },
    "checkpointless.integrations._lightning_internals": {
        "_broadcast_sigterm_tensor": "Lightning's fit loop: its SIGTERM broadcast is a collective",
        "_version": "Lightning's CSV and TensorBoard loggers take a version only in their constructor",
        "_results": "Lightning's training loop keeps the on_epoch accumulators only there",
    },
    "checkpointless.integrations._lightning_seek": {
        "_data_fetcher": "Lightning's fit loop: the iterator of epoch 0, made again at the sought batch",
        "_combined_loader": "Lightning's fit loop: the training loaders, flattened, and their mode",
        "_mode": "Lightning's CombinedLoader: how it goes on when a loader runs out",
        "_restart_stage": "Lightning's fit loop: its own mark of a fit resumed inside an epoch",
        "_batches_that_stepped": "Lightning's training loop: the loggers' step, which no hook sets",
        "_iterator": "torch's DataLoader keeps a persistent-workers iterator there",
    },
    "checkpointless.integrations._lightning_resumed": {
        "_batches_that_stepped": "Lightning's training loop: the loggers' step, which no hook sets",
        "_should_accumulate": "Lightning's training loop: whether its batch ends an update's window",
    },
    "checkpointless.launcher.boot.sitecustomize": {
        "_rendezvous_handlers": "torch.distributed.rendezvous's handler table: our env:// handler",
    },
    "checkpointless.launcher.forkserver": {
        "_exit": "os._exit: a forked child must not run the parent's clean-up"
    },
    "checkpointless.comm.split_group": {
        # what torch's new_group does for a default group that makes groups itself
        # (_new_group_with_tag), done for a split named alike on its members only (no public way)
        "_get_default_group": "torch c10d's default group: the job's, or torch's own split_group runs",
        "_world": "torch c10d's registry: the parent's ranks, the default store",
        "_get_process_group_name": "torch c10d's name of the parent group, which names its splits",
        "_get_default_timeout": "torch c10d's default timeout for the backend, as new_group takes it",
        "_check_valid_timeout": "torch c10d's timeout check, as new_group makes it",
        "_register_pg_in_world": "torch c10d's bookkeeping of a group made by the default group",
    },
    "checkpointless.launcher.run_script": {
        "_exit": "os._exit: ends the worker without waiting for torch's threads",
        "_run_exitfuncs": "atexit's own runner, called before os._exit",
    },
    "checkpointless.recovery.amp": {
        "_per_optimizer_states": "torch GradScaler's per-step bookkeeping, reset as update() does",
    },
    "checkpointless.recovery.default_group": {"_get_default_group": "torch c10d's default group"},
    "checkpointless.recovery.link": {"_exit": "os._exit: a fenced worker ends at once"},
    "checkpointless.recovery.link_failover": {"_exit": "os._exit: a fenced worker ends at once"},
    "checkpointless.recovery.loader": {
        "_iterator": "torch DataLoader's cached iterator: dropping it is the one way to stop persistent workers",
    },
    "checkpointless.recovery.pipeline": {
        # torch.distributed.pipelining's schedules: no public accessor or reset (torch 2.13)
        "_stage": "a single-stage schedule's stage",
        "_stages": "a multi-stage schedule's stages",
        "_internal_losses": "the last stage's microbatch losses, left by an abandoned step",
        "_stage_forward_initialized": "a schedule's prepared flag: re-prepared on every rank after a fault",
        "_stage_backward_initialized": "a schedule's prepared flag: re-prepared on every rank after a fault",
        "_stages_forward_initialized": "a schedule's prepared flag: re-prepared on every rank after a fault",
        "_stages_backward_initialized": "a schedule's prepared flag: re-prepared on every rank after a fault",
    },
    "checkpointless.recovery.process": {"_exit": "os._exit: a fenced worker ends at once"},
    "checkpointless.recovery.sharded": {
        "_state_dict_hooks": "torch nn.Module's hooks: a plain state dict has none",
        "_state_dict_pre_hooks": "torch nn.Module's hooks: a plain state dict has none but FSDP2's",
        "_save_to_state_dict": "torch nn.Module's method, compared with a subclass's override",
    },
    "checkpointless.recovery.script_mesh": {
        "_get_default_group": "torch c10d's default group",
        "_get_root_mesh": "torch DeviceMesh's root of a sub-mesh (mesh['tp'] -> dp x tp); no public accessor",
        "_optimizer_step_pre_hooks": "torch Optimizer's pre-hooks: ours must run before the update guard's",
    },
    "checkpointless.recovery.torchrun": {"_get_default_store": "torch c10d's default group's store"},
    "checkpointless.recovery.warm_specs": {
        "_layout": "torch DeviceMesh's layout, one of the three things its equality compares",
        "_flatten_rank_map": "torch DeviceMesh's rank map, another of them; no public accessor",
        "_root_mesh": "torch DeviceMesh's root: a spare's stand-in mesh adopts the job's root mesh",
        "_get_root_mesh": "torch DeviceMesh's root of a sub-mesh; no public accessor",
    },
}


@dataclass(frozen=True)
class Read:
    module: str
    line: int
    attr: str
    owner: str  # the expression whose attribute is read, as source
    ours: bool  # whether the name is one of our classes' private names

    def __str__(self) -> str:
        whose = "ours: give its class a public method" if self.ours else "another library's: allowlist it"
        return f"{self.module}:{self.line}: .{self.attr} of {self.owner} ({whose})"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@cache
def _modules() -> dict[str, ast.Module]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(p.read_text(encoding="utf-8"), filename=str(p))
    return out


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    """What an assignment statement binds (tuple targets unpacked)."""
    if isinstance(node, ast.Assign):
        stack = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        stack = [node.target]
    else:
        return
    while stack:
        t = stack.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            stack.extend(t.elts)
        elif isinstance(t, ast.Starred):
            stack.append(t.value)
        else:
            yield t


def _walk_own(cls: ast.ClassDef) -> Iterator[ast.AST]:
    """The nodes inside a class, not descending into the classes nested in it."""
    stack: list[ast.AST] = list(cls.body)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.ClassDef))


def _declared(cls: ast.ClassDef) -> set[str]:
    """The private names a class declares: its body's fields, slots and methods, and every
    ``self._name = ...`` in its methods (a nested class declares its own)."""
    names: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        for t in _targets(stmt):
            if not isinstance(t, ast.Name):
                continue
            names.add(t.id)
            value = getattr(stmt, "value", None)
            if t.id == "__slots__" and value is not None:
                names.update(
                    c.value
                    for c in ast.walk(value)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                )
    for node in _walk_own(cls):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return {n for n in names if _private(n)}


def _owners(trees: Iterable[ast.Module]) -> dict[str, frozenset[str]]:
    """Private attribute names -> the names of the classes (in ``trees``) that declare them."""
    owners: dict[str, set[str]] = defaultdict(set)
    for tree in trees:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for name in _declared(cls):
                owners[name].add(cls.name)
    return {name: frozenset(classes) for name, classes in owners.items()}


@cache
def _ours() -> dict[str, frozenset[str]]:
    return _owners(_modules().values())


def _reads(module: str, tree: ast.Module, ours: dict[str, frozenset[str]]) -> list[Read]:
    """Every ``x._name`` in ``tree`` (``x`` not ``self``/``cls``) but our classes' reads of the
    private names they declare themselves."""
    found: list[Read] = []

    def visit(node: ast.AST, inside: str | None) -> None:
        if isinstance(node, ast.ClassDef):
            inside = node.name
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            is_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            own_class = inside is not None and inside in ours.get(node.attr, ())
            if not is_self and not own_class:
                found.append(Read(module, node.lineno, node.attr, ast.unparse(node.value), node.attr in ours))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, None)
    return found


def test_no_module_reads_another_classes_private_attributes() -> None:
    ours = _ours()
    bad = [
        str(r)
        for module, tree in _modules().items()
        for r in _reads(module, tree, ours)
        if r.attr not in THIRD_PARTY.get(module, {})
    ]
    assert bad == []


def test_every_allowed_read_is_still_there() -> None:
    """An allowlist entry whose read has gone goes too: the list stays what the code needs."""
    stale = []
    for module, names in THIRD_PARTY.items():
        tree = _modules().get(module)
        read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} if tree is not None else set()
        stale += [f"{module}: {name}" for name in names if name not in read]
    assert stale == []


def test_the_scan_sees_what_it_looks_for() -> None:
    """The scan is not vacuous: it finds the names a class declares, lets a class read its own
    kind's fields, and catches the reads from outside (a subclass, a function, a library)."""
    assert {"_stop", "_thread", "_error"} <= set(_ours())
    tree = ast.parse(
        "class A:\n"
        "    __slots__ = ('_s',)\n"
        "    _c: int = 0\n"
        "    def __init__(self): self._a, self._b = 1, 2\n"
        "    def _m(self): pass\n"
        "    def __eq__(self, o): return self._a == o._a and o.__class__ is A\n"
        "class B(A):\n"
        "    def f(self, o): return o._b, self._c\n"
        "def g(a, t):\n"
        "    return a._a, a._s, a._c, a._m(), t._foreign, cls._x\n"
    )
    ours = _owners([tree])
    assert set(ours) == {"_a", "_b", "_c", "_m", "_s"}
    found = [f"{r.line}: {r.owner}.{r.attr} {r.ours}" for r in _reads("t", tree, ours)]
    assert found == [
        "8: o._b True",
        "10: a._a True",
        "10: a._s True",
        "10: a._c True",
        "10: a._m True",
        "10: t._foreign False",
    ]
