"""Self-tests of the namespace-hosts harness (tests/helpers/harness/hosts.py): real namespaces, real packets."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from tests.helpers.harness.fixtures import unavailable
from tests.helpers.harness.hosts import (
    PREFIX,
    NetemUnsupported,
    NetnsCluster,
    list_namespaces,
    netns_unavailable_reason,
    sweep_stale,
)
from tests.helpers.harness.netprobe import (
    start_tcp_echo,
    start_udp_receiver,
    tcp_roundtrip,
    udp_received,
    udp_send,
)
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

Make = Callable[..., NetnsCluster]


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_hosts_reach_each_other_and_nothing_is_left(netns_hosts: Make) -> None:
    links_before = _root_links()
    c = netns_hosts(2)
    h0, h1 = c.hosts
    assert h0.address != h1.address
    assert all(ns.startswith(f"{PREFIX}-") and ns in list_namespaces() for ns in c.namespaces())
    # the root namespace got no interface from us: the bridge and both veth ends live in namespaces
    assert _root_links() == links_before
    # loopback is up inside a host, and the hosts see each other over the bridge
    assert h0.run(["ip", "-o", "addr", "show", "lo"]).stdout.count("127.0.0.1") == 1
    start_tcp_echo(h1, 7001)
    start_tcp_echo(h0, 7001)
    assert tcp_roundtrip(h0, h1.address, 7001)
    assert tcp_roundtrip(h1, h0.address, 7001)
    # no route leaves the cluster: an address outside the subnet is unreachable at once
    out = h0.run(["ip", "route", "get", "8.8.8.8"])
    assert out.returncode != 0 and "unreachable" in out.stderr.lower(), out
    names = c.namespaces()
    c.close()
    left = set(names) & set(list_namespaces())
    assert not left, f"namespaces left behind: {left}"
    assert _root_links() == links_before


@pytest.mark.parametrize("method", ["drop", "link"])
def test_partition_both_ways_then_heal(netns_hosts: Make, method: str) -> None:
    h0, h1 = netns_hosts(2).hosts
    start_tcp_echo(h1, 7002)
    start_tcp_echo(h0, 7002)
    assert tcp_roundtrip(h0, h1.address, 7002)
    h1.partition("both", method=method)  # type: ignore[arg-type]
    assert not tcp_roundtrip(h0, h1.address, 7002)
    assert not tcp_roundtrip(h1, h0.address, 7002)
    # the partitioned host still talks to itself over loopback
    start_tcp_echo_lo = h1.popen(
        [
            sys.executable,
            "-c",
            "import socket,time; s=socket.create_server(('127.0.0.1', 7003)); time.sleep(60)",
        ]
    )
    time.sleep(0.5)
    assert (
        h1.run(
            [sys.executable, "-c", "import socket; socket.create_connection(('127.0.0.1', 7003), 2)"]
        ).returncode
        == 0
    )
    start_tcp_echo_lo.kill()
    h1.heal()
    assert tcp_roundtrip(h0, h1.address, 7002, timeout=5.0)
    assert tcp_roundtrip(h1, h0.address, 7002, timeout=5.0)


def test_one_direction_partition(netns_hosts: Make) -> None:
    h0, h1 = netns_hosts(2).hosts
    h1.partition("in")  # nothing reaches h1; what h1 sends still arrives
    rx_on_h1 = start_udp_receiver(h1, 7004)
    udp_send(h0, h1.address, 7004)
    assert not udp_received(rx_on_h1), "a datagram reached h1 through an inbound drop"
    rx_on_h0 = start_udp_receiver(h0, 7005)
    udp_send(h1, h0.address, 7005)
    assert udp_received(rx_on_h0), "h1's outbound traffic was cut by an inbound-only partition"
    # TCP needs both directions, so neither side can connect
    start_tcp_echo(h0, 7006)
    assert not tcp_roundtrip(h1, h0.address, 7006)

    h1.partition("out")  # replaces the inbound rule: now h1 hears but cannot speak
    rx_on_h1 = start_udp_receiver(h1, 7007)
    udp_send(h0, h1.address, 7007)
    assert udp_received(rx_on_h1)
    rx_on_h0 = start_udp_receiver(h0, 7008)
    udp_send(h1, h0.address, 7008)
    assert not udp_received(rx_on_h0)

    h1.heal()
    assert tcp_roundtrip(h1, h0.address, 7006, timeout=5.0)


def test_host_loss_kills_every_process_inside(netns_hosts: Make) -> None:
    h0, h1 = netns_hosts(2).hosts
    # a process tree: a parent that forks children which ignore SIGTERM, in a new session so no
    # process-group kill reaches them: only a kill by namespace gets them all
    tree = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "os.setsid()\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(120); os._exit(0)\n"
        "time.sleep(120)\n"
    )
    h1.popen([sys.executable, "-c", tree])
    survivor = h0.popen([sys.executable, "-c", "import time; time.sleep(120)"])
    deadline = time.monotonic() + 20
    while len(h1.pids()) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    before = h1.pids()
    assert len(before) >= 4, before
    killed = h1.kill_all()
    assert set(before) <= set(killed)
    assert h1.pids() == []
    # the other host is untouched
    assert survivor.poll() is None and h0.pids() == [survivor.pid]


def test_stale_namespaces_of_a_dead_run_are_swept() -> None:
    reason = netns_unavailable_reason()
    if reason:
        unavailable(reason)
    # a namespace named as if by a run whose process is gone (pid 0 never owns anything)
    stale = f"{PREFIX}-0-abcdef-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    try:
        assert stale in sweep_stale()
        assert stale not in list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=10)


def test_netem_delay_where_the_kernel_allows(netns_hosts: Make) -> None:
    h0, h1 = netns_hosts(2).hosts
    start_tcp_echo(h1, 7009)
    try:
        h0.set_netem(delay_ms=150)
    except NetemUnsupported as e:
        pytest.skip(f"tc netem: {e}")
    t0 = time.monotonic()
    assert tcp_roundtrip(h0, h1.address, 7009, timeout=5.0)
    # SYN and the echo request both leave h0: at least two delayed packets on the way
    assert time.monotonic() - t0 >= 0.3
    h0.clear_netem()


def test_bad_arguments_name_the_value(netns_hosts: Make) -> None:
    with pytest.raises(ValueError, match="n_hosts=0"):
        netns_hosts(0)
    with pytest.raises(ValueError, match=r"8\.8\.8\.0/24"):
        netns_hosts(2, subnet="8.8.8.0/24")
    h0 = netns_hosts(1).hosts[0]
    with pytest.raises(ValueError, match="sideways"):
        h0.partition("sideways")  # type: ignore[arg-type]


_OWNER = """
import sys, time
sys.path.insert(0, {tests!r})
from tests.helpers.harness._common import exit_on_sigterm
from tests.helpers.harness.hosts import NetnsCluster
exit_on_sigterm()
c = NetnsCluster(2)
c.hosts[1].popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(" ".join(c.namespaces()), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_an_interrupted_or_killed_owner_leaves_nothing(sig: signal.Signals) -> None:
    reason = netns_unavailable_reason()
    if reason:
        unavailable(reason)
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER.format(tests=str(ROOT))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        names = owner.stdout.readline().split()
        assert len(names) == 3 and set(names) <= set(list_namespaces())
        owner.send_signal(sig)
        owner.wait(timeout=30)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
    if sig == signal.SIGKILL:
        # no chance to clean up: the names stay until the next run's sweep (the owner pid is dead)
        assert set(names) <= set(list_namespaces())
        assert set(names) <= set(sweep_stale())
    assert not set(names) & set(list_namespaces())
