"""Every message between the driver and the sessions of a placement, typed: frozen dataclasses with
`to_json` / `from_json`. They travel as small JSON files in the run folder (elastic.placement.control), except
`Placement`, which reaches the sessions in Ray Train's `train_loop_config`. No Ray and no torch: both sides
import it.

`from_json` returns None for a file caught mid-write (a local folder; an object store PUT is atomic) or one
missing a field: the reader treats it as not there yet and reads it again at its next poll.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, TypeVar

T = TypeVar("T", bound="Message")


class EndKind(str, Enum):
    """Why a placement ended at a checkpoint. A str enum: its JSON value is the plain word written before."""

    PREEMPTION = "preemption"  # a node of it is being reclaimed: the just-in-time checkpoint
    SWAP = "swap"  # spot-first on on-demand, spot capacity is back: move to spot
    GROW = "grow"  # elastic below max, capacity for more workers held steady: restart larger

    @classmethod
    def parse(cls, value: Any, default: EndKind | None = None) -> EndKind | None:
        try:
            return cls(value)
        except ValueError:
            return default


class Message:
    """to_json / from_json for the frozen dataclasses below (tuples for lists, enums by value)."""

    def to_dict(self) -> dict:
        return {
            k: (v.value if isinstance(v, Enum) else list(v) if isinstance(v, tuple) else v)
            for k, v in asdict(self).items()
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls: type[T], data: Any) -> T | None:
        if not isinstance(data, dict):
            return None
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        try:
            return cls._build({k: v for k, v in data.items() if k in known})
        except (TypeError, ValueError, KeyError):
            return None

    @classmethod
    def from_json(cls: type[T], text: str | None) -> T | None:
        if not text:
            return None
        try:
            return cls.from_dict(json.loads(text))
        except ValueError:  # caught mid-write: read it next poll
            return None

    @classmethod
    def _build(cls: type[T], data: dict) -> T:
        return cls(**data)


@dataclass(frozen=True)
class Placement(Message):
    """One fit() of the run, as its sessions are told it: the market its workers select, and whether the
    driver may end it at a checkpoint (swappable: to move to spot; resizable: to grow)."""

    id: str
    market: str | None = None
    swappable: bool = False
    reason: str = ""
    workers: int | None = None  # started with (the driver's count of free slots, capped at max)
    resizable: bool = False  # elastic and below max: the driver may end it at a checkpoint to grow
    avoid_nodes: tuple[str, ...] = ()  # nodes draining when it started (being reclaimed)
    follows: str | None = None  # started ahead: its sessions wait until this placement has ended

    @property
    def endable(self) -> bool:
        return self.swappable or self.resizable

    @classmethod
    def _build(cls, data: dict) -> Placement:
        return cls(**{**data, "avoid_nodes": tuple(data.get("avoid_nodes") or ())})


@dataclass(frozen=True)
class EndRequest(Message):
    """The driver asks placement `placement` to end at its next checkpoint (kind: swap or grow)."""

    placement: str
    kind: EndKind
    reason: str = ""
    time: float = field(default_factory=time.time)

    @classmethod
    def _build(cls, data: dict) -> EndRequest:
        return cls(**{**data, "kind": EndKind(data["kind"])})


@dataclass(frozen=True)
class EndingSoon(Message):
    """Rank 0 at a reclaim notice: the placement will end at a just-in-time checkpoint committed around `eta`
    (unix seconds); its ranks run on `nodes`. `time`: when the notice was written."""

    placement: str
    eta: float
    nodes: tuple[str, ...] = ()
    time: float = field(default_factory=time.time)

    @classmethod
    def _build(cls, data: dict) -> EndingSoon:
        return cls(**{**data, "eta": float(data["eta"]), "nodes": tuple(data.get("nodes") or ())})


@dataclass(frozen=True)
class Cancel(Message):
    """A placement started ahead of its predecessor's end must exit without training."""

    placement: str
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Acknowledgement(Message):
    """Rank 0: the placement ended at the checkpoint of `step`, for `kind`; `nodes`: the node of each rank,
    whose slots are about to be free for the next placement."""

    placement: str
    step: int
    kind: EndKind = EndKind.SWAP
    nodes: tuple[str, ...] = ()
    time: float = field(default_factory=time.time)

    @classmethod
    def _build(cls, data: dict) -> Acknowledgement:
        # As the driver always read it: no kind is a swap, an unknown one (a session's "ended") a grow.
        kind = EndKind.parse(data["kind"], EndKind.GROW) if "kind" in data else EndKind.SWAP
        return cls(**{**data, "step": int(data["step"]), "kind": kind, "nodes": tuple(data.get("nodes") or ())})


@dataclass(frozen=True)
class Running(Message):
    """Rank 0 of a placement's (re)started worker group: how many workers it got."""

    placement: str
    world_size: int
    time: float = field(default_factory=time.time)

    @classmethod
    def _build(cls, data: dict) -> Running:
        return cls(**{**data, "world_size": int(data["world_size"])})


@dataclass(frozen=True)
class DriverStatus(Message):
    """What the driver is doing now (running, waiting), for `elastic status RUN`."""

    state: str
    detail: str
    time: float = field(default_factory=time.time)
