"""Model zoo: layered models, split points and Ampere auxiliary heads."""

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
    build_model,
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
