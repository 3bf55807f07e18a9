"""A misbehaving agent, for tests and benchmarks of the coordinator's defences.

Robust aggregation, claim checks and the registration caps are only as good as the attacks
they are tried against, and an attack is only worth trying if it runs through the real
agent code behind either engine. So the attacker lives in the worker: `AgentWorker` calls
the hooks below where it uploads weights, sends activations and labels, and registers,
whether it runs in `jetsplit simulate` or as `jetsplit agent run` over MQTT.

A spec string names the attack (`ATTACK_SPECS`). Nothing here runs unless the environment
says `JETSPLIT_ALLOW_ATTACKS=1`, which tests and benchmarks set and production paths (the
systemd unit, `scripts/install-agent.sh`, `jetsplit agent install`) never do. NumPy only:
the hooks see the arrays that go on the wire.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from typing_extensions import Annotated

from jetsplit.data import ArrayDataset
from jetsplit.edge_agent.faults import CommandKey, Fault
from jetsplit.errors import ConfigError
from jetsplit.protocol import MAX_SAMPLES

ALLOW_ENV = "JETSPLIT_ALLOW_ATTACKS"
ATTACK_SPECS = ("scale:F", "signflip", "noise:SIGMA", "labelflip", "activation-scale:F",
                "size-lie:N", "histogram-lie", "silent", "every-other", "hang-upload",
                "clock-jump:S")  # a fault (NEEDS_BROKER) may end in @R: from round R on
MAX_FACTOR = 1e6  # |F|, SIGMA and |S|: large enough to wreck a model (or a clock), finite
MAX_SPEC_CHARS = 64
_PLAIN = ("signflip", "labelflip", "histogram-lie", "silent", "every-other", "hang-upload")
MAX_ROUND = 1_000_000  # a fault's @R
# Faults that only an engine with a clock can show (over MQTT: a wedged agent process that
# stays connected, a flaky one, one that stops mid-message, one whose clock jumps); the
# in-process engine runs every command to its answer (edge_agent/faults.py).
NEEDS_BROKER = ("silent", "every-other", "hang-upload", "clock-jump")
_FLOAT = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")  # no nan, inf, _ or space


@dataclasses.dataclass(frozen=True)
class AttackSpec:
    """A parsed spec: the kind and its number (None for the kinds that take none)."""

    kind: str
    value: Optional[float] = None
    start: Optional[int] = None  # a fault's first round (`@R`; None: its default)


def parse_attack(spec: str) -> AttackSpec:
    """Parse a spec string strictly; any other form is a one-line ConfigError."""
    if not isinstance(spec, str) or not 0 < len(spec) <= MAX_SPEC_CHARS:
        raise ConfigError(f"attack spec must be 1..{MAX_SPEC_CHARS} characters; expected one "
                          f"of: {', '.join(ATTACK_SPECS)}")
    body, at, when = spec.partition("@")
    parsed = _parse_body(spec, body)
    if not at:
        return parsed
    if parsed.kind not in NEEDS_BROKER:
        raise ConfigError(f"attack {spec!r}: only the faults ({', '.join(NEEDS_BROKER)}) "
                          f"take @R")
    if not when.isdigit() or not when.isascii() or len(when) > 7 or int(when) > MAX_ROUND:
        raise ConfigError(f"attack {spec!r}: @R needs a round R in 0..{MAX_ROUND}")
    return dataclasses.replace(parsed, start=int(when))


def _parse_body(spec: str, body: str) -> AttackSpec:
    """The kind and number of a spec (`spec` without its `@R`, named in errors as given)."""
    kind, sep, arg = body.partition(":")
    if kind in _PLAIN:
        if sep:
            raise ConfigError(f"attack {spec!r}: {kind} takes no number")
        return AttackSpec(kind)
    if kind == "size-lie":
        if not arg.isdigit() or not arg.isascii() or len(arg) > 10 \
                or not 1 <= int(arg) <= MAX_SAMPLES:
            raise ConfigError(f"attack {spec!r}: size-lie needs an integer N in "
                              f"1..{MAX_SAMPLES}")
        return AttackSpec(kind, float(int(arg)))
    if kind not in ("scale", "noise", "activation-scale", "clock-jump"):
        raise ConfigError(f"unknown attack {spec!r}; expected one of: {', '.join(ATTACK_SPECS)}")
    value = float(arg) if _FLOAT.fullmatch(arg) else math.nan
    if kind == "noise" and not 0.0 < value <= MAX_FACTOR:
        raise ConfigError(f"attack {spec!r}: noise needs a finite SIGMA in (0, {MAX_FACTOR:g}]")
    if not abs(value) <= MAX_FACTOR:  # NaN (no number, bad number) and 1e400 (inf) fail too
        raise ConfigError(f"attack {spec!r}: {kind} needs a finite number F with |F| <= "
                          f"{MAX_FACTOR:g}")
    return AttackSpec(kind, value)


def attacks_allowed() -> bool:
    """Whether this process may misbehave: only where a test or benchmark said so."""
    return os.environ.get(ALLOW_ENV) == "1"


def refusal() -> str:
    """Why an attack was refused, and how a test turns it on (one line)."""
    return f"attacks are for tests and benchmarks only (set {ALLOW_ENV}=1 to allow them)"


def build_attack(spec: Optional[str], seed: int, where: str) -> Attack:
    """The attack a spec names (honest for None), refused unless the environment allows
    attacks; `where` names the spec's origin in errors."""
    if spec is None:
        return Attack()
    if not attacks_allowed():
        raise ConfigError(f"{where}: {refusal()}")
    try:
        return Attack(parse_attack(spec), seed)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


class AttackSection(BaseModel):
    """`[attack]` in agent.toml: tests and benchmarks only; refused without the variable."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Annotated[str, Field(max_length=MAX_SPEC_CHARS)]

    @field_validator("kind")
    @classmethod
    def _known(cls, value: str) -> str:
        try:
            parse_attack(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _allowed(self) -> AttackSection:
        if not attacks_allowed():
            raise ValueError(refusal())
        return self


def _is_float(array: np.ndarray) -> bool:
    return bool(np.issubdtype(array.dtype, np.floating))


def scaled_histogram(histogram: Sequence[int], total: int) -> List[int]:
    """`histogram` rescaled to add up to `total` (largest remainders, exact integers)."""
    size, classes = sum(histogram), len(histogram)
    if size == 0:
        return [total // classes + (i < total % classes) for i in range(classes)]
    counts = [h * total // size for h in histogram]
    remainders = sorted(range(classes), key=lambda i: (-(histogram[i] * total % size), i))
    for i in remainders[:total - sum(counts)]:
        counts[i] += 1
    return counts


class Attack:
    """One agent's misbehaviour (honest when `spec` is None): the worker passes what it is
    about to send, or has just received, through these hooks."""

    def __init__(self, spec: Optional[AttackSpec] = None, seed: int = 0) -> None:
        self.spec = spec
        self.kind = None if spec is None else spec.kind
        self._value = 0.0 if spec is None or spec.value is None else spec.value
        self._rng = np.random.default_rng(seed)
        self._reference: Dict[str, np.ndarray] = {}  # what it last received, for signflip
        self.fault = Fault(self.kind, None if spec is None else spec.value,
                           None if spec is None else spec.start)

    def answers(self, kind: str, round_: int = 0) -> bool:
        """Whether it answers a command of `kind` in round `round_` at all: `silent`
        registers and installs its bundle, then answers nothing (not even `status`), as a
        process that hung after setup while its connection stays up (edge_agent/faults.py)."""
        return self.fault.answers(kind, round_)

    def takes(self, kind: str, key: CommandKey, round_: int) -> bool:
        """Whether it runs and answers this command (a fault may drop it or strike now)."""
        return self.fault.takes(kind, key, round_)

    @property
    def wants_reference(self) -> bool:
        """Whether `received` needs the weights (the worker skips copying them otherwise)."""
        return self.kind == "signflip"

    def poison(self, data: ArrayDataset) -> ArrayDataset:
        """labelflip: a copy of the local data with y -> (y + 1) mod C, so local training,
        forwards and generated activations all carry the shifted labels."""
        if self.kind != "labelflip":
            return data
        return dataclasses.replace(data, y=(data.y + 1) % data.num_classes)

    def claim(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        """The dataset summary it registers: size-lie claims N samples (its histogram scaled
        to N), histogram-lie all of its size on class 0; both still add up."""
        if self.kind == "size-lie":
            size = int(self._value)
            return {**summary, "size": size,
                    "label_histogram": scaled_histogram(summary["label_histogram"], size)}
        if self.kind == "histogram-lie":
            rest = [0] * (len(summary["label_histogram"]) - 1)
            return {**summary, "label_histogram": [summary["size"], *rest]}
        return summary

    def received(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Weights it was given (set_weights, or a block built from the bundle)."""
        if self.wants_reference:
            self._reference.update({name: np.array(value, copy=True)
                                    for name, value in tensors.items() if _is_float(value)})

    def upload(self, tensors: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """A get_weights reply's arrays, attacked: every floating-point one, of whichever
        blocks were asked for (integer buffers such as num_batches_tracked pass as they are)."""
        return {name: self._weight(name, value) if _is_float(value) else value
                for name, value in tensors.items()}

    def _weight(self, name: str, w: np.ndarray) -> np.ndarray:
        if self.kind == "scale":
            return (w * self._value).astype(w.dtype)
        if self.kind == "noise":
            return (w + self._rng.normal(0.0, self._value, w.shape)).astype(w.dtype)
        g = self._reference.get(name)
        if self.kind == "signflip" and g is not None and g.shape == w.shape:
            return (2 * g - w).astype(w.dtype)  # g - (w - g): the update reversed
        return w

    def activations(self, activations: np.ndarray) -> np.ndarray:
        """Activations it sends (forward replies, SHeRL-FL's smashed data, generate)."""
        if self.kind != "activation-scale":
            return activations
        return (activations * self._value).astype(activations.dtype)
