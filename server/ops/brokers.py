"""Brokers started by jetsplit itself: an embedded amqtt broker for zero-setup runs, and a
private Mosquitto process (own config, loopback, free port) for tests and field trials.

Both bind to 127.0.0.1 explicitly: amqtt's default is 0.0.0.0:1883.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from jetsplit.broker_url import BrokerAddress
from jetsplit.errors import BackendUnavailable, JetsplitError
from jetsplit.transport.topics import check_id

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float = 10.0) -> None:
    """Block until something accepts TCP connections on host:port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise JetsplitError(f"broker at {host}:{port} did not start within {timeout_s:.0f}s")


def _quiet_loop_errors(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """amqtt's handler crashes on clients that hang up mid-CONNECT; that is not our error."""
    logging.getLogger("jetsplit.broker").debug("embedded broker: %s", context.get("message"))


class _DroppedConnectionFilter(logging.Filter):
    """Drops amqtt's ERROR for a client that connected and sent nothing (our own port probe
    in `wait_for_port`, health checks); every other broker error still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No data from")


class EmbeddedBroker:
    """amqtt running on its own event loop in a daemon thread of this process."""

    def __init__(self, port: int | None = None, host: str = LOOPBACK) -> None:
        self.host, self.port = host, port or free_port(host)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broker = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def address(self) -> BrokerAddress:
        return BrokerAddress(self.host, self.port)

    def start(self) -> EmbeddedBroker:
        try:
            from amqtt.broker import Broker
        except ImportError:
            raise BackendUnavailable(
                "the embedded broker needs amqtt: pip install 'jetsplit[server]'") from None
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin":
                        {"allow_anonymous": True}},
        }
        ready = threading.Event()

        # amqtt logs every dropped connection (port probes, MQTT 5 CONNECTs it refuses) with
        # a traceback; the endpoint handles those cases, so keep only real errors.
        logging.getLogger("amqtt").setLevel(logging.ERROR)
        broker_log = logging.getLogger("amqtt.broker")
        if not any(isinstance(f, _DroppedConnectionFilter) for f in broker_log.filters):
            broker_log.addFilter(_DroppedConnectionFilter())

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.set_exception_handler(_quiet_loop_errors)
            asyncio.set_event_loop(self._loop)
            try:
                self._broker = Broker(config, loop=self._loop)
                self._loop.run_until_complete(self._broker.start())
            except BaseException as exc:  # surfaced to the caller of start()
                self._error = exc
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="jetsplit-broker", daemon=True)
        self._thread.start()
        ready.wait(15)
        if self._error is not None:
            raise JetsplitError(
                f"embedded broker could not listen on {self.host}:{self.port}: {self._error}")
        wait_for_port(self.host, self.port)
        return self

    def stop(self) -> None:
        if self._loop is None or self._broker is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop)
        with contextlib.suppress(Exception):
            future.result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._loop = self._broker = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def mosquitto_binary() -> str | None:
    """Path of the mosquitto executable (Debian installs it in /usr/sbin)."""
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if Path(p).exists()),
        None)


def _last_error_line(stderr: bytes) -> str:
    """Mosquitto's most telling stderr line (its first "Error..."), timestamp stripped."""
    lines = [line.split(": ", 1)[-1].strip()
             for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error")]
    return (errors or lines[-1:] or [""])[0]


# Our own openssl config, so the system's openssl.cnf (OpenSSL 1.1 or 3) cannot interfere.
# Python's ssl verifies strictly on 3.13+: CA basicConstraints critical, AKI on the leaf.
_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = jetsplit
[ca_ext]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""


def _mosquitto_major(binary: str) -> int:
    """Mosquitto's major version (`set_tcp_nodelay` exists from 2.0; 1.6 rejects it)."""
    try:
        text = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    match = re.search(r"mosquitto version (\d+)", text)
    return int(match.group(1)) if match else 0


def site_bridge_conf(fleet: str, cloud: BrokerAddress, *, name: str = "cloud",
                     ca_file: str | None = None) -> str:
    """Mosquitto config lines that bridge a site's local broker to the cloud's for one fleet:
    agents' up/ and presence/ go out, the coordinator's down/ comes in, and nothing else
    crosses, so SHeRL-FL's direct client↔edge topics (peer/…) stay on the site. With
    `ca_file` the bridge speaks TLS to the cloud broker (add `bridge_certfile` and
    `bridge_keyfile` where it requires client certificates)."""
    base = f"jetsplit/v1/{check_id(fleet, 'fleet')}"
    lines = [f"connection {name}", f"address {cloud.host}:{cloud.port}",
             "bridge_protocol_version mqttv311", "try_private true", "cleansession false",
             "notifications false", "restart_timeout 1 30",
             f"topic {base}/up/# out 1", f"topic {base}/presence/# out 1",
             f"topic {base}/down/# in 1"]
    if cloud.username:
        lines += [f"remote_username {cloud.username}",
                  f"remote_password {cloud.password or ''}"]
    if ca_file is not None:
        lines.append(f"bridge_cafile {ca_file}")
    return "".join(f"{line}\n" for line in lines)


class MosquittoProcess:
    """A private Mosquitto on loopback with its own config; restartable on the same port."""

    def __init__(
        self,
        port: int | None = None,
        *,
        max_message_bytes: int = 0,
        tls: bool = False,
        users: dict[str, str] | None = None,
        provisioned: Path | None = None,
        extra: str = "",
    ) -> None:
        """`tls=True`: a throwaway CA and a server certificate for 127.0.0.1/localhost are
        made in the private directory (trust `ca_file`); `users`: logins required (the first
        one goes into `address`), anonymous clients refused; `provisioned`: the `broker/`
        folder `jetsplit provision` wrote (mutual TLS, identities from certificates, ACL),
        run as written except for its listener, which moves to loopback and our port;
        `extra`: more config lines (e.g. `site_bridge_conf`'s bridge to a cloud broker)."""
        binary = mosquitto_binary()
        if binary is None:
            raise BackendUnavailable("mosquitto is not installed (apt-get install mosquitto)")
        self.binary, self.port = binary, port or free_port()
        self.tls, self.users = tls or provisioned is not None, dict(users or {})
        self._dir = Path(tempfile.mkdtemp(prefix="jetsplit-mosquitto-"))
        self.config = self._dir / "mosquitto.conf"
        self.ca_file: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        if provisioned is not None:
            self.ca_file = provisioned / "ca.crt"
            ours = ("persistence ", "log_type ", "max_queued_messages ")
            lines = [f"listener {self.port} {LOOPBACK}" if line.startswith("listener ") else line
                     for line in (provisioned / "mosquitto.conf").read_text().splitlines()
                     if not line.startswith(ours)]
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                lines.append("user root")  # the kit's keys are 0600, owned by us
            self.config.write_text("\n".join([*lines, "persistence false", "log_type error",
                                              "max_queued_messages 100000", ""]) + extra)
            return
        try:
            listener = self._secure_options(binary)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.config.write_text(
            f"listener {self.port} {LOOPBACK}\n"
            + listener
            + ("" if self.users else "allow_anonymous true\n")
            + "persistence false\n"
            f"message_size_limit {max_message_bytes}\n"
            "max_inflight_messages 0\n"
            "max_queued_messages 100000\n"
            "log_type error\n"
            + ("set_tcp_nodelay true\n" if _mosquitto_major(binary) >= 2 else "")
            + extra
        )
        self._process: subprocess.Popen[bytes] | None = None

    def _secure_options(self, binary: str) -> str:
        """Config lines for TLS and logins (empty for a plain anonymous broker)."""
        lines = []
        if self.tls:
            self.ca_file, cert, key = self._make_certificates()
            lines += [f"cafile {self.ca_file}", f"certfile {cert}", f"keyfile {key}",
                      "require_certificate false"]
        if self.users:
            lines += ["allow_anonymous false", f"password_file {self._make_password_file(binary)}"]
        if lines and hasattr(os, "geteuid") and os.geteuid() == 0:
            # Started as root, Mosquitto 2 drops to user `mosquitto` before it reads the key
            # and password files, which live in our root-only 0700 directory: stay root.
            lines.append("user root")
        return "".join(f"{line}\n" for line in lines)

    def _make_certificates(self) -> tuple[Path, Path, Path]:
        """A P-256 CA and a server certificate (CN/SAN 127.0.0.1 + localhost), 2 days valid."""
        openssl = shutil.which("openssl")
        if openssl is None:
            raise BackendUnavailable("a TLS test broker needs the openssl command (apt-get "
                                     "install openssl)")
        cnf = self._dir / "openssl.cnf"
        cnf.write_text(_OPENSSL_CONFIG)
        ca, ca_key = self._dir / "ca.crt", self._dir / "ca.key"
        csr, cert, key = (self._dir / f"server.{ext}" for ext in ("csr", "crt", "key"))
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
        steps = [
            ["req", "-x509", "-config", cnf, *ec, "-keyout", ca_key, "-out", ca, "-days", "2",
             "-subj", f"/CN=jetsplit throwaway CA {secrets.token_hex(4)}",
             "-extensions", "ca_ext"],
            ["req", "-new", "-config", cnf, *ec, "-keyout", key, "-out", csr,
             "-subj", f"/CN={LOOPBACK}"],
            ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-out", cert,
             "-set_serial", f"0x{secrets.token_hex(8)}", "-days", "2",
             "-extfile", cnf, "-extensions", "server_ext"],
        ]
        for step in steps:
            done = subprocess.run([openssl, *map(str, step)], capture_output=True, text=True,
                                  check=False)
            if done.returncode != 0:
                detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise JetsplitError(f"openssl {step[0]} failed: {detail}")
        for path in (ca_key, key):
            path.chmod(0o600)
        return ca, cert, key

    def _make_password_file(self, binary: str) -> Path:
        tool = shutil.which("mosquitto_passwd") or next(
            (str(p) for p in (Path(binary).with_name("mosquitto_passwd"),
                              Path("/usr/bin/mosquitto_passwd")) if p.exists()), None)
        if tool is None:
            raise BackendUnavailable("mosquitto_passwd is not installed (apt-get install "
                                     "mosquitto)")
        path = self._dir / "passwords"
        path.touch(mode=0o600)
        for username, password in self.users.items():
            done = subprocess.run([tool, "-b", str(path), username, password],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                detail = (done.stdout.strip() or done.stderr.strip() or "no output")
                raise JetsplitError(f"mosquitto_passwd failed for user {username!r}: "
                                    f"{detail.splitlines()[-1]}")
        path.chmod(0o600)
        return path

    @property
    def address(self) -> BrokerAddress:
        username, password = next(iter(self.users.items()), (None, None))
        return BrokerAddress(LOOPBACK, self.port, tls=self.tls, username=username,
                             password=password)

    def start(self) -> MosquittoProcess:
        self._process = subprocess.Popen(
            [self.binary, "-c", str(self.config)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_for_port(LOOPBACK, self.port)
        except JetsplitError as exc:
            process = self._process
            self.stop()
            detail = _last_error_line(process.stderr.read() if process.stderr else b"")
            if detail:
                raise JetsplitError(f"{exc}: mosquitto said {detail!r}") from None
            raise
        return self

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> MosquittoProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
