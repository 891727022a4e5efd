"""Root-less rendezvous: a torch.distributed store in which every participant serves its own keys.

Each participant runs a :class:`KeyServer` on a port from the job's range (:func:`allocate_ports`)
and receives the :class:`PeerTable` of rank -> address. A :class:`RootlessStore` per generation
routes every key to its owner, so there is no central store and no root: losing any one process
costs the healthy ranks one fast, named :class:`~checkpointless.errors.RendezvousError`, and the
next generation forms once that rank is replaced. See docs/rendezvous.md.
"""

from typing import TYPE_CHECKING, Any

from checkpointless.rendezvous.barrier import store_barrier
from checkpointless.rendezvous.connections import ServerStats
from checkpointless.rendezvous.peers import PeerTable, group_by_owner, key_owner, parse_address
from checkpointless.rendezvous.ports import (
    PORT_BASE_SETTING,
    PORT_RANGE_SETTING,
    allocate_ports,
    open_listener,
    port_range_from_env,
)
from checkpointless.rendezvous.server import KeyServer

if TYPE_CHECKING:
    from checkpointless.rendezvous.store import RootlessStore

__all__ = [
    "PORT_BASE_SETTING",
    "PORT_RANGE_SETTING",
    "KeyServer",
    "PeerTable",
    "RootlessStore",
    "ServerStats",
    "allocate_ports",
    "group_by_owner",
    "key_owner",
    "open_listener",
    "parse_address",
    "port_range_from_env",
    "store_barrier",
]


def __getattr__(name: str) -> Any:
    # RootlessStore subclasses torch's Store, so importing it imports torch (1.5-2 s of CPU). The
    # launcher and agents need only ports, listeners and peer tables from this package: they load
    # the store on first use, and a job's processes start that much sooner.
    if name == "RootlessStore":
        from checkpointless.rendezvous.store import RootlessStore

        return RootlessStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
