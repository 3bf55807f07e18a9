"""The set the coordinator evaluates on, and the run's class names it fixes.

A trial holds out a stratified split of the public dataset its agents partition; a field
run (`[data] own = true`) evaluates on the coordinator's own folder or manifest, whole.
Either way the images come out at the model's input shape, or the run stops here in one
line rather than on the first evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence

from jetsplit.data import Dataset, ImageDataset, load_dataset, load_dataset_split, with_classes
from jetsplit.errors import ConfigError
from jetsplit.server.run.config import DataSection


def held_out_set(data: DataSection, input_shape: Sequence[int], classes: int) -> Dataset:
    """The evaluation set `[data]` names, relabelled to `[data] classes` when given, checked
    against the model's input shape and class count."""
    options = data.image_options(data.seed)
    if data.own:
        test = load_dataset(data.dataset, options)
    else:
        test = load_dataset_split(data.dataset, data.test_fraction, data.seed, options)[1]
    if data.classes is not None:
        if not isinstance(test, ImageDataset):
            raise ConfigError(f"[data] classes names the classes of a folder: or csv: "
                              f"dataset, not of {data.dataset!r}")
        test = with_classes(test, data.classes)
    if tuple(test.input_shape) != tuple(input_shape):
        raise ConfigError(f"[data] {data.dataset}: samples come out "
                          f"{'×'.join(map(str, test.input_shape))} but [model] input_shape is "
                          f"{'×'.join(map(str, input_shape))} (set [data] image_size and "
                          "channels, or the model's input_shape)")
    if test.num_classes != classes:
        raise ConfigError(f"[data] {data.dataset}: {test.num_classes} classes but [model] "
                          f"classes is {classes}")
    return test


def run_classes(test: Dataset) -> tuple[str, ...] | None:
    """The run's class names in label order (None: an array dataset names none)."""
    return tuple(test.classes) if isinstance(test, ImageDataset) else None
