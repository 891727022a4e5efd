"""The probe processes that netprobe.py starts inside harness hosts (standard library only).

Exit codes: 0 success, 1 unreachable/timed out, 2 wrong reply or bad usage.
"""

from __future__ import annotations

import socket
import sys
import time

__all__: list[str] = []


def _tcp_echo(addr: str, port: int) -> None:
    srv = socket.create_server((addr, port), reuse_port=False)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(5.0)
            try:
                data = conn.recv(4096)
                conn.sendall(data)
            except OSError:
                pass


def _tcp_probe(addr: str, port: int, timeout: float) -> int:
    payload = b"checkpointless-probe"
    try:
        with socket.create_connection((addr, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(payload)
            return 0 if s.recv(4096) == payload else 2
    except OSError:
        return 1


def _udp_recv(addr: str, port: int, timeout: float) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((addr, port))
        print("ready", flush=True)
        s.settimeout(timeout)
        try:
            data, _ = s.recvfrom(4096)
        except OSError:
            return 1
        return 0 if data else 1


def _udp_send(addr: str, port: int, count: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(count):
            try:
                s.sendto(b"checkpointless-probe", (addr, port))
            except OSError:
                pass  # a link that is down fails the send itself; the receiver reports the outcome
            time.sleep(0.05)
    return 0


def _main(argv: list[str]) -> int:
    cmd, addr, port = argv[0], argv[1], int(argv[2])
    if cmd == "tcp-echo":
        _tcp_echo(addr, port)
        return 0
    if cmd == "tcp-probe":
        return _tcp_probe(addr, port, float(argv[3]))
    if cmd == "udp-recv":
        return _udp_recv(addr, port, float(argv[3]))
    if cmd == "udp-send":
        return _udp_send(addr, port, int(argv[3]))
    print(f"unknown probe {cmd!r}: use tcp-echo, tcp-probe, udp-recv or udp-send", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
