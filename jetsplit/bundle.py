"""Bundles: what the export tool ships to an agent, and how the agent reads and trusts it.

A bundle is a directory (or a .tar/.tar.gz of one) holding `manifest.json`, safetensors
weights and ONNX blocks. Loading verifies everything before anything is used: the manifest
schema, the format and zoo versions, every file's size and sha256, and that no file is
unlisted, linked or outside the bundle. Trainable modules are rebuilt from the model source
(the zoo, or model code the operator installed, whose hash must match the manifest's) plus
weights, so nothing is ever unpickled and no code travels. Writing lives in
`export/bundle_writer.py`; this module is the shared core because the agent, which never
installs `export`, must read bundles.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import stat
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from torch import nn
from typing_extensions import Annotated

from jetsplit import __version__
from jetsplit.compat import removeprefix
from jetsplit.errors import BundleError, JetsplitError
from jetsplit.model_source import check_identity, is_zoo
from jetsplit.models import (
    ZOO_VERSION,
    AuxiliaryHead,
    ModelSpec,
    build_aux_head,
    split,
)
from jetsplit.models.safetensors_views import UnreadableWeights, tensor_views
from jetsplit.models.sources import build_to_load
from jetsplit.models.weights import load_strict

# Format 2: the manifest names its role, and a bundle holds only what that role runs.
BUNDLE_FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
WEIGHT_FILES = {"client": "client.safetensors", "server": "server.safetensors",
                "aux": "aux.safetensors", "edge": "edge.safetensors"}
ONNX_FILES = {"client": "client.onnx", "aux": "aux.onnx"}
ALLOWED_FILES = frozenset(WEIGHT_FILES.values()) | frozenset(ONNX_FILES.values())
# What a device runs is all it receives (roles of the manifest):
#   full   - the whole model: the export tool's output, the coordinator's copy, FedAvg devices
#   client - a split-method client: its client block (+ aux head where the method uses one)
#   edge   - a SHeRL-FL edge: its middle block only (server layers [:edge_layers], no head)
ROLES = ("full", "client", "edge")
_AUX_FILES = frozenset({"aux.safetensors", "aux.onnx"})
_ROLE_FILES: dict[str, frozenset[str]] = {
    "full": frozenset({"client.safetensors", "server.safetensors", "client.onnx"}),
    "client": frozenset({"client.safetensors", "client.onnx"}),
    "edge": frozenset({"edge.safetensors"}),
}
# Agent role (as registered) → the bundle roles it accepts.
AGENT_ACCEPTS = {"client": ("client", "full"), "edge": ("edge",)}


def role_files(role: str, aux: bool) -> frozenset[str]:
    """Exactly the files a bundle of `role` holds (with an aux head or not)."""
    files = _ROLE_FILES[role]
    return files | _AUX_FILES if aux and role != "edge" else files
# Engines are built on the device next to the bundle (never shipped): tolerated in a
# directory, rejected inside a tar. Pattern follows runtimes.tensorrt_runtime.engine_filename.
ENGINE_NAME = re.compile(r"^\.?(client|aux)\.[0-9A-Za-z.-]+\.engine(\.tmp)?\Z")

MAX_MANIFEST_BYTES = 1 << 20
MAX_FILE_BYTES = 4 << 30  # a ViT/VGG at 224 px is < 1 GiB; a Jetson has 4–64 GiB in all
MAX_BUNDLE_BYTES = 8 << 30
MAX_TAR_MEMBERS = 32
_HASH_CHUNK = 1 << 20


# --------------------------------------------------------------------------- manifest schema


class FileEntry(BaseModel):
    """One shipped file: its sha256 (hex) and size in bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0, le=MAX_FILE_BYTES)


class SpecEntry(BaseModel):
    """The zoo spec that rebuilds the architecture (mirrors `ModelSpec`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(min_length=1, max_length=200)  # a model source (model_source.py)
    input_shape: Tuple[int, int, int]
    num_classes: int = Field(ge=2)

    def to_spec(self) -> ModelSpec:
        return ModelSpec.from_dict(self.model_dump())


class CodeEntry(BaseModel):
    """The code behind a user's model source: its module and the sha256 of its Python
    sources, or a library and its version. Never the code itself."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    module: str = Field(min_length=1, max_length=200)
    sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    version: Optional[str] = Field(default=None, min_length=1, max_length=64)

    def record(self) -> Dict[str, str]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class Manifest(BaseModel):
    """`manifest.json`: everything an agent needs to rebuild, run and trust the blocks."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format_version: int = Field(ge=1)
    jetsplit_version: str = Field(min_length=1, max_length=64)
    zoo_version: int = Field(ge=1)
    model: SpecEntry
    split: int = Field(ge=1)
    input_shape: Tuple[int, ...] = Field(min_length=1, max_length=4)
    activation_shape: Tuple[int, ...] = Field(min_length=1, max_length=4)
    client_layers: Tuple[str, ...] = Field(min_length=1)
    server_layers: Tuple[str, ...] = Field(min_length=1)
    aux_ratio: Optional[float] = Field(gt=0.0, le=1.0)
    opset: int = Field(ge=7, le=30)
    codec: str = "fp32"
    files: Dict[str, FileEntry]
    role: str = Field(pattern=r"^(full|client|edge)$")
    edge_layers: Optional[int] = Field(default=None, ge=1, le=4096)
    # A user's model source: the code that builds it (absent for a zoo model).
    code: Optional[CodeEntry] = None
    # sha256 of the initial weights file the model started from (absent when seeded).
    initial_weights_sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    # The run's class names in label order: a device's own labels are mapped to them by name.
    classes: Optional[Tuple[Annotated[str, Field(min_length=1, max_length=200)], ...]] = None

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        from jetsplit.wire.codecs import CODECS

        if value not in CODECS:
            raise ValueError(f"unknown codec {value!r}; expected one of {', '.join(CODECS)}")
        return value

    @field_validator("files")
    @classmethod
    def _safe_names(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for name in files:
            if name not in ALLOWED_FILES:
                kind = "unsafe" if ("/" in name or "\\" in name or ".." in name) else "unknown"
                raise ValueError(f"{kind} file name {name!r}; a bundle holds only "
                                 f"{', '.join(sorted(ALLOWED_FILES))}")
        if sum(entry.size for entry in files.values()) > MAX_BUNDLE_BYTES:
            raise ValueError(f"files exceed the bundle size limit of {MAX_BUNDLE_BYTES >> 30} GiB")
        return files

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if tuple(self.input_shape) != tuple(self.model.input_shape):
            raise ValueError(f"input_shape {list(self.input_shape)} differs from the model's "
                             f"{list(self.model.input_shape)}")
        if (self.code is None) != is_zoo(self.model.name):
            raise ValueError("a model source other than a zoo name needs its code record "
                             "(and a zoo model has none)")
        if self.classes is not None and (len(self.classes) != self.model.num_classes
                                         or len(set(self.classes)) != len(self.classes)):
            raise ValueError(f"classes must name each of the model's {self.model.num_classes} "
                             "classes once")
        if len(self.client_layers) != self.split:
            raise ValueError(f"split {self.split} but {len(self.client_layers)} client layers")
        if self.role == "edge":
            if self.aux_ratio is not None:
                raise ValueError("an edge bundle has no aux head (aux_ratio must be null)")
            if self.edge_layers is None or self.edge_layers >= len(self.server_layers):
                raise ValueError(f"an edge bundle needs edge_layers in "
                                 f"1..{len(self.server_layers) - 1}")
        elif self.edge_layers is not None:
            raise ValueError(f"edge_layers is set but the role is {self.role}")
        needed = role_files(self.role, self.aux_ratio is not None)
        unneeded = sorted(set(self.files) - needed)
        if unneeded:  # a device receives only what it runs: refuse anything more
            if self.aux_ratio is None and _AUX_FILES & set(unneeded):
                raise ValueError("aux files listed but aux_ratio is null")
            raise ValueError(f"role {self.role} does not run {unneeded[0]}; refused (a "
                             f"{self.role} bundle holds only {', '.join(sorted(needed))})")
        missing = sorted(needed - set(self.files))
        if missing:
            raise ValueError(f"files must list {', '.join(missing)}")
        return self


def _oneline(exc: BaseException) -> str:
    """A library's exception text, squeezed onto one short line."""
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def sha256_file(path: Path) -> str:
    """Streaming sha256 of a file (bundles may be hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _schema_error(where: str, exc: ValidationError) -> BundleError:
    """The first validation error as one line naming its field."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "manifest"
    msg = removeprefix(str(err["msg"]), "Value error, ")
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return BundleError(f"{where}: {MANIFEST_NAME}: field {loc}: {msg}{more}")


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse untrusted manifest bytes: JSON, then versions, then the full schema."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{where}: {MANIFEST_NAME} is not valid JSON ({_oneline(exc)})") from None
    if not isinstance(data, dict):
        raise BundleError(f"{where}: {MANIFEST_NAME} must hold a JSON object")
    # The format version is checked before the schema: a newer format may add fields.
    fmt = data.get("format_version")
    if not isinstance(fmt, int) or isinstance(fmt, bool):
        raise BundleError(f"{where}: {MANIFEST_NAME}: field format_version: missing or not an "
                          "integer")
    if fmt != BUNDLE_FORMAT_VERSION:
        hint = "upgrade jetsplit on this device" if fmt > BUNDLE_FORMAT_VERSION else \
            "re-export the bundle with this jetsplit"
        raise BundleError(f"{where}: bundle format version {fmt} is not supported by jetsplit "
                          f"{__version__} (format version {BUNDLE_FORMAT_VERSION}); {hint}")
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        raise _schema_error(where, exc) from None
    if manifest.zoo_version != ZOO_VERSION:
        raise BundleError(
            f"{where}: bundle was made with model zoo version {manifest.zoo_version} (jetsplit "
            f"{manifest.jetsplit_version}), this jetsplit {__version__} has zoo version "
            f"{ZOO_VERSION}; re-export the bundle with matching versions"
        )
    try:
        manifest.model.to_spec()
    except JetsplitError as exc:
        raise BundleError(f"{where}: {MANIFEST_NAME}: field model: {exc}") from None
    return manifest


# --------------------------------------------------------------------------- verification


def check_code(manifest: Manifest, where: str) -> None:
    """Refuse a bundle whose model code differs from the code installed here (one line
    naming both); nothing is imported before this passes."""
    if manifest.code is None:
        return
    try:
        check_identity(manifest.model.name, manifest.code.record(), where)
    except JetsplitError as exc:
        raise BundleError(str(exc)) from None


def _verify_dir(root: Path, where: str, *, allow_engines: bool) -> Manifest:
    """Every listed file present, regular, of the listed size and hash; nothing else there."""
    if not root.is_dir():
        raise BundleError(f"{where}: not a directory or a .tar/.tar.gz bundle")
    manifest_path = root / MANIFEST_NAME
    try:
        info = manifest_path.lstat()
    except FileNotFoundError:
        raise BundleError(f"{where}: {MANIFEST_NAME} not found (is this a bundle?)") from None
    if not stat.S_ISREG(info.st_mode):
        raise BundleError(f"{where}: {MANIFEST_NAME} is not a regular file")
    if info.st_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{where}: {MANIFEST_NAME} is larger than {MAX_MANIFEST_BYTES} bytes")
    manifest = parse_manifest(manifest_path.read_bytes(), where)

    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_symlink():
            raise BundleError(f"{where}: {entry.name} is a symlink; bundles hold regular files "
                              "only")
        if not entry.is_file(follow_symlinks=False):
            raise BundleError(f"{where}: unexpected entry {entry.name!r} (not a regular file)")
        listed = entry.name == MANIFEST_NAME or entry.name in manifest.files
        if not listed and not (allow_engines and ENGINE_NAME.match(entry.name)):
            raise BundleError(f"{where}: unlisted file {entry.name!r} (not in {MANIFEST_NAME}; "
                              "remove it or re-export the bundle)")
    for name, expected in sorted(manifest.files.items()):
        path = root / name
        try:
            info = path.lstat()
        except FileNotFoundError:
            raise BundleError(f"{where}: {name}: listed in {MANIFEST_NAME} but missing"
                              ) from None
        if info.st_size != expected.size:
            raise BundleError(f"{where}: {name}: size {info.st_size} bytes, manifest says "
                              f"{expected.size} (file was modified or truncated)")
        if sha256_file(path) != expected.sha256:
            raise BundleError(f"{where}: {name}: sha256 mismatch (file was modified)")
    return manifest


def _member_name(raw: str, where: str) -> tuple[str, str]:
    """(folder, base) of a tar member: flat or one folder deep, no absolute or `..` parts."""
    name = raw
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/")
    if name in ("", "."):
        return "", "."
    parts = name.split("/")
    if (name.startswith("/") or "\\" in name or re.match(r"^[A-Za-z]:", name)
            or any(p in ("", ".", "..") for p in parts) or len(parts) > 2):
        raise BundleError(f"{where}: unsafe tar member name {raw!r}")
    return ("", parts[0]) if len(parts) == 1 else (parts[0], parts[1])


def _extract_tar(archive: Path, dest: Path, where: str) -> None:
    """Extract only regular files with known names, flat or under one top folder, within the
    size limits, by copying bytes ourselves (no links, devices, modes or owners restored)."""
    try:
        tar = tarfile.open(archive, mode="r:*")  # noqa: SIM115 (closed by the with below)
    except (tarfile.TarError, OSError) as exc:
        raise BundleError(f"{where}: not a readable tar archive ({_oneline(exc)})") from None
    with tar:
        members: list[tuple[str, tarfile.TarInfo]] = []
        folders: set[str] = set()
        total = 0
        try:
            for count, member in enumerate(tar, 1):
                if count > MAX_TAR_MEMBERS:
                    raise BundleError(f"{where}: more than {MAX_TAR_MEMBERS} tar members")
                folder, base = _member_name(member.name, where)
                if member.isdir():
                    if folder:
                        raise BundleError(f"{where}: nested folder {member.name!r} in tar")
                    if base != ".":
                        folders.add(base)
                    continue
                if not member.isreg():
                    raise BundleError(f"{where}: tar member {member.name!r} is a link or special "
                                      "file; bundles hold regular files only")
                if base != MANIFEST_NAME and base not in ALLOWED_FILES:
                    raise BundleError(f"{where}: unlisted file {base!r} in tar (not a bundle "
                                      "file; engines are built on the device, never shipped)")
                if not 0 <= member.size <= MAX_FILE_BYTES:
                    raise BundleError(f"{where}: {base}: larger than the "
                                      f"{MAX_FILE_BYTES >> 30} GiB file limit")
                total += member.size
                if total > MAX_BUNDLE_BYTES:
                    raise BundleError(f"{where}: exceeds the {MAX_BUNDLE_BYTES >> 30} GiB "
                                      "bundle limit")
                folders.add(folder)
                members.append((base, member))
            if len(folders) > 1:
                raise BundleError(f"{where}: tar must hold the bundle files flat or in one folder")
            seen: set[str] = set()
            for base, member in members:
                if base in seen:
                    raise BundleError(f"{where}: duplicate tar member {base!r}")
                seen.add(base)
                source = tar.extractfile(member)
                if source is None:
                    raise BundleError(f"{where}: cannot read tar member {member.name!r}")
                with source, open(dest / base, "xb") as out:
                    remaining = member.size
                    while remaining > 0:
                        chunk = source.read(min(_HASH_CHUNK, remaining))
                        if not chunk:
                            raise BundleError(f"{where}: {base}: truncated in tar")
                        out.write(chunk)
                        remaining -= len(chunk)
        except (tarfile.TarError, EOFError, OSError) as exc:  # corrupt gzip/tar stream
            raise BundleError(f"{where}: corrupt tar archive ({_oneline(exc)})") from None


def is_tar_path(path: Path) -> bool:
    return path.name.endswith((".tar", ".tar.gz", ".tgz"))


# --------------------------------------------------------------------------- the bundle


class Bundle:
    """A verified bundle: its manifest, file paths, and trainable modules on demand."""

    def __init__(self, root: Path, manifest: Manifest, source: Path,
                 tmp: tempfile.TemporaryDirectory[str] | None = None) -> None:
        self.root = root
        self.manifest = manifest
        self.source = source
        self._tmp = tmp  # keeps an extracted tar alive as long as the bundle
        self._templates: dict[str, nn.Module] = {}  # verified blocks, copied on each request
        self._built: set[str] = set()  # blocks built once already (cached from the second)

    def __repr__(self) -> str:
        m = self.manifest
        return f"Bundle({str(self.source)!r}, model={m.model.name!r}, split={m.split})"

    @property
    def spec(self) -> ModelSpec:
        return self.manifest.model.to_spec()

    @property
    def split(self) -> int:
        return self.manifest.split

    @property
    def has_aux(self) -> bool:
        return self.manifest.aux_ratio is not None

    def path(self, name: str) -> Path:
        """Path of a listed file (never of anything the manifest does not list)."""
        if name not in self.manifest.files:
            raise BundleError(f"bundle {self.source}: {name} is not part of this bundle")
        return self.root / name

    @property
    def client_onnx(self) -> Path:
        return self.path(ONNX_FILES["client"])

    @property
    def aux_onnx(self) -> Path:
        self._need_aux()
        return self.path(ONNX_FILES["aux"])

    def _need_aux(self) -> None:
        if not self.has_aux:
            raise BundleError(f"bundle {self.source}: has no auxiliary head (aux_ratio is null)")

    def load_weights(self, block: str) -> dict[str, torch.Tensor]:
        """A block's tensors, re-hashed at read time so a file swapped after loading is caught."""
        name = WEIGHT_FILES[block]
        path = self.path(name)
        data = bytearray(path.stat().st_size)
        with open(path, "rb") as fh:  # one buffer: hashed, then viewed (no copy per tensor)
            got = fh.readinto(data)
        if got != len(data) or \
                hashlib.sha256(data).hexdigest() != self.manifest.files[name].sha256:
            raise BundleError(f"bundle {self.source}: {name}: sha256 mismatch (file was modified)")
        try:
            return tensor_views(data)
        except UnreadableWeights as exc:
            raise BundleError(f"bundle {self.source}: {name}: unreadable safetensors "
                              f"({_oneline(exc)})") from None

    def _blocks(self) -> tuple[nn.Module, nn.Sequential, nn.Sequential]:
        check_code(self.manifest, f"bundle {self.source}")
        model = build_to_load(self.spec)  # every tensor of the block used is loaded next
        client, server = split(model, self.split)
        names = (tuple(n for n, _ in client.named_children()),
                 tuple(n for n, _ in server.named_children()))
        if names != (self.manifest.client_layers, self.manifest.server_layers):
            raise BundleError(f"bundle {self.source}: layer names differ from this jetsplit's "
                              f"{self.spec.name} (zoo version {ZOO_VERSION}); re-export the bundle")
        return model, client, server

    def _load_into(self, module: nn.Module, block: str) -> nn.Module:
        where = f"bundle {self.source}: {WEIGHT_FILES[block]}"
        return load_strict(module, self.load_weights(block), where, BundleError)

    @property
    def role(self) -> str:
        return self.manifest.role

    def has_block(self, block: str) -> bool:
        """Whether this bundle ships `block` (client, server, aux or edge)."""
        return WEIGHT_FILES[block] in self.manifest.files

    def _need(self, block: str) -> None:
        if block == "aux":
            self._need_aux()
        if not self.has_block(block):
            raise BundleError(f"bundle {self.source}: a {self.role} bundle has no {block} block")

    def _template(self, block: str) -> nn.Module:
        """Build and load a block (weights hash-checked then). A block asked for a second
        time is kept as a template that later calls copy, which is what lets 100 simulated
        clients rebuild blocks cheaply; one asked for once (the coordinator's server block)
        is handed over as built, not held twice."""
        self._need(block)
        if block not in self._templates:
            if block not in self._built:
                self._built.add(block)
                return self._build_block(block)
            self._templates[block] = self._build_block(block)
        return copy.deepcopy(self._templates[block])

    def _build_block(self, block: str) -> nn.Module:
        """`block` built from the model and loaded from its (re-hashed) weights file."""
        model, client, server = self._blocks()
        if block == "aux":
            assert self.manifest.aux_ratio is not None
            module: nn.Module = build_aux_head(model, self.split, self.manifest.aux_ratio,
                                               seed=0)
        elif block == "edge":
            from jetsplit.tiers import carve

            assert self.manifest.edge_layers is not None
            module = carve(server, self.manifest.edge_layers)[0]
        else:
            module = client if block == "client" else server
        return self._load_into(module, block)

    def client_module(self) -> nn.Sequential:
        """The trainable client block (layers[:split]) with the bundle's weights."""
        return self._template("client")  # type: ignore[return-value]

    def server_module(self) -> nn.Sequential:
        """The trainable server block (layers[split:]) with the bundle's weights (only a
        `full` bundle has one: it never leaves the coordinator otherwise)."""
        return self._template("server")  # type: ignore[return-value]

    def edge_module(self) -> nn.Sequential:
        """A SHeRL-FL edge's middle block: server layers [:edge_layers], no classifier."""
        return self._template("edge")  # type: ignore[return-value]

    def aux_module(self) -> AuxiliaryHead:
        """The trainable auxiliary head with the bundle's weights."""
        return self._template("aux")  # type: ignore[return-value]

    def describe(self) -> dict[str, Any]:
        """Manifest as plain JSON-able data (for status output)."""
        return self.manifest.model_dump(mode="json")


def load_bundle(source: str | Path, *, extract_to: str | Path | None = None) -> Bundle:
    """Load and fully verify a bundle directory or .tar/.tar.gz; raise one-line BundleError.

    A tar is extracted into `extract_to` (which must be empty or absent) or a temporary
    folder that lives as long as the returned Bundle.
    """
    source = Path(source)
    where = f"bundle {source}"
    if source.is_dir():
        return Bundle(source, _verify_dir(source, where, allow_engines=True), source)
    if not source.exists():
        raise BundleError(f"{where}: not found")
    if not source.is_file() or not (is_tar_path(source) or tarfile.is_tarfile(source)):
        raise BundleError(f"{where}: not a directory or a .tar/.tar.gz bundle")
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if extract_to is None:
        tmp = tempfile.TemporaryDirectory(prefix="jetsplit-bundle-")
        dest = Path(tmp.name)
    else:
        dest = Path(extract_to)
        dest.mkdir(parents=True, exist_ok=True)
        if any(dest.iterdir()):
            raise BundleError(f"{where}: extraction folder {dest} is not empty")
    try:
        _extract_tar(source, dest, where)
        manifest = _verify_dir(dest, where, allow_engines=False)
    except BaseException:
        if tmp is not None:
            tmp.cleanup()
        raise
    return Bundle(dest, manifest, source, tmp)
