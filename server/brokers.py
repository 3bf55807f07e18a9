"""Brokers started by jetsplit itself: an embedded amqtt broker for zero-setup runs, and a
private Mosquitto process (own config, loopback, free port) for tests and field trials.

Both bind to 127.0.0.1 explicitly: amqtt's default is 0.0.0.0:1883 (FIELD-NOTES.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from jetsplit.broker_url import BrokerAddress
from jetsplit.errors import BackendUnavailable, JetsplitError

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

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
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


class MosquittoProcess:
    """A private Mosquitto on loopback with its own config; restartable on the same port."""

    def __init__(self, port: int | None = None, *, max_message_bytes: int = 0) -> None:
        binary = mosquitto_binary()
        if binary is None:
            raise BackendUnavailable("mosquitto is not installed (apt-get install mosquitto)")
        self.binary, self.port = binary, port or free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="jetsplit-mosquitto-"))
        self.config = self._dir / "mosquitto.conf"
        self.config.write_text(
            f"listener {self.port} {LOOPBACK}\n"
            "allow_anonymous true\n"
            "persistence false\n"
            f"message_size_limit {max_message_bytes}\n"
            "max_inflight_messages 0\n"
            "max_queued_messages 100000\n"
            "log_type error\n"
        )
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> BrokerAddress:
        return BrokerAddress(LOOPBACK, self.port)

    def start(self) -> MosquittoProcess:
        self._process = subprocess.Popen(
            [self.binary, "-c", str(self.config)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_for_port(LOOPBACK, self.port)
        except JetsplitError:
            self.stop()
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
