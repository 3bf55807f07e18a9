"""Models: the zoo, user model sources as layered models, split points and aux heads."""

from jetsplit.models.sources import build_model
from jetsplit.models.split import (
    DEFAULT_AUX_RATIO,
    AuxiliaryHead,
    activation_shape,
    build_aux_head,
    check_split,
    split,
)
from jetsplit.models.zoo import (
    MODEL_NAMES,
    ZOO_VERSION,
    LayeredModel,
    ModelSpec,
)

__all__ = [
    "DEFAULT_AUX_RATIO",
    "MODEL_NAMES",
    "ZOO_VERSION",
    "AuxiliaryHead",
    "LayeredModel",
    "ModelSpec",
    "activation_shape",
    "build_aux_head",
    "build_model",
    "check_split",
    "split",
]
