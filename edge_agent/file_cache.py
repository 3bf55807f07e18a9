"""The agent's content-addressed file cache: bundle files by sha256, and partial downloads.

A coordinator never sends a device a file it already holds (same sha256), and a download
cut short (link lost, agent restarted) resumes where it stopped: parts are appended to
`partial/<sha256>` in the state dir, which survives restarts. A file enters `files/` only
once its sha256 checks out, and it is hashed again every time it is used. The cache is
bounded: least recently used files go first (never those being installed).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

from jetsplit.bundle import MAX_FILE_BYTES
from jetsplit.errors import BundleError

DEFAULT_CACHE_BYTES = 2 << 30  # a few bundles of the largest zoo models
MAX_PARTIALS = 8  # downloads in progress kept at once
_SHA = re.compile(r"^[0-9a-f]{64}\Z")
_HASH_CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        chunk = fh.read(_HASH_CHUNK)
        while chunk:
            digest.update(chunk)
            chunk = fh.read(_HASH_CHUNK)
    return digest.hexdigest()


class FileCache:
    """Verified files under `root/files`, downloads in progress under `root/partial`."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.root = Path(root)
        self.files = self.root / "files"
        self.partial = self.root / "partial"
        self.max_bytes = max_bytes
        self.files.mkdir(parents=True, exist_ok=True)
        self.partial.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _check(sha: str) -> str:
        if not _SHA.match(sha):
            raise BundleError(f"bad file hash {sha[:80]!r} (expected 64 hex digits)")
        return sha

    def path(self, sha: str) -> Path:
        return self.files / self._check(sha)

    def has(self, sha: str, size: int) -> bool:
        """Whether a verified copy is here: size and sha256 are checked now, on use; a
        copy that fails is dropped (and will be downloaded again)."""
        path = self.path(sha)
        try:
            if path.stat().st_size != size or _sha256(path) != sha:
                path.unlink()
                return False
        except FileNotFoundError:
            return False
        os.utime(path)  # recently used: evicted last
        return True

    def received(self, sha: str) -> int:
        """Bytes of `sha` already downloaded (a resumed transfer starts there)."""
        try:
            return (self.partial / self._check(sha)).stat().st_size
        except FileNotFoundError:
            return 0

    def write(self, sha: str, size: int, offset: int, data: bytes,
              protect: Iterable[str] = ()) -> int:
        """Store bytes [offset, offset+len) of file `sha` (of `size` bytes); returns how
        many bytes are now held. The last part verifies the whole file and moves it into
        the cache; a mismatch drops the download (one line, the agent lives on)."""
        self._check(sha)
        if not 0 < size <= MAX_FILE_BYTES:
            raise BundleError(f"file {sha[:12]}…: size {size} outside 1..{MAX_FILE_BYTES}")
        if offset < 0 or offset + len(data) > size:
            raise BundleError(f"file {sha[:12]}…: part [{offset}, {offset + len(data)}) lies "
                              f"outside its {size} bytes")
        if self.path(sha).exists():
            return size
        part = self.partial / sha
        held = self.received(sha)
        if offset > held:
            raise BundleError(f"file {sha[:12]}…: part at byte {offset} but only {held} "
                              "received; resend from there")
        self._make_room(max(0, offset + len(data) - held), {sha, *protect})
        with open(part, "r+b" if held else "wb") as fh:
            fh.truncate(offset)
            fh.seek(offset)
            fh.write(data)
        held = offset + len(data)
        if held < size:
            return held
        if _sha256(part) != sha:
            part.unlink()
            raise BundleError(f"file {sha[:12]}…: sha256 mismatch after download; dropped")
        part.chmod(0o644)
        os.replace(part, self.path(sha))
        return size

    def _entries(self) -> list[tuple[float, int, Path]]:
        out = []
        for folder in (self.files, self.partial):
            for entry in os.scandir(folder):
                if entry.is_file(follow_symlinks=False):
                    info = entry.stat(follow_symlinks=False)
                    out.append((info.st_mtime, info.st_size, Path(entry.path)))
        return sorted(out)

    def _make_room(self, need: int, protect: Iterable[str]) -> None:
        """Evict least recently used files until `need` more bytes fit in the bound."""
        keep = set(protect)
        entries = self._entries()
        total = sum(size for _, size, _ in entries)
        partials = [p for _, _, p in entries if p.parent == self.partial and p.name not in keep]
        while len(partials) >= MAX_PARTIALS:
            victim = partials.pop(0)
            total -= victim.stat().st_size
            victim.unlink()
        for _, size, path in entries:
            if total + need <= self.max_bytes:
                return
            if path.name in keep or not path.exists():
                continue
            path.unlink()
            total -= size
        if total + need > self.max_bytes:
            raise BundleError(f"file cache full: {need} more bytes do not fit in "
                              f"{self.max_bytes} (raise the agent's cache size)")

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def link_into(self, sha: str, dest: Path) -> None:
        """Place the cached file at `dest` (a hard link where possible, else a copy)."""
        source = self.path(sha)
        try:
            os.link(source, dest)
        except OSError:
            import shutil

            shutil.copyfile(source, dest)


def missing_files(cache: FileCache, files: Iterable[tuple[str, int]]
                  ) -> dict[str, int] | None:
    """{sha256: bytes received} of the files not yet cached, or None when all are."""
    missing = {sha: cache.received(sha) for sha, size in files if not cache.has(sha, size)}
    return missing or None
