"""Model sources as strings, and the identity of the code behind them, without importing torch.

A model source is a zoo name (`resnet18`), a factory in code the operator installed
(`mypkg.nets:make_net`, a callable returning an `nn.Module`), or a library model
(`torchvision:resnet18`, `timm:resnet18`). The code behind a source is identified without
executing it: a factory by the sha256 of every Python file of its top-level package (found on
`sys.path`, never imported), a library model by the library's installed version. Bundles carry
that identity, and a device whose installed code differs refuses the bundle; the cost model's
cache keys carry it, so an edited network is counted again.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import machinery, metadata
from pathlib import Path
from typing import Dict, List, Optional

from jetsplit.errors import ModelError

LIBRARIES = ("torchvision", "timm")
MAX_SOURCE_CHARS = 200
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_FACTORY = re.compile(rf"^(?P<module>{_DOTTED}):(?P<attr>{_DOTTED})$")
_LIBRARY_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")


@dataclass(frozen=True)
class Source:
    """A parsed source: `kind` is zoo, factory, torchvision or timm."""

    kind: str
    text: str
    module: str = ""  # factory: the module to import; library: the library
    attr: str = ""  # factory: the callable in it; library: the model's name


def parse_source(text: str) -> Source:
    """Parse (never import) a source string; one-line ModelError on bad syntax."""
    if not isinstance(text, str) or not text or len(text) > MAX_SOURCE_CHARS:
        raise ModelError(f"model source must be 1..{MAX_SOURCE_CHARS} characters")
    if ":" not in text:
        return Source("zoo", text)
    head, _, tail = text.partition(":")
    if head in LIBRARIES:
        if not _LIBRARY_NAME.match(tail):
            raise ModelError(f"model source {text!r}: expected {head}:NAME, e.g. "
                             f"{head}:resnet18")
        return Source(head, text, head, tail)
    match = _FACTORY.match(text)
    if match is None:
        raise ModelError(f"model source {text!r}: expected a zoo name, module.path:factory, "
                         "torchvision:NAME or timm:NAME")
    return Source("factory", text, match["module"], match["attr"])


def is_zoo(text: str) -> bool:
    return ":" not in text


def _package_files(top: str) -> List[Path]:
    """The Python files of top-level module/package `top`, located on sys.path without
    importing it (a package's parent `__init__` would run on a plain find_spec)."""
    spec = machinery.PathFinder.find_spec(top)
    if spec is None:
        raise ModelError(f"model code {top!r} is not installed here (not found on the Python "
                         "path); install the model package, or add its folder to PYTHONPATH")
    if spec.submodule_search_locations:
        files: List[Path] = []
        for folder in sorted(spec.submodule_search_locations):
            files += [p for p in Path(folder).rglob("*.py") if "__pycache__" not in p.parts]
        return sorted(files)
    if spec.origin is None or not spec.origin.endswith(".py"):
        raise ModelError(f"model code {top!r} has no Python source here ({spec.origin}); "
                         "jetsplit hashes the source the operator installed")
    return [Path(spec.origin)]


def code_sha256(module: str) -> str:
    """sha256 over every Python file of `module`'s top-level package (relative paths and
    contents), so any edit to the installed code changes it."""
    top = module.split(".")[0]
    files = _package_files(top)
    roots = [p.parent for p in files]
    base = Path(*Path(roots[0]).parts[: min(len(r.parts) for r in roots)]) if roots else Path()
    digest = hashlib.sha256()
    for path in files:
        try:
            rel = path.relative_to(base).as_posix()
        except ValueError:
            rel = path.name
        digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def library_version(library: str) -> str:
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        raise ModelError(f"{library} is not installed here; install it (pip install "
                         f"{library}) or choose a zoo model or a module:factory") from None


def code_identity(text: str) -> Optional[Dict[str, str]]:
    """What a bundle records about the code behind `text`: None for a zoo model (its zoo
    version covers it), else the module and its sha256, or the library and its version."""
    source = parse_source(text)
    if source.kind == "zoo":
        return None
    if source.kind == "factory":
        return {"module": source.module, "sha256": code_sha256(source.module)}
    return {"module": source.module, "version": library_version(source.module)}


def check_identity(text: str, recorded: Optional[Dict[str, str]], where: str) -> None:
    """Refuse, in one line naming both, when the code installed here is not the code that
    built `recorded`."""
    here = code_identity(text)
    if here == recorded:
        return
    if here is None or recorded is None:
        raise ModelError(f"{where}: model {text!r} needs a code record "
                         f"{'(absent)' if recorded is None else '(a zoo model has none)'}")
    if "sha256" in here:
        raise ModelError(f"{where}: refused: model code {here['module']} here has sha256 "
                         f"{here['sha256'][:16]}…, the bundle was built with "
                         f"{str(recorded.get('sha256', '?'))[:16]}…; install the same version "
                         "of the model package on this device")
    raise ModelError(f"{where}: refused: {here['module']} {here['version']} is installed here, "
                     f"the bundle was built with {here['module']} {recorded.get('version', '?')}")


def source_fingerprint(text: str) -> str:
    """A short digest of the source and its code identity, for cache keys."""
    identity = code_identity(text)
    blob = text if identity is None else f"{text}|{sorted(identity.items())}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
