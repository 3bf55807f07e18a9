"""Offline datasets (arrays in memory, images decoded per batch) and client partitioners
(IID, quantity / Dirichlet / Ampere label skew)."""

from __future__ import annotations

from jetsplit.data.datasets import (
    CIFAR10_CLASSES,
    DATASET_SPECS,
    MAX_NPZ_BYTES,
    ArrayDataset,
    Dataset,
    load_cifar10_dir,
    load_dataset,
    load_dataset_split,
    load_digits,
    load_image_folder,
    load_mnist,
    load_npz,
    train_test_split,
)
from jetsplit.data.image_sets import (
    ImageDataset,
    ImageOptions,
    class_mapping,
    load_manifest,
    with_classes,
)
from jetsplit.data.partition import (
    AMPERE_EPSILON,
    PARTITION_SCHEMES,
    PartitionScheme,
    client_shards,
    label_histogram,
    parse_scheme,
    partition,
)

__all__ = [
    "AMPERE_EPSILON",
    "CIFAR10_CLASSES",
    "DATASET_SPECS",
    "MAX_NPZ_BYTES",
    "PARTITION_SCHEMES",
    "ArrayDataset",
    "Dataset",
    "ImageDataset",
    "ImageOptions",
    "PartitionScheme",
    "class_mapping",
    "client_shards",
    "label_histogram",
    "load_cifar10_dir",
    "load_dataset",
    "load_dataset_split",
    "load_digits",
    "load_image_folder",
    "load_manifest",
    "load_mnist",
    "load_npz",
    "parse_scheme",
    "partition",
    "train_test_split",
    "with_classes",
]
