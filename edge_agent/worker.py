"""The agent's command executor: everything a device does, with no transport in sight.

The MQTT daemon and the in-process engine both hand it commands and send back what it
returns, which is what makes the two engines give bit-identical models. Training runs in
PyTorch; forward-only work (activation generation) runs the exported block in ONNX Runtime
(TensorRT execution provider where present).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from jetsplit import __version__
from jetsplit.bundle import (
    AGENT_ACCEPTS,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    WEIGHT_FILES,
    Bundle,
    check_code,
    load_bundle,
    parse_manifest,
)
from jetsplit.data import Dataset, with_classes
from jetsplit.data.feed import BatchFeed
from jetsplit.data.feed import BatchSampler as BatchSampler  # where tests draw batches
from jetsplit.edge_agent.attacks import Attack
from jetsplit.edge_agent.edge import EdgeRole, EdgeTier
from jetsplit.edge_agent.emulation import DeviceClock
from jetsplit.edge_agent.file_cache import FileCache, missing_files
from jetsplit.edge_agent.peers import PeerInbox, PeerSend
from jetsplit.edge_agent.result import Result, Tensors
from jetsplit.errors import BundleError, ConfigError, JetsplitError
from jetsplit.models import ZOO_VERSION
from jetsplit.models.split import eval_mode
from jetsplit.models.weights import from_arrays, load_strict, to_arrays
from jetsplit.optimizers import build_optimizer
from jetsplit.protocol import (
    BackwardArgs,
    BundleArgs,
    BundlePartArgs,
    EvalArgs,
    ForwardArgs,
    GenerateArgs,
    Kind,
    OptimizerArgs,
    ProtocolError,
    TrainArgs,
    WeightsArgs,
    parse_args,
)
from jetsplit.transport.topics import COORDINATOR
from jetsplit.wire import Message, MessageType, accounted_bound

log = logging.getLogger("jetsplit.agent")

MAX_PENDING_FORWARDS = 16  # activations kept for a backward that may never come


def warm_up(block: nn.Module, batch_shape: Tuple[int, ...], device: torch.device,
            opt: OptimizerArgs) -> None:
    """One throwaway training pass through a copy of the block at a new batch shape, so the
    runtime's first-call costs (autograd engine, per-shape kernels, allocator) are paid as
    setup and not stretched into an emulated round. Weights, BatchNorm statistics and every
    RNG stay untouched."""
    scratch = copy.deepcopy(block).train()
    with torch.random.fork_rng(devices=[]):
        out = scratch(torch.zeros(batch_shape, device=device))
        out.float().sum().backward()
        make_optimizer([q for q in scratch.parameters() if q.requires_grad], opt).step()


def make_optimizer(params: List[nn.Parameter], opt: OptimizerArgs) -> torch.optim.Optimizer:
    """The optimiser the coordinator asked for (`OptimizerArgs`: SGD or Adam)."""
    return build_optimizer(params, opt.name, opt.lr, opt.momentum, opt.weight_decay)


class AgentWorker(EdgeRole):
    """One device's state: local data, the installed bundle, trainable blocks, optimizers;
    with role `edge`, SHeRL-FL's edge block (see `edge_agent.edge`)."""

    def __init__(
        self,
        agent_id: str,
        data: Dataset,
        *,
        role: str = "client",
        seed: int = 0,
        state_dir: str | Path | None = None,
        device: str = "cpu",
        profile: dict[str, Any] | None = None,
        bundle_cache: dict[str, Bundle] | None = None,
        clock: DeviceClock | None = None,
        threads: int = 0,
        attack: Attack | None = None,
        loader_workers: int = 0,
    ) -> None:
        if len(data) == 0 and role != "edge":  # an edge trains on its clients' activations
            raise JetsplitError(f"agent {agent_id}: its dataset is empty")
        # Tests and benchmarks only (edge_agent.attacks): how this agent misbehaves.
        self.attack = attack or Attack()
        if self.attack.kind is not None and role == "edge":
            raise JetsplitError(f"agent {agent_id}: attacks are for client agents, not edges")
        data = self.attack.poison(data)
        self.agent_id, self.data, self.role, self.seed = agent_id, data, role, seed
        self.device = torch.device(device)
        # Intra-op torch threads its compute runs with (0: the process's). An agent process
        # sets it once at start; the in-process engine applies it around each command.
        self.threads = threads
        self.profile = profile
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"jetsplit-{agent_id}-")
            state_dir = self._tmp.name
        self.state_dir = Path(state_dir)
        self._files: FileCache | None = None  # content-addressed, made on first bundle
        # Training batches: arrays indexed in place, images decoded per batch (by
        # `loader_workers` processes ahead of the step, or here with 0).
        self.feed = BatchFeed(data, seed, loader_workers)
        self.sampler = self.feed.sampler
        # Simulations share verified bundles between in-process agents (one copy in memory).
        self.bundle_cache = bundle_cache
        self.bundle: Bundle | None = None
        self.bundle_sha: str | None = None
        self._modules: dict[str, nn.Module] = {}
        self.optimizer_args = OptimizerArgs()
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._warmed: set[tuple[int, ...]] = set()  # batch shapes warmed up (emulation only)
        self._pending: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._sent_to: dict[tuple[int, int], str] = {}  # forward → the edge it went to
        self.peers = PeerInbox()  # direct messages from peers (SHeRL-FL)
        self.run = "-"  # the run of the command being handled (peer messages carry it)
        self._onnx_current = False
        self._onnx_block: Any = None
        self.edge_tier: EdgeTier | None = None
        self.commands_done = 0
        self.clock = clock or DeviceClock()  # time books; emulates a device in trials
        # What `jetsplit fleet` shows: the last training round and command, the last error.
        self.last_round: int | None = None
        self.last_command: str | None = None
        self.last_error: str | None = None
        self.log_tail: Any = None  # a LogTail when run by the daemon
        self.shutdown_requested = False

    # ------------------------------------------------------------------ identity

    def registration(self) -> dict[str, Any]:
        """Who this agent is and what it can do (sent on connect and on DISCOVER)."""
        from jetsplit.edge_agent.backends import detect_backends

        return {
            "agent": self.agent_id, "role": self.role, "version": __version__,
            "zoo_version": ZOO_VERSION, "profile": self.profile,
            "dataset": self.attack.claim(self.data.summary()),
            "backends": detect_backends(light=True), "device": str(self.device),
            "bundle": self.bundle_sha,
        }

    def accepts(self, sender: str, kind: str) -> Optional[int]:
        """The bound of a message over the wire's cap this agent accounted for: weights
        from the coordinator, as large as the installed manifest's weight files declare
        (whatever the model's size); None for everything else, which keeps the cap."""
        if sender != COORDINATOR or kind != Kind.SET_WEIGHTS.value or self.bundle is None:
            return None
        files = self.bundle.manifest.files
        return accounted_bound(sum(files[name].size for name in WEIGHT_FILES.values()
                                   if name in files))

    # ------------------------------------------------------------------ blocks

    def _block(self, name: str) -> nn.Module | None:
        """The client, aux or server block, built from the bundle on first use only: an
        agent that never trains the full model never holds the server block."""
        if self.bundle is None:
            return None
        if name not in self._modules:
            if (name == "aux" and not self.bundle.has_aux) or \
                    (name != "aux" and not self.bundle.has_block(name)):
                return None  # a role-true bundle ships only the blocks its role runs
            build = {"client": self.bundle.client_module, "aux": self.bundle.aux_module,
                     "server": self.bundle.server_module}[name]
            with self.clock.setup():
                self._modules[name] = build().to(self.device)
            self._warmed.clear()
            if self.attack.wants_reference:  # an attacker's reference: what it was given
                self.attack.received(to_arrays(self._modules[name], name))
        return self._modules[name]

    @property
    def holds_blocks(self) -> bool:
        """Whether any block is in memory (a simulation reports how many agents do)."""
        return bool(self._modules)

    @property
    def client(self) -> nn.Sequential | None:
        return self._block("client")  # type: ignore[return-value]

    @property
    def aux(self) -> nn.Module | None:
        return self._block("aux")

    @property
    def server(self) -> nn.Sequential | None:
        return self._block("server")  # type: ignore[return-value]

    # ------------------------------------------------------------------ dispatch

    def handle(self, kind: str, round_: int, step: int, meta: dict[str, Any],
               tensors: Tensors, run: str = "-") -> Result:
        """Execute one command; user-caused problems raise JetsplitError (→ ERROR reply)."""
        args = parse_args(kind, meta)
        self.run = run
        handler = getattr(self, f"_do_{kind}")
        if kind not in (Kind.STATUS.value, Kind.SHUTDOWN.value):
            self.last_command = kind
            self.last_round = round_ if self.last_round is None else max(self.last_round,
                                                                          round_)
            self.clock.enter_round(round_)  # a trace's conditions for this round
        with self.clock.compute():
            result: Result = handler(args, round_, step, tensors)
        self.commands_done += 1
        return result

    def _installed(self) -> Bundle:
        if self.bundle is None:
            raise ProtocolError(f"agent {self.agent_id}: no bundle installed yet")
        return self.bundle

    def _require_bundle(self) -> Bundle:
        self._installed()
        assert self.bundle is not None
        if self.client is None:
            raise ProtocolError(f"agent {self.agent_id}: its {self.bundle.role} bundle has no "
                                "client block")
        return self.bundle

    def _optimizer(self, target: str) -> torch.optim.Optimizer:
        if target not in self._optimizers:
            assert self.client is not None
            params = list(self.client.parameters())
            if target == "aux":
                if self.aux is None:
                    raise ProtocolError("this bundle has no auxiliary head")
                params += list(self.aux.parameters())
            elif target == "full":
                assert self.server is not None
                params += list(self.server.parameters())
            self._optimizers[target] = make_optimizer(params, self.optimizer_args)
        return self._optimizers[target]

    def _batch(self, size: int, round_: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.feed.next(size, round_)
        return torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)

    def _client_changed(self) -> None:
        self._onnx_current = False
        self._onnx_block = None

    # ------------------------------------------------------------------ commands

    @property
    def files(self) -> FileCache:
        """The content-addressed cache of bundle files in the state dir."""
        if self._files is None:
            self._files = FileCache(self.state_dir / "cache")
        return self._files

    def _do_bundle(self, args: BundleArgs, round_: int, step: int, tensors: Tensors) -> Result:
        """A bundle offer: refuse a role this agent does not run (or a manifest naming a
        block the role does not need); install from the file cache when every file is
        there, else answer which files are missing and how many of their bytes we hold."""
        raw = tensors.get("manifest")
        if raw is None or raw.dtype != np.uint8 or raw.ndim != 1 \
                or not 0 < raw.nbytes <= MAX_MANIFEST_BYTES:
            raise ProtocolError(f"bundle command needs a 1-D uint8 tensor 'manifest' of "
                                f"1..{MAX_MANIFEST_BYTES} bytes")
        data = raw.tobytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != args.sha256:
            raise BundleError(f"bundle transfer corrupted: manifest sha256 {digest[:12]}… "
                              f"!= announced {args.sha256[:12]}…")
        manifest = parse_manifest(data, f"bundle {digest[:12]}")
        check_code(manifest, f"bundle {digest[:12]}")  # the model code installed here
        accepted = AGENT_ACCEPTS.get(self.role, ())
        if manifest.role != args.role or manifest.role not in accepted:
            raise BundleError(f"bundle {digest[:12]}: refused: a {manifest.role} bundle for an "
                              f"agent with role {self.role} (it runs only "
                              f"{' or '.join(accepted)} bundles)")
        self._adopt_classes(manifest.classes, digest)
        started = time.perf_counter()
        bundle = (self.bundle_cache or {}).get(digest)
        if bundle is None:
            wanted = [(entry.sha256, entry.size) for entry in manifest.files.values()]
            missing = missing_files(self.files, wanted)
            if missing is not None:
                return Result(meta={"installed": False, "missing": missing})
            bundle = self._install(data, digest, manifest.files)
        if self.bundle_cache is not None:
            self.bundle_cache[digest] = bundle
        self.bundle, self.bundle_sha = bundle, digest
        self._modules.clear()
        self.edge_tier = None
        self.optimizer_args = args.optimizer
        self._optimizers.clear()
        self._forget_forwards()
        self._onnx_current, self._onnx_block = True, None
        return Result(meta={"installed": True, "model": bundle.spec.name, "split": bundle.split,
                            "role": bundle.role, "sha256": digest,
                            "verify_s": round(time.perf_counter() - started, 3)})

    def _adopt_classes(self, run: Optional[Sequence[str]], digest: str) -> None:
        """Map this device's own class names to the run's (the bundle's list, in label
        order): a device may lack some of the run's classes, not have one it lacks."""
        own = getattr(self.data, "classes", None)
        if run is None or own is None or tuple(own) == tuple(run):
            return
        try:
            self.data = with_classes(self.data, run)
        except ConfigError as exc:
            raise BundleError(f"bundle {digest[:12]}: refused: {exc}") from None
        self.feed.close()
        self.feed = BatchFeed(self.data, self.feed.seed, self.feed.workers)
        self.sampler = self.feed.sampler

    def _do_trained_bundle(self, args: BundleArgs, round_: int, step: int, tensors: Tensors
                           ) -> Result:
        """A bundle with trained weights (Ampere's phase 2): installed like any bundle."""
        return self._do_bundle(args, round_, step, tensors)

    def _do_bundle_part(self, args: BundlePartArgs, round_: int, step: int, tensors: Tensors
                        ) -> Result:
        """Some bytes of one bundle file, appended to its download in the cache."""
        raw = tensors.get("data")
        if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
            raise ProtocolError("bundle_part needs a 1-D uint8 tensor 'data'")
        held = self.files.write(args.sha256, args.size, args.offset, memoryview(raw))
        return Result(meta={"received": held})

    def _do_trained_bundle_part(self, args: BundlePartArgs, round_: int, step: int,
                                tensors: Tensors) -> Result:
        return self._do_bundle_part(args, round_, step, tensors)

    def _install(self, manifest: bytes, digest: str, files: Any) -> Bundle:
        """Assemble the bundle folder from the cache and verify it fully (hashes, versions,
        names); earlier bundle folders go (their files stay in the cache)."""
        bundles = self.state_dir / "bundles"
        root = bundles / digest
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        (root / MANIFEST_NAME).write_bytes(manifest)
        for name, entry in files.items():
            self.files.link_into(entry.sha256, root / name)
        bundle = load_bundle(root)
        for entry in os.scandir(bundles):
            if entry.name != digest:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
        return bundle

    def _do_release(self, args: Any, round_: int, step: int, tensors: Tensors) -> Result:
        """Drop blocks, optimizers and pending activations until the next command needs
        them (the coordinator then installs the weights it wants with set_weights)."""
        self._release_blocks()
        return Result()

    def _release_blocks(self) -> None:
        self._modules.clear()
        self.edge_tier = None
        self._optimizers.clear()
        self._forget_forwards()
        self._client_changed()

    def _do_forward(self, args: ForwardArgs, round_: int, step: int, tensors: Tensors) -> Result:
        self._require_bundle()
        assert self.client is not None
        x, y = self._batch(args.batch, round_)
        if self.clock.emulating and tuple(x.shape) not in self._warmed:
            with self.clock.setup():
                warm_up(self.client, tuple(x.shape), self.device, self.optimizer_args)
            self._warmed.add(tuple(x.shape))
        self.client.train()
        activations = self.client(x)
        self._pending[(round_, step)] = activations
        while len(self._pending) > MAX_PENDING_FORWARDS:
            self._sent_to.pop(self._pending.popitem(last=False)[0], None)
        smashed = {"activations": self.attack.activations(activations.detach().cpu().numpy()),
                   "labels": y.cpu().numpy()}
        if args.edge is None:
            return Result(meta={"samples": int(len(y))}, tensors=smashed, codec=args.codec,
                          compression=args.compression)
        # SHeRL-FL: straight to the edge; only its gradient may come back for this step.
        self._sent_to[(round_, step)] = args.edge
        self.peers.expect(Kind.GRADIENT.value, [args.edge], self.run, round_, step)
        return Result(meta={"samples": int(len(y))}, codec=args.codec,
                      compression=args.compression,
                      peers=[PeerSend(args.edge, Kind.SMASHED.value, smashed)])

    def _forget_forwards(self) -> None:
        """Drop pending forwards and what peers may still send for them."""
        self._pending.clear()
        self._sent_to.clear()
        self.peers.clear()

    def _direct_gradient(self, key: tuple[int, int], wait_s: float) -> np.ndarray:
        """The gradient the forward's edge sent for it (waiting up to `wait_s`), checked:
        it comes from a peer, not from the coordinator."""
        edge = self._sent_to.pop(key, None)
        if edge is None:
            raise ProtocolError(f"backward for round {key[0]} step {key[1]}: that forward "
                                f"went to no edge")
        got = self.peers.take(Kind.GRADIENT.value, [edge], self.run, key[0], key[1], wait_s)
        if edge not in got:
            raise ProtocolError(f"backward for round {key[0]} step {key[1]}: no gradient "
                                f"from edge {edge} within {wait_s:g}s")
        message, wire_bytes = got[edge]
        self.clock.transfer(wire_bytes, "down")
        grad = message.tensors.get("grad")
        if grad is None or grad.dtype != np.float32 or not np.isfinite(grad).all():
            raise ProtocolError(f"backward: edge {edge}'s gradient is not finite float32")
        return grad

    def _do_backward(self, args: BackwardArgs, round_: int, step: int, tensors: Tensors
                     ) -> Result:
        self._require_bundle()
        key = (round_, step if args.forward_step is None else args.forward_step)
        activations = self._pending.pop(key, None)
        if activations is None:
            raise ProtocolError(f"backward for round {key[0]} step {key[1]}: no such forward")
        grad = self._direct_gradient(key, args.wait_s) if args.direct else tensors.get("grad")
        if grad is None or tuple(grad.shape) != tuple(activations.shape):
            got = None if grad is None else list(grad.shape)
            raise ProtocolError(f"backward needs 'grad' of shape {list(activations.shape)}, "
                                f"got {got}")
        optimizer = self._optimizer("client")
        optimizer.zero_grad(set_to_none=True)
        activations.backward(torch.from_numpy(np.array(grad, dtype=np.float32)).to(self.device))
        optimizer.step()
        self._client_changed()
        return Result()

    def _head(self, target: str) -> nn.Module:
        """What sits on the client block for local work: the aux head or the server block."""
        self._require_bundle()
        head = self.aux if target == "aux" else self.server
        if head is None:
            what = "auxiliary head" if target == "aux" else "server block (not a full bundle)"
            raise ProtocolError(f"this bundle has no {what}")
        return head

    def _do_train(self, args: TrainArgs, round_: int, step: int, tensors: Tensors) -> Result:
        head = self._head(args.target)
        assert self.client is not None
        optimizer = self._optimizer(args.target)
        if args.lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = args.lr
        self.client.train()
        head.train()
        total, seen = 0.0, 0
        for _ in range(args.steps):
            x, y = self._batch(args.batch, round_)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(head(self.client(x)), y)
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(y)
            seen += len(y)
        # the last step's gradients serve nothing more (the next train sets them to None
        # before its first step): freed now, not held beside the weights until then
        optimizer.zero_grad(set_to_none=True)
        self._client_changed()
        if not math.isfinite(total):  # a NaN cannot travel in a reply's meta anyway
            raise JetsplitError(f"local training diverged: loss {total / seen} over "
                                f"{args.steps} steps at lr {optimizer.param_groups[0]['lr']:g}")
        return Result(meta={"loss": total / seen, "samples": seen})

    def _do_eval(self, args: EvalArgs, round_: int, step: int, tensors: Tensors) -> Result:
        head = self._head(args.target)
        assert self.client is not None
        correct, loss_sum = 0, 0.0
        with eval_mode(self.client), eval_mode(head), torch.no_grad():
            for start in range(0, len(self.data), args.batch):
                x = torch.from_numpy(self.data.x[start:start + args.batch]).to(self.device)
                y = torch.from_numpy(self.data.y[start:start + args.batch]).to(self.device)
                logits = head(self.client(x))
                loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(1) == y).sum())
        n = len(self.data)
        return Result(meta={"correct": correct, "total": n, "accuracy": correct / n,
                            "loss": loss_sum / n})

    def _blocks(self) -> dict[str, nn.Module | None]:
        return {"client": self.client, "aux": self.aux, "server": self.server}

    def _do_get_weights(self, args: WeightsArgs, round_: int, step: int, tensors: Tensors
                        ) -> Result:
        self._installed()
        out: Tensors = {}
        for name in args.blocks:
            module = self._edge().block if name == "edge" else self._blocks()[name]
            if module is None:
                raise ProtocolError(f"this bundle has no {name} block")
            out.update(to_arrays(module, name, copy=not args.release))  # released: no copy
        if args.release:
            self._release_blocks()
        return Result(meta={"samples": len(self.data)}, tensors=self.attack.upload(out))

    def _do_set_weights(self, args: Any, round_: int, step: int, tensors: Tensors) -> Result:
        self._installed()
        blocks = sorted({name.split("/", 1)[0] for name in tensors})
        unknown = [b for b in blocks if b not in self._blocks()]
        if unknown or not blocks:
            raise ProtocolError(f"set_weights: tensors must be named client/…, aux/… or "
                                f"server/… (got {unknown[:1] or 'none'})")
        for name in blocks:
            module = self._blocks()[name]
            if module is None:
                raise ProtocolError(f"this bundle has no {name} block")
            load_strict(module, {k: v.to(self.device) for k, v in
                                 from_arrays(tensors, name).items()},
                        f"set_weights {name}", ProtocolError)
        self.attack.received(tensors)
        if "client" in blocks:
            self._client_changed()
        self._pending.clear()
        self._sent_to.clear()
        return Result(meta={"blocks": blocks})

    def _do_generate(self, args: GenerateArgs, round_: int, step: int, tensors: Tensors
                     ) -> Result:
        bundle = self._require_bundle()
        assert self.client is not None
        started = time.perf_counter()
        total = len(self.data)
        if args.offset >= total:
            raise ProtocolError(f"generate offset {args.offset} is past the {total} samples")
        stop = total if args.limit is None else min(total, args.offset + args.limit)
        chunks = [(start, min(start + args.batch, stop))
                  for start in range(args.offset, stop, args.batch)]
        if self._onnx_current:
            if self._onnx_block is None:
                from jetsplit.runtimes.onnx_runtime import OnnxBlock

                self._onnx_block = OnnxBlock(bundle.client_onnx)
            parts = [self._onnx_block.run_batched(self.data.x[a:b], args.batch)
                     for a, b in chunks]  # images are decoded chunk by chunk
            backend = self._onnx_block.providers[0]
        elif args.allow_torch:
            parts = []
            with eval_mode(self.client), torch.no_grad():
                for a, b in chunks:
                    x = torch.from_numpy(self.data.x[a:b]).to(self.device)
                    parts.append(self.client(x).cpu().numpy())
            backend = "torch"
        else:
            raise ProtocolError("client.onnx no longer matches the trained client block: "
                                "send a fresh bundle (or allow_torch)")
        activations = np.concatenate(parts)
        rows = slice(args.offset, stop)
        return Result(meta={"backend": backend, "samples": len(activations),
                            "offset": args.offset,
                            "total": total, "seconds": round(time.perf_counter() - started, 4)},
                      tensors={"activations": self.attack.activations(
                          np.ascontiguousarray(activations, np.float32)),
                               "labels": self.data.y[rows]},
                      codec=args.codec, compression=args.compression)

    def _do_status(self, args: Any, round_: int, step: int, tensors: Tensors) -> Result:
        from jetsplit.edge_agent.telemetry import sample  # psutil is an agent extra; import on use

        device = self.profile.get("device") if isinstance(self.profile, dict) else None
        profile = device.get("name") if isinstance(device, dict) else None
        meta = {"bundle": self.bundle_sha, "commands": self.commands_done,
                "pending_forwards": len(self._pending), "telemetry": sample(),
                "time": self.clock.snapshot(), "role": self.role, "profile": profile,
                "split": None if self.bundle is None else self.bundle.split,
                "last_round": self.last_round, "last_command": self.last_command,
                "last_error": self.last_error, "data": self.data_report()}
        if args.logs and self.log_tail is not None:
            meta["logs"] = self.log_tail.lines(args.logs)
        return Result(meta=meta)

    def data_report(self) -> dict[str, Any]:
        """The local data's health: images skipped as undecodable (arrays skip none)."""
        skips = getattr(self.data, "skips", None)
        return {"skipped": 0, "skipped_examples": []} if skips is None else skips.report()

    def _do_shutdown(self, args: Any, round_: int, step: int, tensors: Tensors) -> Result:
        self.shutdown_requested = True  # the daemon exits after sending this reply
        return Result(meta={"stopping": True})


class Response(NamedTuple):
    """One command's REPLY (or ERROR) with its codec and compression, and the direct
    messages to peers (recipient, PEER message) its caller delivers before the reply."""

    reply: Message
    codec: str
    compression: str
    peers: List[Tuple[str, Message]]


def respond(worker: AgentWorker, command: Message, next_seq: Callable[[], int]) -> Response:
    """Run one COMMAND message. Both engines call this, so agents behave the same behind
    either; `next_seq` numbers the reply and the peer messages."""
    re = command.meta.get("cmd", command.seq)  # a retransmitted command keeps its id
    base = {"run": command.run, "sender": worker.agent_id, "round": command.round,
            "step": command.step}
    try:
        result = worker.handle(command.kind, command.round, command.step, dict(command.meta),
                               command.tensors, run=command.run)
    except Exception as exc:  # noqa: BLE001 - any failure becomes an ERROR reply; we live on
        text = str(exc) if isinstance(exc, JetsplitError) else f"{type(exc).__name__}: {exc}"
        text = " ".join(text.split())[:2000]
        worker.last_error = text
        log.warning("command %s (round %d step %d) failed: %s", command.kind, command.round,
                    command.step, text)
        return Response(Message(MessageType.ERROR, meta={"re": re, "error": text},
                                seq=next_seq(), kind=command.kind, **base),
                        "fp32", "none", [])
    peers = [(p.to, Message(MessageType.PEER, seq=next_seq(), kind=p.kind, tensors=p.tensors,
                            **base)) for p in result.peers]
    return Response(Message(MessageType.REPLY, meta={"re": re, **result.meta},
                            tensors=result.tensors, seq=next_seq(), kind=command.kind, **base),
                    result.codec, result.compression, peers)
