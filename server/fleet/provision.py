"""`jetsplit provision`: a fleet CA, one startup kit per device and for the coordinator, and
a Mosquitto config that enforces who may publish where.

Each kit holds the fleet CA certificate, the device's own TLS key and certificate (client
authentication: the broker maps the certificate's CN to a user name and applies the ACL),
its own Ed25519 signing key, and the public signing keys it must trust: an agent trusts the
coordinator's (and, in a SHeRL-FL topology, its direct peers': a client its edge's, an edge
its clients'), the coordinator trusts every agent's. Private keys never leave the kit they
were made for; the CA key stays in `ca/` (keep it offline).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated

import typer

from jetsplit.errors import ConfigError
from jetsplit.identity import PUBLIC_SUFFIX, Signer
from jetsplit.protocol import MAX_SAMPLES
from jetsplit.server.fleet.topology import check_shape
from jetsplit.transport.topics import COORDINATOR, ROOT, check_id

KIT_FILE = "kit.json"
SERVER_TOML = "server.toml"  # the coordinator's kit: its starting config
# The fleet CLI's own TLS identity, kept in the coordinator's kit: the broker names every
# session by its certificate's CN, so the CLI on the coordinator's certificate would take
# the running coordinator's session over. It signs as the coordinator (same signing key).
OPERATOR = "operator"
RESERVED_IDS = (COORDINATOR, OPERATOR, "all", "broker", "ca")


def _x509():  # noqa: ANN202
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _key_pem(key) -> bytes:  # noqa: ANN001
    _, _, serialization, _, _, _ = _x509()
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())


def _cert_pem(cert) -> bytes:  # noqa: ANN001
    _, _, serialization, _, _, _ = _x509()
    return cert.public_bytes(serialization.Encoding.PEM)


class FleetCA:
    """A P-256 certificate authority for one fleet (its name is in the CN)."""

    def __init__(self, fleet: str, days: int) -> None:
        x509, hashes, _, ec, _, NameOID = _x509()
        self.fleet, self.days = fleet, days
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"jetsplit fleet {fleet} CA"),
                          x509.NameAttribute(NameOID.ORGANIZATION_NAME, fleet)])
        now = dt.datetime.now(dt.timezone.utc)
        self.cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()),
                           critical=False)
            .sign(self.key, hashes.SHA256()))

    def issue(self, common_name: str, *, server_names: tuple[str, ...] = ()):  # noqa: ANN201
        """(key, certificate) for a client (CN = its id) or, with `server_names`, the broker."""
        x509, hashes, _, ec, ExtendedKeyUsageOID, NameOID = _x509()
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        usage = [ExtendedKeyUsageOID.SERVER_AUTH] if server_names else [
            ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                                     x509.NameAttribute(NameOID.ORGANIZATION_NAME,
                                                        self.fleet)]))
            .issuer_name(self.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=self.days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=True, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self.key.public_key()), critical=False))
        if server_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [_alt_name(n) for n in server_names]), critical=False)
        return key, builder.sign(self.key, hashes.SHA256())


def _alt_name(name: str):  # noqa: ANN202
    x509 = _x509()[0]
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if private:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
    else:
        path.write_bytes(data)


Edges = Mapping[str, Sequence[str]]


def peers_of(edges: Edges) -> dict[str, list[str]]:
    """Who may message whom directly: a client its edge, an edge its clients."""
    out: dict[str, list[str]] = {}
    for edge, clients in sorted(edges.items()):
        out[edge] = sorted(clients)
        for client in clients:
            out[client] = [edge]
    return out


def acl_text(fleet: str, agents: list[str], edges: Edges | None = None) -> str:
    """Mosquitto ACL: agent X publishes only up/X and presence/X and reads only down/X and
    down/all; the coordinator (and the fleet CLI's `operator`) publishes down/* and reads
    up/* and presence/*. In a SHeRL-FL
    topology (`edges`), X also reads its own direct topics peer/X/+ and publishes only
    peer/P/X for each of its peers P (a client: its edge; an edge: its clients)."""
    base = f"{ROOT}/{fleet}"
    peers = peers_of(edges or {})
    lines = ["# written by `jetsplit provision`; user = certificate CN (use_identity_as_username)",
             ""]
    for who in (COORDINATOR, OPERATOR):  # the fleet CLI acts for the coordinator
        lines += [f"user {who}", f"topic write {base}/down/#", f"topic read {base}/up/+",
                  f"topic read {base}/presence/+", ""]
    for agent in agents:
        lines += [f"user {agent}", f"topic write {base}/up/{agent}",
                  f"topic write {base}/presence/{agent}", f"topic read {base}/down/{agent}",
                  f"topic read {base}/down/all"]
        if agent in peers:
            lines += [f"topic read {base}/peer/{agent}/+",
                      *(f"topic write {base}/peer/{p}/{agent}" for p in peers[agent])]
        lines.append("")
    return "\n".join(lines)


def broker_max_packet() -> int:
    """The largest MQTT packet a fleet at the default `mqtt.chunk_bytes` sends: one chunk's
    envelope (payload, the most a header and trailer may take) plus 4 KiB for the MQTT
    fixed header, topic and properties. Anything larger is refused by the broker itself, so
    a device cannot make every subscriber buffer a 200 MiB message (a fleet that raises
    `mqtt.chunk_bytes` raises `max_packet_size` in broker/mosquitto.conf to match)."""
    from jetsplit.wire import accounted_bound
    from jetsplit.wire.chunking import DEFAULT_CHUNK_BYTES

    return accounted_bound(DEFAULT_CHUNK_BYTES) + 4096


def mosquitto_conf(broker_dir: Path, port: int, bind: str) -> str:
    """A Mosquitto 2 listener with mutual TLS, identities (user names and client ids) from
    certificates, the ACL, and a packet size limit a little above the largest legitimate
    message."""
    d = broker_dir.resolve()
    return (f"# written by `jetsplit provision`; paths point at {d}: edit them if you move it\n"
            f"per_listener_settings false\n"
            f"listener {port} {bind}\n"
            f"cafile {d / 'ca.crt'}\ncertfile {d / 'server.crt'}\nkeyfile {d / 'server.key'}\n"
            "require_certificate true\nuse_identity_as_username true\n"
            "# every session is named by its certificate's CN, whatever client id was sent:\n"
            "# no enrolled device can connect under another's id and take its session\n"
            "use_username_as_clientid true\n"
            f"allow_anonymous false\nacl_file {d / 'acl'}\n"
            "# small QoS 1 exchanges wait ~40 ms on Nagle without this (Mosquitto >= 2.0)\n"
            "set_tcp_nodelay true\nmax_queued_messages 10000\n"
            "# one chunked message (mqtt.chunk_bytes = 1 MiB) and its envelope fit; no more\n"
            f"max_packet_size {broker_max_packet()}\n")


_KIT_README = """# jetsplit startup kit: {who} of fleet `{fleet}`

Made by `jetsplit provision`. Keep this folder private: `client.key` and `signing.key` are
this device's own secrets; nobody else needs them.

| file | what it is |
|---|---|
| `ca.crt` | the fleet CA: trusts the broker, and the broker trusts you through it |
| `client.crt`, `client.key` | your TLS certificate (CN `{who}`) and key, for mutual TLS |
| `operator.crt`, `operator.key` | coordinator only: the fleet CLI's certificate (CN `operator`) |
| `signing.key` | your Ed25519 key: every message you send is signed with it |
| `trusted/*.pub` | the signing keys you accept messages from ({trusts}) |
| `kit.json` | fleet and id |
| `server.toml` | coordinator only: a starting config pointing at this kit |

{install}
"""

_AGENT_INSTALL = """On the device: copy this folder over (e.g. `scp -r {who} jetson:`), then

    jetsplit agent install --kit {who} --broker mqtts://BROKER-HOST:{port} ...

which copies it to the config folder and points `agent.toml`'s `[mqtt]` section at it
(`tls_ca`, `tls_cert`, `tls_key`, `signing_key`, `trusted_keys`), agent id `{who}`, fleet
`{fleet}`."""

_COORDINATOR_INSTALL = """On the coordinator host, start from `server.toml` here (set the broker's
host; add the model and training sections), which points at this kit:

{toml}
`operator.crt` (CN `operator`) is what `jetsplit fleet ... --config server.toml` connects
with: the broker names each session by its certificate's CN, so the CLI on `client.crt`
would take the running coordinator's session over.

To add an agent later, provision again into a new folder (a new CA), or copy a new agent's
`signing.pub` into `trusted/` and add its lines to the broker's ACL.

`[train.provisioned_sizes]` (from `jetsplit provision --size`) is the most samples each
named device's registered size weighs as in any average: an enrolled device that claims
more weighs as this, and the run's report names it."""


def coordinator_toml(fleet: str, port: int, kit: Path, sizes: Mapping[str, int]) -> str:
    """The coordinator's starting server.toml: the fleet, its kit's files, and the sizes
    provisioned per device (server/defences/size_claims.py)."""
    d = kit.resolve()
    lines = [f'fleet = "{fleet}"', "", "[mqtt]", f'broker = "mqtts://BROKER-HOST:{port}"',
             *(f"{key} = {json.dumps(str(d / name))}" for key, name in (
                 ("tls_ca", "ca.crt"), ("tls_cert", "client.crt"), ("tls_key", "client.key"),
                 ("signing_key", "signing.key"), ("trusted_keys", "trusted"),
                 ("operator_cert", "operator.crt"), ("operator_key", "operator.key")))]
    if sizes:
        lines += ["", "[train.provisioned_sizes]  # the most samples each device weighs as",
                  *(f"{agent} = {n}" for agent, n in sorted(sizes.items()))]
    return "\n".join(lines) + "\n"

_TOP_README = """# fleet `{fleet}`: what `jetsplit provision` wrote

| folder | copy it to |
|---|---|
| `ca/` | nowhere: the CA key signs new certificates; keep it offline |
| `broker/` | the broker host (Mosquitto: `mosquitto -c broker/mosquitto.conf`) |
| `{COORDINATOR}/` | the coordinator host (see its README) |
{rows}

## What the broker enforces

`broker/mosquitto.conf` listens on port {port} with mutual TLS (`require_certificate true`),
takes each client's user name from its certificate's CN (`use_identity_as_username true`)
and applies `broker/acl`: agent X may publish only `{base}/up/X` and `{base}/presence/X`
and read only `{base}/down/X` and `{base}/down/all`; the coordinator publishes `down/#` and
reads `up/+` and `presence/+`. SHeRL-FL peers ({peers}) also read their own direct topics
`{base}/peer/X/+` and publish only `{base}/peer/P/X` for each peer P: a client to its edge,
an edge to each of its clients (configure the same `[topology]` in `server.toml`). A
certificate from another fleet's CA is refused at the TLS handshake. The broker
certificate names: {names}. Packets over {max_packet} bytes (`max_packet_size`: one 1 MiB
chunk and its envelope) are refused by the broker, which disconnects the sender. A broker
gives a session to whoever connects with its client id; so the broker replaces every
client id with the certificate's CN (`use_username_as_clientid true`): an enrolled device
connecting under another's id gets its own session, and takes nobody's over. (Each
device's client id also ends in 16 hex digits derived from its own signing key,
`jetsplit-<fleet>-<id>-<digits>`, for brokers configured without this.) The fleet CLI
connects as `operator` (its certificate is in the coordinator's kit), with the
coordinator's rights, so it never takes the coordinator's session. Mosquitto
runs as user `mosquitto`: make `broker/server.key` readable by it (`chown mosquitto
broker/server.key`).

## The same on EMQX

EMQX 5 (`emqx.conf`): an SSL listener that requires client certificates and takes the
user name and the client id from the CN (so a client id is tied to its certificate), plus
a file authorizer with the same rules:

    listeners.ssl.default {{
      bind = "0.0.0.0:{port}"
      ssl_options {{
        cacertfile = "/etc/emqx/jetsplit/ca.crt"
        certfile = "/etc/emqx/jetsplit/server.crt"
        keyfile = "/etc/emqx/jetsplit/server.key"
        verify = verify_peer
        fail_if_no_peer_cert = true
      }}
    }}
    mqtt.peer_cert_as_username = cn
    mqtt.peer_cert_as_clientid = cn
    mqtt.max_packet_size = {max_packet}
    authorization {{
      no_match = deny
      sources = [{{ type = file, enable = true, path = "/etc/emqx/jetsplit/acl.conf" }}]
    }}

with `acl.conf`:

{emqx_acl}

## Messages

Every message is signed with its sender's own Ed25519 key and verified against the key
provisioned for the sender it names; the coordinator also checks that up/X and presence/X
carry messages from X, and agents accept commands only when signed by the coordinator's
key; a direct message on peer/X/P must be signed by P, and X holds only the keys of its own
peers. Replay windows are per sender; retained presence must be signed and fresh. (The
older shared fleet key, `fleet_key_file`, signs with one HMAC key that every device holds:
it keeps strangers out but gives no per-device identity.)
"""


def emqx_acl(fleet: str, agents: list[str], edges: Edges | None = None) -> str:
    base = f"{ROOT}/{fleet}"
    peers = peers_of(edges or {})
    rules = []
    for who in (COORDINATOR, OPERATOR):  # the fleet CLI acts for the coordinator
        rules += [f'{{allow, {{user, "{who}"}}, publish, ["{base}/down/#"]}}.',
                  f'{{allow, {{user, "{who}"}}, subscribe, ["{base}/up/+", '
                  f'"{base}/presence/+"]}}.']
    for a in agents:
        rules += [f'{{allow, {{user, "{a}"}}, publish, ["{base}/up/{a}", '
                  f'"{base}/presence/{a}"]}}.',
                  f'{{allow, {{user, "{a}"}}, subscribe, ["{base}/down/{a}", '
                  f'"{base}/down/all"]}}.']
        if a in peers:
            writes = ", ".join(f'"{base}/peer/{p}/{a}"' for p in peers[a])
            rules += [f'{{allow, {{user, "{a}"}}, publish, [{writes}]}}.',
                      f'{{allow, {{user, "{a}"}}, subscribe, ["{base}/peer/{a}/+"]}}.']
    rules.append("{deny, all}.")
    return "\n".join(f"    {r}" for r in rules)


def provision(fleet: str, agents: list[str], out: Path, *, broker_names: tuple[str, ...] =
              ("localhost", "127.0.0.1"), port: int = 8883, bind: str = "0.0.0.0",
              days: int = 825, edges: Edges | None = None,
              sizes: Mapping[str, int] | None = None) -> dict[str, Path]:
    """Write the CA, the broker folder and one kit per device; returns the kit folders.
    `edges` (edge → its clients, all among `agents`) opens SHeRL-FL's direct topics.
    `sizes` (agent → samples it holds) go into the coordinator's server.toml: the most
    each device's registered size weighs as."""
    edges = {e: list(cs) for e, cs in (edges or {}).items()}
    sizes = dict(sizes or {})
    _check_request(fleet, agents, edges, sizes, out)
    ca = FleetCA(fleet, days)
    _write(out / "ca" / "ca.crt", _cert_pem(ca.cert))
    _write(out / "ca" / "ca.key", _key_pem(ca.key), private=True)
    _write_broker(out / "broker", ca, fleet, agents, edges, broker_names, port, bind)
    signers = {who: Signer.generate(who) for who in [COORDINATOR, *agents]}
    peers = peers_of(edges)
    kits = {who: _write_kit(out / who, who, ca, signers, fleet, agents, peers, port, sizes)
            for who in signers}
    rows = "\n".join(f"| `{a}/` | device `{a}`, then `jetsplit agent install --kit {a} ...` |"
                     for a in agents)
    _write(out / "README.md", _TOP_README.format(
        fleet=fleet, COORDINATOR=COORDINATOR, rows=rows, port=port, base=f"{ROOT}/{fleet}",
        names=", ".join(broker_names), emqx_acl=emqx_acl(fleet, agents, edges),
        peers=", ".join(f"{e}: {', '.join(cs)}" for e, cs in sorted(edges.items())) or "none",
        max_packet=broker_max_packet()).encode())
    return kits


def _check_request(fleet: str, agents: list[str], edges: Edges, sizes: Mapping[str, int],
                   out: Path) -> None:
    """Every name, edge and size valid, and `out` empty (keys are never overwritten),
    before anything is written: one line naming the first problem."""
    check_id(fleet, "fleet")
    if not agents:
        raise ConfigError("provision: name at least one agent (--agents a0,a1,...)")
    for agent in agents:
        check_id(agent, "agent")
        if agent in RESERVED_IDS:
            raise ConfigError(f"agent {agent!r}: that name is reserved")
    if len(set(agents)) != len(agents):
        raise ConfigError("provision: agent names repeat")
    try:
        check_shape(edges)
    except ValueError as exc:
        raise ConfigError(f"provision: --edge: {exc}") from None
    strangers = sorted({*edges, *(c for cs in edges.values() for c in cs)} - set(agents))
    if strangers:
        raise ConfigError(f"provision: --edge names {', '.join(strangers)}, not in --agents")
    unknown = sorted(set(sizes) - set(agents))
    if unknown:
        raise ConfigError(f"provision: --size names {', '.join(unknown)}, not in --agents")
    bad = sorted(a for a, n in sizes.items()
                 if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES)
    if bad:
        raise ConfigError(f"provision: --size {bad[0]}={sizes[bad[0]]}: a size is a whole "
                          f"number of samples, 1 to {MAX_SAMPLES}")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"provision: {out} is not empty (keys are never overwritten)")


def _write_broker(broker: Path, ca: FleetCA, fleet: str, agents: list[str], edges: Edges,
                  names: tuple[str, ...], port: int, bind: str) -> None:
    """The broker's folder: CA, server certificate and key, ACL, mosquitto.conf."""
    key, cert = ca.issue(names[0], server_names=names)
    _write(broker / "ca.crt", _cert_pem(ca.cert))
    _write(broker / "server.crt", _cert_pem(cert))
    _write(broker / "server.key", _key_pem(key), private=True)
    _write(broker / "acl", acl_text(fleet, agents, edges).encode())
    _write(broker / "mosquitto.conf", mosquitto_conf(broker, port, bind).encode())


def _write_kit(kit: Path, who: str, ca: FleetCA, signers: Mapping[str, Signer], fleet: str,
               agents: list[str], peers: Mapping[str, list[str]], port: int,
               sizes: Mapping[str, int]) -> Path:
    """One startup kit: TLS identity, signing key, the public keys it trusts, its
    README (and for the coordinator the operator identity and server.toml)."""
    key, cert = ca.issue(who)
    _write(kit / "ca.crt", _cert_pem(ca.cert))
    _write(kit / "client.crt", _cert_pem(cert))
    _write(kit / "client.key", _key_pem(key), private=True)
    _write(kit / "signing.key", signers[who].private_pem(), private=True)
    _write(kit / "signing.pub", signers[who].public_pem())
    if who == COORDINATOR:  # the fleet CLI's own TLS identity (see OPERATOR)
        key, cert = ca.issue(OPERATOR)
        _write(kit / "operator.crt", _cert_pem(cert))
        _write(kit / "operator.key", _key_pem(key), private=True)
    trusted = agents if who == COORDINATOR else [COORDINATOR, *peers.get(who, [])]
    for other in trusted:
        _write(kit / "trusted" / f"{other}{PUBLIC_SUFFIX}", signers[other].public_pem())
    _write(kit / KIT_FILE, json.dumps({"fleet": fleet, "id": who, "port": port},
                                      indent=1).encode())
    toml = coordinator_toml(fleet, port, kit, sizes)
    if who == COORDINATOR:
        _write(kit / SERVER_TOML, toml.encode())
    install = (_COORDINATOR_INSTALL.format(
                   toml="".join(f"    {line}\n" if line else "\n"
                                for line in toml.splitlines()))
               if who == COORDINATOR else
               _AGENT_INSTALL.format(who=who, fleet=fleet, port=port))
    trusts = ("every agent's" if who == COORDINATOR else
              "the coordinator's and its direct peers': " + ", ".join(peers[who])
              if who in peers else "the coordinator's only")
    _write(kit / "README.md", _KIT_README.format(who=who, fleet=fleet, trusts=trusts,
                                                 install=install).encode())
    return kit


def parse_edges(specs: list[str]) -> dict[str, list[str]]:
    """`--edge e0=a0,a2` options as {edge: clients}; a malformed one is a ConfigError."""
    edges: dict[str, list[str]] = {}
    for spec in specs:
        edge, sep, clients = spec.partition("=")
        names = [c.strip() for c in clients.split(",") if c.strip()]
        if not sep or not names or edge.strip() in edges:
            raise ConfigError(f"--edge {spec!r}: write EDGE=CLIENT,CLIENT..., once per edge")
        edges[check_id(edge.strip(), "edge")] = [check_id(c, "agent") for c in names]
    return edges


def parse_sizes(specs: list[str]) -> dict[str, int]:
    """`--size a3=265` options as {agent: samples}; a malformed one is a ConfigError (the
    range is checked by `provision`)."""
    from jetsplit.cli_types import parse_agent_options

    sizes: dict[str, int] = {}
    for agent, count in parse_agent_options(specs, "--size", "SAMPLES", "a3=265").items():
        agent, count = agent.strip(), count.strip()
        if agent in sizes or not (count.isascii() and count.isdigit() and len(count) <= 20):
            raise ConfigError(f"--size {agent}={count}: write AGENT=SAMPLES (e.g. a3=265), "
                              "a whole number, once per agent")
        sizes[check_id(agent, "agent")] = int(count)
    return sizes


def provision_command(
    fleet: Annotated[str, typer.Option("--fleet", help="Fleet name (topics, CA name).")],
    agents: Annotated[str, typer.Option("--agents", help="Agent ids, comma-separated.")],
    out: Annotated[Path, typer.Option("--out", help="Empty folder to write into.")],
    broker_host: Annotated[str, typer.Option(
        "--broker-host", help="Names the broker certificate is valid for, comma-separated "
        "(DNS names or IPs).")] = "localhost,127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Broker TLS port.", min=1, max=65535)
                    ] = 8883,
    bind: Annotated[str, typer.Option("--bind", help="Address the broker listens on.")
                    ] = "0.0.0.0",
    days: Annotated[int, typer.Option("--days", help="Certificate validity.", min=1)] = 825,
    edge: Annotated[list[str] | None, typer.Option(
        "--edge", help="SHeRL-FL: EDGE=CLIENT,CLIENT... (repeat per edge): opens the direct "
        "client<->edge topics for exactly these pairs.")] = None,
    size: Annotated[list[str] | None, typer.Option(
        "--size", help="AGENT=N (repeat): the samples that device holds; its registered "
        "size weighs at most N in any average (the coordinator's server.toml).")] = None,
) -> None:
    """Fleet CA, per-device startup kits (mTLS certificate + Ed25519 signing key) and a
    Mosquitto config with per-device ACLs."""
    names = tuple(n.strip() for n in broker_host.split(",") if n.strip())
    if not names:
        raise ConfigError("--broker-host: name at least one host")
    ids = [a.strip() for a in agents.split(",") if a.strip()]
    kits = provision(fleet, ids, out, broker_names=names, port=port, bind=bind, days=days,
                     edges=parse_edges(edge or []), sizes=parse_sizes(size or []))
    typer.echo(f"fleet {fleet}: CA, broker config and {len(kits)} kits "
               f"({', '.join(kits)}) in {out}; read {out / 'README.md'}")
