"""The `[mqtt]` section of agent.toml and server.toml: its defaults, the bounds of every
field at and just past each edge (a keepalive, chunk size or timeout out of range must be
refused when the file is read, not when a device is mid-run), strict types, the shared
fleet key (file first, then the environment, at least 16 bytes) and the per-device keys,
and the endpoint options built from it. Every refusal is one ConfigError line, pinned
word for word."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from jetsplit.broker_url import BrokerAddress
from jetsplit.errors import ConfigError
from jetsplit.identity import KeyRing, Signer
from jetsplit.transport import settings as settings_module
from jetsplit.transport.mqtt import EndpointOptions, TlsOptions
from jetsplit.transport.settings import FLEET_KEY_ENV, MIN_KEY_BYTES, MqttSection
from jetsplit.wire import Limits

pytestmark = pytest.mark.fast

MIB = 1024 * 1024
KEY16 = b"0123456789abcdef"


@pytest.fixture(autouse=True)
def no_fleet_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FLEET_KEY_ENV, raising=False)


def test_constants() -> None:
    assert FLEET_KEY_ENV == "JETSPLIT_FLEET_KEY"
    assert MIN_KEY_BYTES == 16


def test_defaults() -> None:
    section = MqttSection()
    assert section.broker == "mqtt://127.0.0.1:1883"
    assert section.protocol == "auto"
    assert section.keepalive_s == 30
    assert section.chunk_bytes == MIB
    assert (section.tls_ca, section.tls_cert, section.tls_key) == (None, None, None)
    assert section.tls_insecure is False
    assert section.connect_wait_s == 10.0
    assert section.fleet_key_file is None
    assert (section.signing_key, section.trusted_keys) == (None, None)
    assert (section.operator_cert, section.operator_key) == (None, None)
    assert section.max_message_mib == 64
    assert section.reassembly_timeout_s == 120.0


@pytest.mark.parametrize(("field", "good", "bad"), [
    ("keepalive_s", [2, 3, 3599, 3600], [1, 0, -2, 3601]),
    ("chunk_bytes", [16 * 1024, 16 * 1024 + 1, 256 * MIB - 1, 256 * MIB],
     [16 * 1024 - 1, 16, 0, 256 * MIB + 1]),
    ("connect_wait_s", [1e-9, 0.5, 1.0, 3600.0], [0.0, -1e-9, -0.5, 3600.001]),
    ("max_message_mib", [1, 2, 255, 256], [0, -1, 257]),
    ("reassembly_timeout_s", [1.0, 1.5, 3600.0], [0.999, 0.5, 0.0, 3600.001]),
])
def test_bounds_at_and_past_each_edge(field: str, good: list[Any], bad: list[Any]) -> None:
    for value in good:
        assert getattr(MqttSection(**{field: value}), field) == value
    for value in bad:
        with pytest.raises(ValidationError):
            MqttSection(**{field: value})


def test_strict_types_and_unknown_keys() -> None:
    with pytest.raises(ValidationError):
        MqttSection(keepalive_s="30")
    with pytest.raises(ValidationError):
        MqttSection(tls_insecure="yes")
    with pytest.raises(ValidationError):
        MqttSection(protocol="4")
    with pytest.raises(ValidationError):
        MqttSection(bogus=1)
    assert MqttSection(protocol="3.1.1").protocol == "3.1.1"


def test_address() -> None:
    assert MqttSection(broker="mqtts://u:p@host:8884").address() == BrokerAddress(
        "host", 8884, tls=True, username="u", password="p")
    assert MqttSection().address() == BrokerAddress("127.0.0.1", 1883)
    with pytest.raises(ConfigError):
        MqttSection(broker="http://x").address()


# ---------------------------------------------------------------- the fleet key


def test_no_key_configured_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MqttSection().fleet_key() is None
    monkeypatch.setenv(FLEET_KEY_ENV, "")
    assert MqttSection().fleet_key() is None


def test_key_from_a_file_is_stripped(tmp_path: Path) -> None:
    path = tmp_path / "fleet.key"
    path.write_bytes(b"  " + KEY16 + b"\n")
    assert MqttSection(fleet_key_file=str(path)).fleet_key() == KEY16


def test_key_file_path_expands_the_home_folder(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "fleet.key").write_bytes(KEY16)
    assert MqttSection(fleet_key_file="~/fleet.key").fleet_key() == KEY16


def test_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FLEET_KEY_ENV, " " + KEY16.decode() + " \n")
    assert MqttSection().fleet_key() == KEY16


def test_the_file_wins_over_the_environment(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "fleet.key"
    path.write_bytes(b"f" * 20)
    monkeypatch.setenv(FLEET_KEY_ENV, "e" * 20)
    assert MqttSection(fleet_key_file=str(path)).fleet_key() == b"f" * 20


def test_a_short_key_is_refused_at_15_bytes_and_taken_at_16(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "fleet.key"
    path.write_bytes(KEY16[:15])
    with pytest.raises(ConfigError) as err:
        MqttSection(fleet_key_file=str(path)).fleet_key()
    assert str(err.value) == f"fleet key {path}: must be at least 16 bytes"
    monkeypatch.setenv(FLEET_KEY_ENV, KEY16[:15].decode())
    with pytest.raises(ConfigError) as err:
        MqttSection().fleet_key()
    assert str(err.value) == "fleet key $JETSPLIT_FLEET_KEY: must be at least 16 bytes"
    monkeypatch.setenv(FLEET_KEY_ENV, KEY16.decode())
    assert MqttSection().fleet_key() == KEY16


def test_an_unreadable_key_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "missing.key"
    with pytest.raises(ConfigError) as err:
        MqttSection(fleet_key_file=str(path)).fleet_key()
    assert str(err.value) == f"fleet key {path}: cannot read: No such file or directory"
    with pytest.raises(ConfigError) as err:
        MqttSection(fleet_key_file=str(tmp_path)).fleet_key()  # a folder
    assert str(err.value) == f"fleet key {tmp_path}: cannot read: Is a directory"


# ---------------------------------------------------------------- per-device keys


def write_kit(root: Path, name: str = "a0", peers: tuple[str, ...] = ("coordinator",)
              ) -> tuple[Path, Path, Signer]:
    """A private key `<name>.key` and a folder of trusted `<peer>.pub`."""
    signer = Signer.generate(name)
    key = root / f"{name}.key"
    key.write_bytes(signer.private_pem())
    trusted = root / "trusted"
    trusted.mkdir()
    for peer in peers:
        (trusted / f"{peer}.pub").write_bytes(Signer.generate(peer).public_pem())
    return key, trusted, signer


def test_identity_absent_is_none_none() -> None:
    assert MqttSection().identity() == (None, None)


def test_identity_needs_both_halves(tmp_path: Path) -> None:
    key, trusted, _ = write_kit(tmp_path)
    message = ("mqtt: signing_key and trusted_keys go together (both come from a "
               "`jetsplit provision` kit)")
    with pytest.raises(ConfigError) as err:
        MqttSection(signing_key=str(key)).identity()
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:
        MqttSection(trusted_keys=str(trusted)).identity()
    assert str(err.value) == message


def test_identity_loads_the_signer_named_by_its_file_and_the_keyring(tmp_path: Path) -> None:
    key, trusted, signer = write_kit(tmp_path, "a7", peers=("coordinator", "e0"))
    loaded, keyring = MqttSection(signing_key=str(key), trusted_keys=str(trusted)).identity()
    assert isinstance(loaded, Signer)
    assert loaded.name == "a7"
    assert loaded.public_pem() == signer.public_pem()
    assert isinstance(keyring, KeyRing)
    assert keyring.senders == ["coordinator", "e0"]


# ---------------------------------------------------------------- endpoint options


def test_endpoint_options_of_the_defaults() -> None:
    options = MqttSection().endpoint_options()
    assert options == EndpointOptions(
        protocol="auto", keepalive_s=30, chunk_bytes=MIB, fleet_key=None,
        tls=TlsOptions(None, None, None, False),
        limits=Limits(max_message_bytes=64 * MIB, max_decoded_bytes=64 * MIB),
        signer=None, keyring=None, reassembly_timeout_s=120.0)


def test_endpoint_options_carry_every_field(tmp_path: Path) -> None:
    files = {}
    for name in ("ca.crt", "client.crt", "client.key", "fleet.key"):
        files[name] = tmp_path / name
        files[name].write_bytes(KEY16 + b"!")
    section = MqttSection(protocol="3.1.1", keepalive_s=7, chunk_bytes=20000,
                          tls_ca=str(files["ca.crt"]), tls_cert=str(files["client.crt"]),
                          tls_key=str(files["client.key"]), tls_insecure=True,
                          fleet_key_file=str(files["fleet.key"]), max_message_mib=3,
                          reassembly_timeout_s=5.5)
    options = section.endpoint_options()
    assert options == EndpointOptions(
        protocol="3.1.1", keepalive_s=7, chunk_bytes=20000, fleet_key=KEY16 + b"!",
        tls=TlsOptions(str(files["ca.crt"]), str(files["client.crt"]),
                       str(files["client.key"]), True),
        limits=Limits(max_message_bytes=3 * MIB, max_decoded_bytes=3 * MIB),
        signer=None, keyring=None, reassembly_timeout_s=5.5)
    assert options.authenticated is True


@pytest.mark.parametrize("name", ["tls_ca", "tls_cert", "tls_key"])
def test_a_missing_tls_file_is_one_line(tmp_path: Path, name: str) -> None:
    present = tmp_path / "present.pem"
    present.write_bytes(b"x")
    values = {"tls_ca": str(present), "tls_cert": str(present), "tls_key": str(present)}
    values[name] = str(tmp_path / "absent.pem")
    with pytest.raises(ConfigError) as err:
        MqttSection(**values).endpoint_options()
    assert str(err.value) == f"mqtt.{name}: {tmp_path / 'absent.pem'}: file not found"


def test_a_tls_folder_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^mqtt.tls_ca: .*: file not found$"):
        MqttSection(tls_ca=str(tmp_path)).endpoint_options()


def test_device_keys_go_into_the_options(tmp_path: Path) -> None:
    key, trusted, signer = write_kit(tmp_path)
    options = MqttSection(signing_key=str(key), trusted_keys=str(trusted)).endpoint_options()
    assert options.signer.name == "a0"
    assert options.signer.public_pem() == signer.public_pem()
    assert options.keyring.senders == ["coordinator"]
    assert options.fleet_key is None
    assert options.authenticated is True


def test_device_keys_and_a_fleet_key_together_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key, trusted, _ = write_kit(tmp_path)
    monkeypatch.setenv(FLEET_KEY_ENV, KEY16.decode())
    with pytest.raises(ConfigError) as err:
        MqttSection(signing_key=str(key), trusted_keys=str(trusted)).endpoint_options()
    assert str(err.value) == ("mqtt: use either per-device keys (signing_key, trusted_keys) "
                              "or a shared fleet key, not both")


def test_a_fleet_key_alone_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FLEET_KEY_ENV, KEY16.decode())
    options = MqttSection().endpoint_options()
    assert options.fleet_key == KEY16
    assert options.signer is None


def test_annotations_resolve() -> None:
    """Every annotation is a real type on the Python the tests run."""
    namespace = vars(settings_module)
    hints = typing.get_type_hints(MqttSection.fleet_key, namespace)
    assert hints["return"] == (bytes | None)
    assert typing.get_type_hints(MqttSection.identity, namespace)["return"] == tuple[Any, Any]
    assert typing.get_type_hints(MqttSection.endpoint_options, namespace)["return"] is (
        EndpointOptions)
