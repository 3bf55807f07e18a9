"""Typed errors a user can cause; the CLI turns each into one line and a non-zero exit."""

from __future__ import annotations


class JetsplitError(Exception):
    """Base for every error a user can cause (bad config, profile, bundle, model, split)."""

    exit_code: int = 2


class ConfigError(JetsplitError):
    """A config or profile file is missing, malformed or fails validation."""


class ModelError(JetsplitError):
    """Unknown model, bad input shape, or a split index out of range."""


class BundleError(JetsplitError):
    """A bundle is missing files, fails its hashes, or was made by an incompatible version."""


class BackendUnavailable(JetsplitError):
    """An optional backend (TensorRT, CUDA, jetson-stats, ONNX Runtime) is absent here."""
