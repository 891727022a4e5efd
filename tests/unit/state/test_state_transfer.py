"""State transfer for real, over both transports: the gloo group and a direct stream through the
key servers (two ranks as two threads of this process)."""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from checkpointless.comm.communicator import Communicator
from checkpointless.errors import StateTransferError
from checkpointless.rendezvous import KeyServer
from checkpointless.state.codec import digest, layout
from checkpointless.state.stream import StreamRoute
from checkpointless.state.transfer import (
    _TAG_HEADER,
    _TAG_MANIFEST,
    _TAG_MESSAGE,
    _TAG_TRAILER,
    receive_state,
    send_state,
)

pytestmark = pytest.mark.timeout(60)


def _pair(sender: Callable[[Communicator], Any], receiver: Callable[[Communicator], Any]) -> list[Any]:
    store = dist.HashStore()
    out: list[Any] = [None, None]

    def run(rank: int, fn: Callable[[Communicator], Any]) -> None:
        comm = Communicator(rank, 2, datetime.timedelta(seconds=30), backend="gloo")
        comm.rebuild(0, dist.PrefixStore("g0/", store), rank, 2, time.monotonic() + 30)
        try:
            out[rank] = fn(comm)
        except Exception as e:
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r, f)) for r, f in ((0, sender), (1, receiver))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(40)
    return out


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "step": 7,
        "model": {"w": torch.rand(600, 1000, generator=g), "b": torch.rand(5, generator=g)},
        "rng": torch.get_rng_state(),
    }


def test_state_arrives_verified_and_lands_in_the_receivers_tensors() -> None:
    sent = _state(1)
    own = _state(2)
    own_w = own["model"]["w"]
    info, (tree, stats) = _pair(
        lambda c: send_state(c, sent, [1], 20), lambda c: receive_state(c, 0, 20, into=own)
    )
    assert info["messages"] == 2.0  # one pack (b, rng), one solo tensor (w)
    assert tree["step"] == 7 and torch.equal(tree["rng"], sent["rng"])
    assert torch.equal(tree["model"]["w"], sent["model"]["w"]) and torch.equal(
        tree["model"]["b"], sent["model"]["b"]
    )
    assert tree["model"]["w"].data_ptr() == own_w.data_ptr()
    assert stats["in_place_bytes"] == own_w.numel() * 4


def test_a_corrupted_message_is_refused() -> None:
    sent = _state(3)

    def bad_sender(comm: Communicator) -> None:
        lay = layout(sent)
        mbytes = lay.manifest_bytes()
        digests = [digest(mbytes), *(digest(m) for m in lay.messages)]
        lay.messages[1][1234] ^= 0xFF  # flipped on the way, after the sender's digest
        comm.wait(comm.send(torch.tensor([len(mbytes), len(lay.messages)]), 1, _TAG_HEADER), 10)
        comm.wait(comm.send(torch.frombuffer(bytearray(mbytes), dtype=torch.uint8), 1, _TAG_MANIFEST), 10)
        for i, m in enumerate(lay.messages):
            comm.wait(comm.send(m, 1, _TAG_MESSAGE + i), 10)
        trailer = torch.frombuffer(bytearray("".join(digests).encode()), dtype=torch.uint8)
        comm.wait(comm.send(trailer, 1, _TAG_TRAILER), 10)

    _, err = _pair(bad_sender, lambda c: receive_state(c, 0, 20))
    assert isinstance(err, StateTransferError)
    assert "checksum mismatch" in str(err) and "message 1" in str(err)


@contextlib.contextmanager
def _routes(secrets: tuple[bytes, bytes] = (b"s" * 32, b"s" * 32)) -> Iterator[list[StreamRoute]]:
    """Two running key servers (one per rank) and each rank's route to the other; stopped after."""
    servers = [KeyServer("127.0.0.1", 0, secret) for secret in secrets]
    for s in servers:
        s.start()
    peers = [s.address for s in servers]
    try:
        yield [
            StreamRoute(s, peers, secret, "state/gen1") for s, secret in zip(servers, secrets, strict=True)
        ]
    finally:
        for s in servers:
            s.stop()


def _aborted_receiver(route: StreamRoute, after: float) -> Callable[[Communicator], float]:
    """A receiver whose communicator is aborted ``after`` seconds in; returns how long it took
    to give up (it must raise StateTransferError naming the abort)."""

    def receive(comm: Communicator) -> float:
        threading.Timer(after, lambda: comm.abort("a newer fault")).start()
        t0 = time.monotonic()
        with pytest.raises(StateTransferError, match="aborted"):
            receive_state(comm, 0, 30, None, route)
        return time.monotonic() - t0

    return receive


def test_stream_transport_lands_in_place_and_verifies() -> None:
    sent, own = _state(4), _state(5)
    own_w = own["model"]["w"]
    with _routes() as routes:
        info, (tree, stats) = _pair(
            lambda c: send_state(c, sent, [1], 20, routes[0]),
            lambda c: receive_state(c, 0, 20, own, routes[1]),
        )
    assert isinstance(info, dict) and info["bytes"] == stats["bytes"]
    assert (
        torch.equal(tree["model"]["w"], sent["model"]["w"])
        and tree["model"]["w"].data_ptr() == own_w.data_ptr()
    )
    assert torch.equal(tree["model"]["b"], sent["model"]["b"]) and tree["step"] == 7


def test_stream_receiver_leaves_promptly_on_abort() -> None:
    def idle_source(comm: Communicator) -> None:
        time.sleep(1.5)  # never opens its channel

    with _routes() as routes:
        _, waited = _pair(idle_source, _aborted_receiver(routes[1], 0.3))
    assert isinstance(waited, float) and waited < 1.0, waited


def test_stream_with_the_wrong_secret_is_refused() -> None:
    with _routes((b"a" * 32, b"b" * 32)) as routes:
        _, err = _pair(lambda c: None, lambda c: receive_state(c, 0, 5, None, routes[1]))
    assert isinstance(err, StateTransferError) and "authentication" in str(err)


def test_stream_groups_small_messages_and_keeps_large_ones_alone() -> None:
    from checkpointless.state.stream_io import _CHUNK, _groups

    sizes = [0, 10, _CHUNK, 5, 0, _CHUNK - 6, 7, 3 * _CHUNK, 1]
    groups = _groups([torch.empty(n, dtype=torch.uint8) for n in sizes])
    assert [i for g in groups for i in g] == list(range(len(sizes)))  # every message, in order
    assert groups == [[0, 1], [2], [3, 4, 5], [6], [7], [8]]


def test_stream_moves_many_small_tensors_without_packing() -> None:
    g = torch.Generator().manual_seed(9)
    sent = {f"p{i}": torch.rand(i % 37, 3, generator=g) for i in range(700)}  # > IOV_MAX tensors
    sent["flags"] = torch.tensor([True, False])
    sent["step"] = torch.tensor(3.0)
    own = {k: torch.zeros_like(v) for k, v in sent.items()}
    with _routes() as routes:
        info, (tree, stats) = _pair(
            lambda c: send_state(c, sent, [1], 20, routes[0]),
            lambda c: receive_state(c, 0, 20, own, routes[1]),
        )
    assert info["messages"] == len(sent)  # one message per tensor, nothing packed
    assert all(torch.equal(tree[k], v) for k, v in sent.items())
    assert tree["p36"].data_ptr() == own["p36"].data_ptr()  # landed in place
    assert stats["in_place_bytes"] == sum(v.numel() * v.element_size() for v in sent.values())


def test_stream_receiver_leaves_promptly_when_aborted_mid_data() -> None:
    """The source stalls half-way through the bytes (as a SIGSTOPped one would): an abort must
    still end the receive within a fraction of a second, not at the transfer's deadline."""
    from checkpointless.wire import send_frame

    sent = {"w": torch.rand(1 << 21)}  # 8 MiB: several chunks

    with _routes() as routes:

        def stalling_source(comm: Communicator) -> None:
            lay = layout(sent, solo_min=0)
            sock, _ = routes[0].server.open_channel(routes[0].channel).get(timeout=10)
            send_frame(sock, routes[0].reply_key, {"type": "manifest"}, lay.manifest_bytes())
            sock.sendall(memoryview(lay.messages[0].numpy()).cast("B")[: 1 << 20])
            time.sleep(3)  # stalled, connection open
            sock.close()

        _, waited = _pair(stalling_source, _aborted_receiver(routes[1], 0.5))
    assert isinstance(waited, float) and waited < 1.5, waited


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_stream_sends_large_tensors_to_two_receivers_in_pieces(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One source, two receivers (two ranks that fell behind), tensors larger than one socket
    call moves: each receiver gets every byte verified; one lands in place, one in new memory.
    Both ways of hashing: on the socket's thread, and on a helper thread."""
    monkeypatch.setenv("CHECKPOINTLESS_STREAM_HASH", mode)
    g = torch.Generator().manual_seed(11)
    sent = {"w": torch.rand(6 << 20, generator=g), "v": torch.rand(5 << 20, generator=g), "s": torch.ones(3)}
    own = {k: torch.zeros_like(v) for k, v in sent.items()}
    store = dist.HashStore()
    servers = [KeyServer("127.0.0.1", 0, b"k" * 32) for _ in range(3)]
    for s in servers:
        s.start()
    peers = [s.address for s in servers]
    out: list[Any] = [None] * 3

    def run(rank: int) -> None:
        comm = Communicator(rank, 3, datetime.timedelta(seconds=30), backend="gloo")
        comm.rebuild(0, dist.PrefixStore("g0/", store), rank, 3, time.monotonic() + 30)
        route = StreamRoute(servers[rank], peers, b"k" * 32, "state/gen1")
        try:
            if rank == 0:
                out[0] = send_state(comm, sent, [1, 2], 30, route)
            else:
                out[rank] = receive_state(comm, 0, 30, own if rank == 1 else None, route)
        except Exception as e:
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(50)
    finally:
        for s in servers:
            s.stop()
    assert isinstance(out[0], dict), out[0]
    for rank in (1, 2):
        assert isinstance(out[rank], tuple), out[rank]
        tree, stats = out[rank]
        assert all(torch.equal(tree[k], v) for k, v in sent.items())
        assert stats["in_place_bytes"] == (((6 << 20) + (5 << 20) + 3) * 4 if rank == 1 else 0)
    assert out[1][0]["w"].data_ptr() == own["w"].data_ptr()


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_stream_hashers_agree_with_the_codec_digest(mode: str) -> None:
    from checkpointless.state.stream_hash import Hasher

    g = torch.Generator().manual_seed(12)
    messages = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (0, 7, 3 << 20, 1000)]
    hasher = Hasher(mode == "thread")
    for m in messages:
        view = memoryview(m.numpy()).cast("B")
        for off in range(0, len(view), 65_537):  # uneven pieces, as sockets return them
            hasher.update(view[off : off + 65_537])
        hasher.end()
    assert hasher.digests(time.monotonic() + 10) == [digest(m) for m in messages]
    hasher.close()


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_stream_refuses_bytes_changed_on_the_way(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The source's digests are of the true bytes; one byte differs on the wire."""
    from checkpointless.wire import send_frame

    monkeypatch.setenv("CHECKPOINTLESS_STREAM_HASH", mode)
    sent = {"w": torch.rand(3 << 20), "b": torch.rand(10)}  # one large (pieces), one small

    with _routes() as routes:

        def lying_source(comm: Communicator) -> None:
            lay = layout(sent, solo_min=0)
            mbytes = lay.manifest_bytes()
            sock, _ = routes[0].server.open_channel(routes[0].channel).get(timeout=10)
            send_frame(sock, routes[0].reply_key, {"type": "manifest"}, mbytes)
            digests = [digest(mbytes), *(digest(m) for m in lay.messages)]
            for i, m in enumerate(lay.messages):
                data = bytearray(memoryview(m.numpy()).cast("B"))
                if i == 0:
                    data[5_000_000] ^= 0x01
                sock.sendall(data)
            send_frame(sock, routes[0].reply_key, {"type": "trailer", "digests": digests})
            time.sleep(0.5)  # the receiver's refusal arrives; nothing more to send
            sock.close()

        _, err = _pair(lying_source, lambda c: receive_state(c, 0, 20, None, routes[1]))
    assert isinstance(err, StateTransferError) and "checksum mismatch" in str(err), err
