"""The `[data]` keys that say how `folder:`/`csv:` images become model inputs.

Declared once: the agent's `[data]` (its own images) and the coordinator's `[data]` (its
held-out folder) take the same keys with the same bounds, so a fleet sizes, crops and
normalises every image by one rule.
"""

from __future__ import annotations

from typing import List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import Annotated

from jetsplit.data.image_sets import ImageOptions

ClassName = Annotated[str, Field(min_length=1, max_length=200)]


class ImageKeys(BaseModel):
    """Image sizing, augmentation and normalisation; `classes` is the run's class list in
    label order (a device's labels are mapped to it by name)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    classes: Optional[List[ClassName]] = Field(None, min_length=1, max_length=100_000)
    image_size: Optional[Annotated[int, Field(ge=4, le=4096)]] = None
    channels: Optional[Literal[1, 3]] = None
    random_crop: bool = True
    flip: bool = True
    centre_crop: bool = True
    mean: Optional[List[float]] = Field(None, min_length=1, max_length=3)
    std: Optional[List[Annotated[float, Field(gt=0.0)]]] = Field(
        None, min_length=1, max_length=3)
    stats_sample: Annotated[int, Field(ge=1, le=100_000)] = 256

    @model_validator(mode="after")
    def _distinct_classes(self) -> ImageKeys:
        if self.classes is not None and len(set(self.classes)) != len(self.classes):
            raise ValueError("classes must not repeat a name")
        return self

    def image_options(self, seed: int) -> ImageOptions:
        """These keys as the loader's options (`seed`: the training crops' and flips')."""
        return ImageOptions(
            image_size=self.image_size, channels=self.channels, random_crop=self.random_crop,
            flip=self.flip, centre_crop=self.centre_crop,
            mean=None if self.mean is None else tuple(self.mean),
            std=None if self.std is None else tuple(self.std),
            stats_sample=self.stats_sample, seed=seed)
