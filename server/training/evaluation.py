"""Test-set evaluation on the coordinator: the held-out split never leaves it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from jetsplit.data import Dataset
from jetsplit.models.split import eval_mode


@dataclass
class Evaluation:
    """Top-1 and balanced accuracy (mean per-class recall), per-class accuracy, mean loss."""

    accuracy: float
    balanced_accuracy: float
    per_class: list[float]
    loss: float

    def as_dict(self) -> dict[str, object]:
        return {"accuracy": self.accuracy, "balanced_accuracy": self.balanced_accuracy,
                "per_class_accuracy": self.per_class, "test_loss": self.loss}


def evaluate(model: nn.Module, test: Dataset, batch: int = 512) -> Evaluation:
    """Accuracy of `model` (client∘server or the full model) on the test split, computed on
    the device the model's weights are on."""
    device = next(model.parameters()).device
    correct = np.zeros(test.num_classes, np.int64)
    count = np.bincount(test.y, minlength=test.num_classes)
    loss_sum = 0.0
    with eval_mode(model), torch.no_grad():
        for start in range(0, len(test), batch):
            x = torch.from_numpy(test.x[start:start + batch]).to(device)
            y = torch.from_numpy(test.y[start:start + batch]).to(device)
            logits = model(x)
            loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
            hits = (logits.argmax(1) == y).cpu().numpy()
            np.add.at(correct, test.y[start:start + batch][hits], 1)
    present = count > 0
    per_class = np.where(present, correct / np.maximum(count, 1), np.nan)
    return Evaluation(float(correct.sum() / len(test)),
                      float(np.nanmean(per_class[present])) if present.any() else 0.0,
                      [None if np.isnan(v) else float(v) for v in per_class],  # type: ignore[misc]
                      loss_sum / len(test))


def summarize(evaluations: list[Evaluation]) -> dict[str, object]:
    """Several models (PSL/GAPSL: each client's block + the shared server block): the mean,
    and the spread across clients, of each metric."""
    acc = np.array([e.accuracy for e in evaluations])
    bal = np.array([e.balanced_accuracy for e in evaluations])
    per_class = np.array([[np.nan if v is None else v for v in e.per_class]
                          for e in evaluations], dtype=float)
    return {"accuracy": float(acc.mean()), "accuracy_std": float(acc.std()),
            "accuracy_min": float(acc.min()), "accuracy_max": float(acc.max()),
            "balanced_accuracy": float(bal.mean()), "balanced_accuracy_std": float(bal.std()),
            "per_class_accuracy": [None if np.isnan(v) else float(v)
                                   for v in np.nanmean(per_class, axis=0)]
            if not np.isnan(per_class).all() else [],
            "test_loss": float(np.mean([e.loss for e in evaluations]))}
