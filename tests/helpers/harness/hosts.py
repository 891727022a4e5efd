"""Many "hosts" on one machine: one network namespace per host, joined by a bridge.

Layout made by :class:`NetnsCluster` (every name starts with ``cplh-<pid>-<random>``, so two
runs at once never collide and a sweep can tell a crashed run's leftovers from a live run's)::

    <tag>-br   (namespace)   br0 (bridge) --+-- v0 ==veth== eth0   <tag>-h0   10.200.0.1/24
                                            +-- v1 ==veth== eth0   <tag>-h1   10.200.0.2/24
                                            ...

Nothing is created in the root namespace: the bridge lives in a namespace of its own and each
veth pair is made there with its far end moved straight into the host's namespace. No namespace
has a default route or an uplink, so traffic can only reach loopback or the other hosts.

Faults: :meth:`Host.kill_all` (host loss: every process inside at once), :meth:`Host.partition`
(packet drop with nftables/iptables inside the host's namespace, both directions or one, or the
link taken down), :meth:`Host.heal`, :meth:`Host.set_netem` (delay/loss where the kernel has
``sch_netem``; :class:`NetemUnsupported` otherwise).

Removal: :meth:`NetnsCluster.close` (context-manager exit, pytest finalizer, and an atexit hook)
kills every process in the namespaces and deletes them, which also deletes their veths and the
bridge. :func:`sweep_stale` removes namespaces left by runs whose process is gone.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from .. import zygote
from ..zygote import Process
from ._common import HarnessError, HarnessUnavailable, check, missing_tools, owner_alive

__all__ = [
    "PREFIX",
    "Host",
    "NetemUnsupported",
    "NetnsCluster",
    "list_namespaces",
    "netns_unavailable_reason",
    "sweep_stale",
]

PREFIX = "cplh"
# cplh-<owner pid>-<6 hex>-<role>
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{6}})-([a-z0-9]+)$")
_IFACE = "eth0"  # the host's end of its veth; the name is private to the host's namespace
_NFT_TABLE = "cplh_partition"

Direction = Literal["both", "in", "out"]


class NetemUnsupported(HarnessUnavailable):
    """The kernel has no sch_netem; delay/loss tests skip (never a CI failure: it is the kernel)."""


def netns_unavailable_reason(euid: int | None = None) -> str | None:
    """Why this machine cannot run the namespace harness, or None when it can."""
    if (os.geteuid() if euid is None else euid) != 0:
        return "needs root (creates network namespaces); run `sudo make test` or in CI (.ci/run)"
    missing = missing_tools(["ip"])
    if missing:
        return f"missing {missing}: apt-get install iproute2"
    if missing_tools(["nft"]) and missing_tools(["iptables"]):
        return "missing nft and iptables (one-direction partitions need one): apt-get install nftables"
    return None


def list_namespaces() -> list[str]:
    """Names of every named network namespace (``ip netns list``), first word of each line."""
    out = check(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _ns_pids(ns: str) -> list[int]:
    out = check(["ip", "netns", "pids", ns], ok_codes=(0, 1))
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_ns(ns: str, timeout: float) -> list[int]:
    """SIGKILL every process in ``ns`` until none is left (children forked meanwhile included)."""
    deadline = time.monotonic() + timeout
    killed: list[int] = []
    while True:
        pids = [p for p in _ns_pids(ns) if p != os.getpid()]
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() >= deadline:
            raise HarnessError(f"processes {pids} in namespace {ns} survived SIGKILL for {timeout:.0f}s")
        time.sleep(0.02)


def _delete_ns(ns: str) -> None:
    _kill_ns(ns, timeout=10.0)
    check(["ip", "netns", "del", ns], ok_codes=(0, 1))
    if ns in list_namespaces():
        raise HarnessError(f"namespace {ns} still listed after `ip netns del`")


def sweep_stale() -> list[str]:
    """Delete this harness's namespaces whose creating process no longer runs; return their names."""
    removed = []
    for ns in list_namespaces():
        m = _NAME_RE.match(ns)
        if m and not owner_alive(int(m.group(1))):
            _delete_ns(ns)
            removed.append(ns)
    return removed


class Host:
    """One host: a network namespace with one address on the cluster's bridge."""

    def __init__(self, name: str, netns: str, address: str, prefixlen: int) -> None:
        self.name = name
        self.netns = netns
        self.address = address
        self.prefixlen = prefixlen
        self.iface = _IFACE
        self._procs: list[Process] = []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, netns={self.netns!r}, address={self.address!r})"

    def _argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: object
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this host (``ip netns exec`` execs it, so the pid is the command's)."""
        proc: subprocess.Popen[bytes] = subprocess.Popen(
            self._argv(argv),
            env=dict(env) if env is not None else None,
            **kwargs,  # type: ignore[call-overload]
        )
        self._procs.append(proc)
        return proc

    def launch(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], out: int) -> Process:
        """Start ``python -m checkpointless ...`` inside this host, its stdout and stderr on the
        descriptor ``out``: forked from the test zygote where it can be (``tests/helpers/zygote.py``:
        no interpreter to start, no torch to import again), else as :meth:`popen` would."""
        proc: Process | None = zygote.launch(list(argv), str(cwd), env, out, netns=self.netns)
        if proc is None:
            return self.popen(argv, cwd=cwd, env=env, stdout=out, stderr=out)
        self._procs.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], *, timeout: float = 30.0, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this host to completion; output captured as text."""
        return subprocess.run(
            self._argv(argv),
            env=dict(env) if env is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def pids(self) -> list[int]:
        """Every process now inside this host's namespace."""
        return _ns_pids(self.netns)

    def kill_all(self, timeout: float = 10.0) -> list[int]:
        """Host loss: SIGKILL every process in the namespace at once; return the pids killed."""
        killed = _kill_ns(self.netns, timeout)
        self._reap()
        return killed

    def _reap(self) -> None:
        # the processes this object started are our children: collect them so none stays a zombie
        for p in self._procs:
            if p.poll() is None:
                try:
                    p.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
        self._procs = [p for p in self._procs if p.returncode is None]

    # -- network faults ---------------------------------------------------------------------------

    def _ip(self, *args: str) -> str:
        return check(["ip", "-n", self.netns, *args])

    def partition(self, direction: Direction = "both", *, method: Literal["drop", "link"] = "drop") -> None:
        """Cut this host off from the others.

        ``drop`` (default) silently discards packets on the host's interface, as a real partition
        looks to a peer; ``direction`` is ``"in"`` (nothing reaches this host), ``"out"`` (nothing
        leaves it) or ``"both"``. Loopback inside the host keeps working. ``link`` takes the
        interface down (both directions; local sends then fail at once with ENETUNREACH).
        """
        if direction not in ("both", "in", "out"):
            raise ValueError(f"direction={direction!r}: use 'both', 'in' or 'out'")
        if method == "link":
            if direction != "both":
                raise ValueError(f"method='link' cuts both directions; got direction={direction!r}")
            self._ip("link", "set", self.iface, "down")
            return
        if method != "drop":
            raise ValueError(f"method={method!r}: use 'drop' or 'link'")
        self.heal()  # one rule set at a time: a new partition replaces the old one
        chains = {"in": ["in"], "out": ["out"], "both": ["in", "out"]}[direction]
        if not missing_tools(["nft"]):
            lines = [f"table inet {_NFT_TABLE} {{"]
            if "in" in chains:
                lines.append("  chain in { type filter hook input priority 0; policy accept; ")
                lines.append(f'    iifname "{self.iface}" drop; }}')
            if "out" in chains:
                lines.append("  chain out { type filter hook output priority 0; policy accept; ")
                lines.append(f'    oifname "{self.iface}" drop; }}')
            lines.append("}")
            self._nft_apply("\n".join(lines) + "\n")
        else:
            for c in chains:
                chain, flag = ("INPUT", "-i") if c == "in" else ("OUTPUT", "-o")
                check(
                    [
                        "ip",
                        "netns",
                        "exec",
                        self.netns,
                        "iptables",
                        "-I",
                        chain,
                        flag,
                        self.iface,
                        "-j",
                        "DROP",
                    ]
                )

    def _nft_apply(self, ruleset: str) -> None:
        res = subprocess.run(
            self._argv(["nft", "-f", "-"]), input=ruleset, capture_output=True, text=True, timeout=10.0
        )
        if res.returncode != 0:
            raise HarnessError(f"nft in {self.netns} rejected the partition rules: {res.stderr.strip()}")

    def heal(self) -> None:
        """Undo :meth:`partition` (rules removed, link up) and any :meth:`set_netem`."""
        if not missing_tools(["nft"]):
            tables = check(["ip", "netns", "exec", self.netns, "nft", "list", "tables"])
            if _NFT_TABLE in tables:
                check(["ip", "netns", "exec", self.netns, "nft", "delete", "table", "inet", _NFT_TABLE])
        elif not missing_tools(["iptables"]):
            # the namespace is ours alone, so flushing its filter table removes only our rules
            check(["ip", "netns", "exec", self.netns, "iptables", "-F"])
        self._ip("link", "set", self.iface, "up")
        # link down drops the on-link route; the kernel restores it when the link is up again
        self.clear_netem()

    def set_netem(self, *, delay_ms: float = 0.0, jitter_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Delay and/or drop packets leaving this host (``tc netem`` on its interface)."""
        if delay_ms < 0 or jitter_ms < 0 or not 0.0 <= loss_pct <= 100.0:
            raise ValueError(
                f"delay_ms={delay_ms}, jitter_ms={jitter_ms}, loss_pct={loss_pct}: "
                "delays are >= 0 and loss is a percentage in [0, 100]"
            )
        if missing_tools(["tc"]):
            raise NetemUnsupported("tc missing: apt-get install iproute2")
        args = ["tc", "qdisc", "replace", "dev", self.iface, "root", "netem"]
        if delay_ms or jitter_ms:
            args += ["delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
        if loss_pct:
            args += ["loss", f"{loss_pct}%"]
        res = subprocess.run(self._argv(args), capture_output=True, text=True, timeout=10.0)
        if res.returncode != 0:
            if "unknown" in res.stderr.lower() or "not supported" in res.stderr.lower():
                raise NetemUnsupported(f"this kernel has no sch_netem ({res.stderr.strip()})")
            raise HarnessError(f"{' '.join(args)!r} in {self.netns} failed: {res.stderr.strip()}")

    def clear_netem(self) -> None:
        if missing_tools(["tc"]):
            return
        # deleting a root qdisc that was never added fails with "Cannot delete qdisc with handle of
        # zero"/"No such file"; either way nothing of ours is left
        subprocess.run(
            self._argv(["tc", "qdisc", "del", "dev", self.iface, "root"]),
            capture_output=True,
            timeout=10.0,
        )


_LIVE: set[NetnsCluster] = set()
_LIVE_LOCK = threading.Lock()


def _close_live_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for c in live:
        try:
            c.close()
        except Exception:
            pass  # exiting anyway; the next run's sweep_stale() removes what is left


atexit.register(_close_live_at_exit)


class NetnsCluster:
    """``n_hosts`` namespaces on one bridge; use as a context manager (or call :meth:`close`)."""

    def __init__(self, n_hosts: int, *, subnet: str = "10.200.0.0/24") -> None:
        if not 1 <= n_hosts <= 200:
            raise ValueError(f"n_hosts={n_hosts}: use 1..200")
        net = ipaddress.ip_network(subnet)
        if not net.is_private or net.version != 4 or net.num_addresses < n_hosts + 2:
            raise ValueError(f"subnet={subnet!r}: use a private IPv4 range with room for {n_hosts} hosts")
        reason = netns_unavailable_reason()
        if reason:
            raise HarnessUnavailable(reason)
        self.tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts: list[Host] = []
        self._made: list[str] = []  # namespaces created so far, in order; removal goes backwards
        self._closed = False
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            sweep_stale()
            self._create(n_hosts, net)
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        check(["ip", "netns", "add", ns])
        self._made.append(ns)
        check(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _create(self, n_hosts: int, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        check(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        check(["ip", "-n", br, "link", "set", "br0", "up"])
        addrs = list(net.hosts())
        for i in range(n_hosts):
            ns = f"{self.tag}-h{i}"
            self._add_ns(ns)
            # made inside the bridge's namespace, far end moved straight into the host's: the root
            # namespace never sees either end
            check(
                ["ip", "-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", _IFACE, "netns", ns]
            )
            check(["ip", "-n", br, "link", "set", f"v{i}", "master", "br0", "up"])
            addr = str(addrs[i])
            check(["ip", "-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", _IFACE])
            check(["ip", "-n", ns, "link", "set", _IFACE, "up"])
            self.hosts.append(Host(f"h{i}", ns, addr, net.prefixlen))

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def namespaces(self) -> list[str]:
        return list(self._made)

    def close(self) -> None:
        """Kill every process in the hosts, delete every namespace (and so every link) made."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        for h in self.hosts:
            try:
                h.kill_all()
            except Exception as e:
                errors.append(f"{h.netns}: {e}")
        for ns in reversed(self._made):
            try:
                _delete_ns(ns)
            except Exception as e:
                errors.append(f"{ns}: {e}")
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if errors:
            raise HarnessError("removing the test hosts failed: " + "; ".join(errors))
