"""Everything the engine and its front ends tell each other, as types: the control channel's
frames (`wire.py` lists them), the model card and the towers' status.

TypedDicts, not dataclasses: at run time they are the plain dicts msgpack packs and unpacks
natively, so a frame costs no conversion either way (admit, run and done cross once per request)
and typing a received frame is a cast, not a copy. mypy checks every frame built and narrows a
received one by its `t`. Lists, not tuples, wherever msgpack carries a sequence: it decodes
arrays as lists, and a type must hold on both ends.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypeAlias, TypedDict

from clipserve.batching.tower import TowerKind

# What the model card, the status and the frames are made of.


class PreprocessCard(TypedDict):
    """`PreprocessSpec` as data."""

    size: list[int]  # [height, width]
    mean: list[float]  # [r, g, b]
    std: list[float]
    interpolation: str
    resize_mode: str


class ModelCard(TypedDict):
    """What a front end needs to know of the model to parse, decode and tokenise for it. The
    engine sends it to the supervisor once warmed up (every front end starts with it), and again
    in each `card` frame."""

    name: str
    weights_id: str
    embed_dim: int
    context_length: int
    preprocess: PreprocessCard
    backend: str
    devices: list[str]
    precision: str
    # `dataclasses.asdict(BatchingConfig)` as served (CUDA defaults resolved); front ends size
    # their slots and /info by it (`dataclasses.replace(config.batching, **batching)`). Any:
    # whatever fields BatchingConfig has, so that a new one needs no second list kept in step
    # (mypy types `replace`'s keywords field by field, which a TypedDict copy would have to be).
    batching: dict[str, Any]
    self_check: dict[str, Any] | None  # the engine's startup self-check (inference/self_check.py)


class WorkerRow(TypedDict):
    """One device worker of one tower."""

    device: str
    alive: bool
    error: str | None


class Status(TypedDict):
    """What `/readyz`, `/healthz` and the scrape-time gauges read (`Towers.status()`)."""

    towers: dict[TowerKind, list[WorkerRow]]
    depth: dict[TowerKind, int]  # items queued
    # Items holding a queue place: queued, or in requests being read or looked up in the cache
    admitted: dict[TowerKind, int]
    wait_s: float  # the image tower's estimated wait for one more image
    memory: dict[str, int]  # device -> bytes in use, where its executor knows


class _EncodedErrorFields(TypedDict):
    cls: str  # the name of a ClipserveError class
    message: str


class EncodedError(_EncodedErrorFields, total=False):
    """A ClipserveError as data (`wire.encode_error`, `wire.decode_error`)."""

    retry: int  # retry_after_s, for the errors that have one


# Front end → engine.


class HelloFrame(TypedDict):
    t: Literal["hello"]
    pid: int
    path: str  # the front end's slot file
    count: int
    slot_bytes: int


class AdmitFrame(TypedDict):
    t: Literal["admit"]
    id: int
    tower: TowerKind
    n: int
    wait_s: float


class RunFrame(TypedDict):
    t: Literal["run"]
    id: int
    ids: list[int]  # the admissions it uses (`id` is the first)
    tower: TowerKind
    slots: list[int]
    dtype: str  # numpy's `dtype.str`, one for all the items
    shapes: list[list[int]]  # one per item
    normalize: bool
    rid: str  # the request id, for the log
    # The embedding cache's key of each item (absent or None: uncached), and no-cache.
    keys: NotRequired[list[bytes] | None]
    fresh: NotRequired[bool]


class LookupFrame(TypedDict):
    t: Literal["lookup"]
    id: int
    tower: TowerKind
    keys: list[bytes]


class ReleaseFrame(TypedDict):
    t: Literal["release"]
    ids: list[int]


class CancelFrame(TypedDict):
    t: Literal["cancel"]
    id: int


ToEngine: TypeAlias = HelloFrame | AdmitFrame | RunFrame | ReleaseFrame | CancelFrame | LookupFrame

# Engine → front end.


class CardFrame(ModelCard, Status):
    t: Literal["card"]


class OkFrame(TypedDict):
    t: Literal["ok"]
    id: int


class DoneFrame(TypedDict):
    t: Literal["done"]
    id: int
    dim: int  # each slot of the run holds one float32 row of `dim`
    queue_s: float
    compute_s: float


class FoundFrame(TypedDict):
    t: Literal["found"]
    id: int
    hits: list[int]  # the indices of the keys found in the cache
    dim: int
    rows: bytes  # their rows, float32 little-endian, in the order of `hits`


class ErrorFrame(TypedDict):
    t: Literal["error"]
    id: int
    error: EncodedError


class StatusFrame(Status):
    t: Literal["status"]


ToFront: TypeAlias = CardFrame | OkFrame | DoneFrame | FoundFrame | ErrorFrame | StatusFrame

# Engine → supervisor, once, over a multiprocessing pipe (pickled): warmed up, or why not.
EngineReady: TypeAlias = tuple[Literal["ready"], ModelCard] | tuple[Literal["error"], str]
