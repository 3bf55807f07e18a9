"""CUDA is first-class: the same run on the GPU matches the CPU, method by method.

Skipped where torch sees no CUDA device (CI has none); a machine with a GPU runs it
(`make cuda-check`). TF32 is turned off for the comparison, so the two devices differ only
by float summation order: the per-round training losses agree to 1e-3 relative and the
final accuracies to one test sample in a hundred. bf16 autocast on the server block's
steps (`[server] autocast`) is checked to train, not to match: its rounding is the point.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.server.settings import Settings
from jetsplit.server.simulate import sherl_topology, simulate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA")

MODEL, SPLIT, AGENTS, SEED = "vgg11", 2, 3, 0
RUN = {"rounds": 3, "local_steps": 4, "batch": 48, "lr": 0.05}
#: One of each kind of server-side work: per-client copies, one shared block, concatenated
#: activations, the selection maths, phase-2 store training, three tiers, no split at all.
METHODS = ("splitfed-v1", "psl", "scala", "gapsl", "ampere", "sherl", "fedavg")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    report = write_bundle(ModelSpec(MODEL, (1, 8, 8), 10), SPLIT,
                          tmp_path_factory.mktemp("cuda") / "bundle", aux_ratio=0.5,
                          seed=SEED, tar=True)
    assert report.tar_path is not None
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield report.tar_path
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _run(algorithm: str, bundle: Path, out: Path, **server: str) -> list[dict]:
    edges = sherl_topology(algorithm, 1 if algorithm == "sherl" else 0, AGENTS)
    settings = Settings(algorithm=algorithm, seed=SEED, edges=edges, **RUN, **server)
    simulate(settings, model=MODEL, split=SPLIT, dataset="digits", clients=AGENTS,
             partition_scheme="dirichlet:0.5", out_dir=out, bundle=bundle, checkpoint=False)
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


@pytest.mark.parametrize("algorithm", METHODS)
def test_cuda_run_matches_cpu(algorithm: str, bundle: Path, tmp_path: Path) -> None:
    cpu = _run(algorithm, bundle, tmp_path / "cpu", device="cpu")
    gpu = _run(algorithm, bundle, tmp_path / "cuda", device="cuda")
    assert len(cpu) == len(gpu) == RUN["rounds"]
    for a, b in zip(cpu, gpu, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-3), (cpu, gpu)
        assert abs(b["accuracy"] - a["accuracy"]) <= 0.01, (cpu, gpu)


@pytest.mark.parametrize("algorithm", ("scala", "psl"))
def test_bf16_autocast_trains_on_cuda(algorithm: str, bundle: Path, tmp_path: Path) -> None:
    rows = _run(algorithm, bundle, tmp_path, device="cuda", autocast="bf16")
    losses = [r["train_loss"] for r in rows]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
