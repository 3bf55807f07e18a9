"""Which clients each edge serves (SHeRL-FL's tier 2), checked twice: the shape when the
config is read, the agents against the fleet's registrations when training starts.

Without a configured topology, registered clients are dealt round-robin (in id order) to
the registered edges, which is what simulations and quick trials want.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jetsplit.errors import ConfigError
from jetsplit.server.engines.registry import FleetRegistry

log = logging.getLogger("jetsplit.coordinator")


@dataclass(frozen=True)
class Topology:
    """edge id → the client ids it serves (each client under exactly one edge)."""

    edges: dict[str, tuple[str, ...]]

    def edge_of(self, client: str) -> str | None:
        for edge, clients in self.edges.items():
            if client in clients:
                return edge
        return None

    def groups(self, clients: Sequence[str]) -> dict[str, list[str]]:
        """The given clients by edge, both in id order; edges without any left out."""
        out: dict[str, list[str]] = {}
        for client in sorted(clients):
            edge = self.edge_of(client)
            if edge is not None:
                out.setdefault(edge, []).append(client)
        return dict(sorted(out.items()))

    def as_dict(self) -> dict[str, list[str]]:
        return {edge: list(clients) for edge, clients in self.edges.items()}


def check_shape(edges: Mapping[str, Sequence[str]]) -> None:
    """Raise ValueError (one line) for an edge without clients, a client listed twice or
    under two edges, or an agent that is both an edge and a client."""
    owner: dict[str, str] = {}
    for edge, clients in sorted(edges.items()):
        if not clients:
            raise ValueError(f"edge {edge} has no clients")
        for client in clients:
            if client in edges:
                raise ValueError(f"{client} is an edge and also a client of edge {edge}")
            if client in owner:
                where = ("twice under edge " + edge if owner[client] == edge
                         else f"under two edges ({owner[client]} and {edge})")
                raise ValueError(f"client {client} is listed {where}")
            owner[client] = edge


def round_robin(edges: Sequence[str], clients: Sequence[str]) -> dict[str, list[str]]:
    """Client i (in id order) goes to edge i mod E (in id order)."""
    ordered = sorted(edges)
    out: dict[str, list[str]] = {e: [] for e in ordered}
    for i, client in enumerate(sorted(clients)):
        out[ordered[i % len(ordered)]].append(client)
    return {e: c for e, c in out.items() if c}


def resolve(edges: Mapping[str, Sequence[str]], registry: FleetRegistry) -> Topology:
    """The topology to train with: the configured one, checked against who registered
    with which role; or, when none is configured, a round-robin one."""
    roles = {a: registry.registration(a).get("role") for a in registry.registered()}
    registered_edges = sorted(a for a, r in roles.items() if r == "edge")
    registered_clients = sorted(a for a, r in roles.items() if r == "client")
    if not edges:
        if not registered_edges:
            raise ConfigError('sherl needs at least one agent with role = "edge"; none '
                              "registered")
        if not registered_clients:
            raise ConfigError('sherl needs at least one agent with role = "client"; none '
                              "registered")
        return Topology({e: tuple(c) for e, c in
                         round_robin(registered_edges, registered_clients).items()})
    try:
        check_shape(edges)
    except ValueError as exc:
        raise ConfigError(f"topology: {exc}") from None
    for edge, clients in sorted(edges.items()):
        _check_role(roles, edge, "edge")
        for client in clients:
            _check_role(roles, client, "client")
    assigned = {c for clients in edges.values() for c in clients}
    idle = [c for c in registered_clients if c not in assigned]
    if idle:
        log.warning("clients in no edge's group sit out: %s", ", ".join(idle))
    return Topology({e: tuple(sorted(c)) for e, c in sorted(edges.items())})


def _check_role(roles: Mapping[str, str | None], agent: str, role: str) -> None:
    if agent not in roles:
        raise ConfigError(f"topology: {role} {agent} is not a registered agent "
                          f"(registered: {', '.join(sorted(roles)) or 'none'})")
    if roles[agent] != role:
        raise ConfigError(f"topology: {agent} is listed as {'an' if role == 'edge' else 'a'} "
                          f"{role} but registered with role {roles[agent]}")
