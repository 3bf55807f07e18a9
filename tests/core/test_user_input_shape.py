"""A user network that cannot take the data's input shape is one error line, not torch's
traceback (the cut finder runs it on a probe of that shape)."""

from __future__ import annotations

import pytest

from jetsplit.errors import ModelError
from jetsplit.models import ModelSpec, build_model


def test_a_network_that_cannot_take_the_input_shape_is_one_line() -> None:
    with pytest.raises(ModelError) as info:
        build_model(ModelSpec("usernets:plain_net", (1, 8, 8), 10), seed=0)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("model source usernets:plain_net: cannot run on inputs of shape "
                           "[1, 8, 8] (")
    assert "expected input[2, 1, 8, 8] to have 3 channels" in text
