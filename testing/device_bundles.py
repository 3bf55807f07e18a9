"""A client bundle offered to an agent worker as the coordinator does it: the written
bundle's manifest narrowed to the files a client runs, every file put in the agent's cache
(as `bundle_part`s would), then the `bundle` command. For the device-side tests (they also
run on the device floor: Python 3.8/3.9, torch 1.13)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict

import numpy as np

from jetsplit.bundle import MANIFEST_NAME, role_files


def client_manifest(bundle_dir: Path, **changes: Any) -> bytes:
    """The role-true manifest a client receives, with `changes` laid over it."""
    manifest = json.loads((bundle_dir / MANIFEST_NAME).read_bytes())
    keep = role_files("client", aux=True)
    manifest.update(role="client", files={k: v for k, v in manifest["files"].items()
                                          if k in keep}, **changes)
    return json.dumps(manifest, sort_keys=True).encode()


def offer(worker: Any, bundle_dir: Path, lr: float = 0.01, **changes: Any) -> Dict[str, Any]:
    """Cache every file the manifest names, then offer it; the reply's meta."""
    raw = client_manifest(bundle_dir, **changes)
    for name, entry in json.loads(raw)["files"].items():
        blob = (bundle_dir / name).read_bytes()
        assert worker.files.write(entry["sha256"], len(blob), 0, blob) == len(blob)
    meta = {"sha256": hashlib.sha256(raw).hexdigest(), "role": "client",
            "optimizer": {"name": "sgd", "lr": lr}}
    return worker.handle("bundle", 0, 0, meta, {"manifest": np.frombuffer(raw, np.uint8)}).meta
