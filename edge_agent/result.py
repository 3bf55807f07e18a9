"""What a command returns to its caller (the daemon or the in-process engine): shared by the
worker and SHeRL-FL's edge role, which both answer commands."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

import numpy as np

from jetsplit.edge_agent.peers import PeerSend

Tensors = Dict[str, np.ndarray]


@dataclass
class Result:
    """What a command returns: small values in `meta`, arrays in `tensors`, and direct
    messages to peers (`peers`, sent with the same codec) that its caller delivers."""

    meta: Dict[str, Any] = field(default_factory=dict)
    tensors: Tensors = field(default_factory=dict)
    codec: str = "fp32"
    compression: str = "none"
    peers: List[PeerSend] = field(default_factory=list)
