"""How the agent names nodes: per store, and across stores. Stdlib only.

torch names a node ``<addr>_<pid>_<local id>`` (``repr`` of its ``_NodeDesc``), and the local id
grows with every rendezvous handler the agent builds: the name keys a node within one store (its
heartbeat, its place in a round, our ``alive``/``left``/``silent`` lists), and changes when the
agent moves to another store after a failover. The agent process, its address and its
incarnation do not, so across stores (the base of a majority, the members known gone, the
liveness addresses a failover asks) a node is its :func:`ident`. The two are distinct types, so
that mypy tells one from the other.
"""

from __future__ import annotations

from typing import NewType

NodeRepr = NewType("NodeRepr", str)
"""A node within one store: ``<addr>_<pid>_<local id>``."""
NodeIdent = NewType("NodeIdent", str)
"""A node across stores: ``<addr>_<pid>_<incarnation>`` (``<addr>_<pid>`` for a plain torchrun
agent, whose local ids start at 0)."""

INCARNATION_SHIFT = 20
"""A node descriptor's local id is ``incarnation << 20`` plus torch's count of the agent's
handlers (``ddpjob_worker.agent.rendezvous.seed_incarnation``)."""


def ident(node: NodeRepr) -> NodeIdent:
    """A node's identity across stores (see the module doc)."""
    base, _, local = node.rpartition("_")
    try:
        incarnation = int(local) >> INCARNATION_SHIFT
    except ValueError:
        return NodeIdent(base)
    return NodeIdent(f"{base}_{incarnation}" if incarnation else base)
