"""BuddyCopies over real key servers and real sockets (two ranks in one process, threads): the
keeper holds exactly the two newest verified copies, bitwise; a copy cut off is never listed;
the owner's wait ends when the copy is acknowledged."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checkpointless.errors import CommAborted, StateTransferError
from checkpointless.rendezvous import KeyServer
from checkpointless.state.buddy import BuddyCopies
from checkpointless.state.staging import staged_layout
from checkpointless.state.stream import StreamRoute
from tests.helpers.wait import deadline_in, wait_for

pytestmark = pytest.mark.timeout(60)
SECRET = b"b" * 32


@pytest.fixture(params=["socket", "file"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[BuddyCopies, BuddyCopies]]:
    """Rank 0 (owner, its copy kept by rank 1) and rank 1, generation 0 formed; both on one host,
    the copies travelling over the socket ("socket": no shared directory) or lying in the
    owner's shared-memory files ("file", state/buddy_shm.py)."""
    shm = tmp_path / "buddy" if request.param == "file" else None
    if shm is not None:
        shm.mkdir(mode=0o700)
    with _pair(shm) as got:
        yield got


@contextlib.contextmanager
def _pair(shm: Path | None) -> Iterator[tuple[BuddyCopies, BuddyCopies]]:
    servers = [KeyServer("127.0.0.1", 0, SECRET) for _ in range(2)]
    for s in servers:
        s.start()
    peers = [s.address for s in servers]
    owner = BuddyCopies(0, 1, [], timeout=10.0, shm_dir=shm)
    keeper = BuddyCopies(1, None, [0], timeout=10.0, shm_dir=shm)
    try:
        for b, s in ((owner, servers[0]), (keeper, servers[1])):
            b.resume(0, StreamRoute(s, peers, SECRET, "state/gen0"))
        yield owner, keeper
    finally:
        owner.stop(5.0)
        keeper.stop(5.0)
        for s in servers:
            s.stop()


def _state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "rng": {"torch": torch.get_rng_state()},
        "objects": {"w": torch.randn(300_000, generator=g), "b": torch.randn(7, generator=g)},
    }


def test_keeper_holds_the_two_newest_verified_copies_bitwise(pair: tuple[BuddyCopies, BuddyCopies]) -> None:
    owner, keeper = pair
    for step in range(4):
        state = _state(step)
        assert owner.start(step, state, guarded=set())
        owner.wait_sent(10.0)
        assert owner.last_send["step"] == step, owner.last_send
        wait_for(
            lambda s=step: (0, s) in keeper.held(), deadline_in(20.0), f"copy of step {step}", interval=0.01
        )
    assert keeper.held() == [(0, 2), (0, 3)]
    for step in (2, 3):
        got = keeper.copy(0, step)
        want = _state(step)
        assert got["step"] == step
        assert torch.equal(got["objects"]["w"], want["objects"]["w"])  # type: ignore[index]
        assert torch.equal(got["objects"]["b"], want["objects"]["b"])  # type: ignore[index]
    # two copies of the owner's state at most: in the keeper's memory, or in the owner's files
    one = sum(t.numel() * t.element_size() for t in _state(0)["objects"].values())  # type: ignore[union-attr]
    if keeper.shm_dir is None:
        assert one * 2 <= keeper.extra_bytes <= one * 2 + (64 << 10)
    else:
        assert keeper.extra_bytes == 0
        files = sorted(keeper.shm_dir.iterdir())
        # the two the keeper lists (the owner's undo copies too) and one spare for the next copy
        assert len(files) == 3, files


def test_a_stopped_keeper_lists_no_half_copy_and_the_owner_does_not_hang(
    pair: tuple[BuddyCopies, BuddyCopies],
) -> None:
    owner, keeper = pair
    for step in range(2):
        owner.start(step, _state(step), guarded=set())
        owner.wait_sent(10.0)
        wait_for(
            lambda s=step: (0, s) in keeper.held(), deadline_in(20.0), f"copy of step {step}", interval=0.01
        )
    keeper.stop(5.0)  # a recovery began on the keeper's side
    assert keeper.held() == [(0, 0), (0, 1)]
    t0 = time.monotonic()
    owner.start(2, _state(2), guarded=set())
    waited = owner.wait_sent(1.0)  # nobody receives: cancelled at the limit, training goes on
    assert waited < 5.0 and owner.failed == 1, (waited, owner.failed)
    assert time.monotonic() - t0 < 6.0
    assert keeper.held() == [(0, 0), (0, 1)], "a copy that never completed must not be listed"


def test_an_update_waiting_for_an_unacknowledged_copy_leaves_at_once_on_abort() -> None:
    """A keeper alive but never connecting (gone to recover): the copy is never acknowledged,
    and the update waiting for it must leave at the abort, not wait out its limit."""
    server = KeyServer("127.0.0.1", 0, SECRET)
    server.start()
    owner = BuddyCopies(0, 1, [], timeout=10.0)
    try:
        owner.resume(0, StreamRoute(server, [server.address, "127.0.0.1:9"], SECRET, "state/gen0"))
        aborted_at = time.monotonic() + 0.3
        owner.start(0, _state(0), guarded=set())
        t0 = time.monotonic()
        with pytest.raises(CommAborted, match="generation 0 aborted"):
            # without the abort this would wait the whole 30 s (the launcher's hang timeout is less)
            owner.wait_sent(30.0, lambda: "generation 0 aborted" if time.monotonic() >= aborted_at else None)
        assert time.monotonic() - t0 < 3.0
        assert owner.failed == 1, "the abandoned copy is cancelled and counted, not left streaming"
    finally:
        owner.stop(5.0)
        server.stop()


def test_a_keeper_that_leaves_fails_the_copy_at_once(pair: tuple[BuddyCopies, BuddyCopies]) -> None:
    """Over the generation's kept stream, a keeper that stops (a recovery on its side, or death)
    closes it: the owner's copy fails at once instead of waiting for an abort or its limit."""
    owner, keeper = pair
    owner.start(0, _state(0), guarded=set())
    owner.wait_sent(10.0)
    wait_for(lambda: (0, 0) in keeper.held(), deadline_in(20.0), "copy of step 0", interval=0.01)
    keeper.stop(5.0)
    owner.start(1, _state(1), guarded=set())
    t0 = time.monotonic()
    owner.wait_sent(30.0)
    assert time.monotonic() - t0 < 3.0
    assert owner.failed == 1 and owner.last_send["step"] == 0, (owner.failed, owner.last_send)
    assert keeper.held() == [(0, 0)]


def test_a_keeper_reconnects_and_copies_resume(pair: tuple[BuddyCopies, BuddyCopies]) -> None:
    """An error on one copy ends the connection; the keeper connects again and the next copy,
    manifest and all, is received and verified on the new one."""
    owner, keeper = pair
    owner.start(0, _state(0), guarded=set())
    owner.wait_sent(10.0)
    wait_for(lambda: (0, 0) in keeper.held(), deadline_in(20.0), "copy of step 0", interval=0.01)
    stream = owner._stream
    assert stream is not None and stream._sock is not None
    stream._sock.shutdown(socket.SHUT_RDWR)  # the connection breaks between two copies
    for step in (1, 2, 3):
        owner.start(step, _state(step), guarded=set())
        owner.wait_sent(10.0)
    wait_for(
        lambda: (0, 3) in keeper.held(),
        deadline_in(20.0),
        "copy of step 3 over a new connection",
        interval=0.01,
    )
    assert owner.failed <= 1, owner.failed  # at most the copy sent into the broken connection
    got = keeper.copy(0, 3)
    assert torch.equal(got["objects"]["w"], _state(3)["objects"]["w"])  # type: ignore[index]


def _file_pair(pair: tuple[BuddyCopies, BuddyCopies]) -> tuple[BuddyCopies, BuddyCopies, Path]:
    owner, keeper = pair
    if keeper.shm_dir is None:
        pytest.skip("copies in files only")
    return owner, keeper, keeper.shm_dir


def test_a_file_copy_damaged_after_it_was_listed_is_refused_not_served(
    pair: tuple[BuddyCopies, BuddyCopies],
) -> None:
    """The keeper holds only the file's name and digest: bytes changed behind its back (a bug,
    another process) must fail the copy when it is used and unlist it (the next round plans
    without it, not with it again), and a replaced file unlists it."""
    owner, keeper, shm = _file_pair(pair)
    for step in range(2):
        owner.start(step, _state(step), guarded=set())
        owner.wait_sent(10.0)
    wait_for(
        lambda: keeper.held() == [(0, 0), (0, 1)], deadline_in(20.0), "copies of steps 0 and 1", interval=0.01
    )
    ref = keeper._held[0][1].slot
    assert ref is not None
    with open(shm / ref.name, "r+b") as f:
        f.seek(1000)
        f.write(b"\xff\xfe")
    with pytest.raises(StateTransferError, match="digest"):
        keeper.copy(0, 1)
    assert keeper.held() == [(0, 0)], "a copy that failed its check is still reported"
    assert torch.equal(keeper.copy(0, 0)["objects"]["w"], _state(0)["objects"]["w"])  # type: ignore[index]
    old = keeper._held[0][0].slot
    assert old is not None
    (shm / old.name).unlink()
    assert keeper.held() == [], "a copy whose file is gone is not reported"


def test_the_owner_never_writes_a_file_its_keeper_lists(pair: tuple[BuddyCopies, BuddyCopies]) -> None:
    """While copies flow, through a broken connection and a keeper that stops: every copy the
    keeper lists still reads back bitwise, whatever the owner wrote since."""
    owner, keeper, _ = _file_pair(pair)
    for step in range(3):
        owner.start(step, _state(step), guarded=set())
        owner.wait_sent(10.0)
    stream = owner._stream
    assert stream is not None and stream._sock is not None
    stream._sock.shutdown(socket.SHUT_RDWR)  # a copy is cut off: the owner no longer knows the list
    for step in range(3, 7):
        owner.start(step, _state(step), guarded=set())
        owner.wait_sent(10.0)
    wait_for(lambda: (0, 6) in keeper.held(), deadline_in(20.0), "copy of step 6", interval=0.01)
    keeper.stop(5.0)
    for step in range(7, 9):  # nobody keeps these: the owner writes new files or spares only
        owner.start(step, _state(step), guarded=set())
        owner.wait_sent(1.0)
    assert keeper.held() == [(0, 5), (0, 6)]
    for step in (5, 6):
        got = keeper.copy(0, step)
        assert torch.equal(got["objects"]["w"], _state(step)["objects"]["w"])  # type: ignore[index]
    # the owner's own undo copies (its two newest) are intact too
    assert owner.undo_steps() == [7, 8]
    assert torch.equal(owner.undo(8)["objects"]["w"], _state(8)["objects"]["w"])  # type: ignore[index]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounts a small tmpfs (root)")
def test_a_full_shared_memory_sends_copies_over_the_socket_instead(tmp_path: Path) -> None:
    """/dev/shm too small for the copy files (a container's 64 MB): the file cannot be reserved,
    so the copies go over the socket, still kept bitwise; never a SIGBUS in the copy thread."""
    small = tmp_path / "small"
    small.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(small)], check=True)
    try:
        with _pair(small) as (owner, keeper):
            assert owner.transport == "file"
            for step in range(3):
                owner.start(step, _state(step), guarded=set())
                owner.wait_sent(10.0)
            wait_for(lambda: (0, 2) in keeper.held(), deadline_in(20.0), "copy of step 2", interval=0.01)
            assert owner.transport == "socket" and owner.failed == 0, (owner.transport, owner.failed)
            got = keeper.copy(0, 2)
            assert torch.equal(got["objects"]["w"], _state(2)["objects"]["w"])  # type: ignore[index]
            assert owner.undo_steps() == [1, 2]
            assert torch.equal(owner.undo(2)["objects"]["w"], _state(2)["objects"]["w"])  # type: ignore[index]
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_copy_cancelled_while_it_was_packed_is_never_published(
    pair: tuple[BuddyCopies, BuddyCopies],
) -> None:
    """wait_sent gives up on a copy past its timeout, and the update may then change the tensors
    being packed: a copy cancelled by then is refused, not kept as an undo copy (which a
    rollback restores without a digest check) or sent."""
    owner, _ = pair
    owner._cancel.set()  # as wait_sent leaves it when it gave up during the packing
    with pytest.raises(CommAborted, match="cancelled while it was packed"):
        owner._undo_copy(5, staged_layout(_state(5), set()))
    assert owner.undo_steps() == [], "a torn copy was published as an undo copy"
