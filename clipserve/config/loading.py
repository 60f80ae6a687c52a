"""Where a configuration comes from: CLI flags, then `CLIPSERVE_*` variables, then defaults;
and the defaults that depend on the devices served or the cores this process may use."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import get_type_hints

from clipserve.backends.device import is_cuda
from clipserve.config.schema import ENV_PREFIX, SECTIONS, ServerConfig
from clipserve.errors import ConfigError


@dataclass(frozen=True)
class Option:
    section: str
    name: str
    type: object  # the field's annotation: int, float, bool, str, str | None or tuple[str, ...]
    default: object
    help: str
    choices: tuple[str, ...] | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def iter_options() -> Iterator[Option]:
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield Option(
                section, f.name, hints[f.name], f.default, f.metadata["help"], f.metadata["choices"]
            )


def _coerce(option: Option, raw: str | list[str]) -> object:
    kind = option.type
    if kind == tuple[str, ...]:
        items = raw if isinstance(raw, list) else [s for s in raw.split(",") if s.strip()]
        return tuple(s.strip() for s in items)
    assert isinstance(raw, str)
    if kind is bool:
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{option.flag} (or {option.env}): expected true or false, got {raw!r}")
    if kind in (str | None,) and raw.strip().lower() in ("", "none"):
        return None
    try:
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError:
        expected = "int" if kind is int else "float"
        raise ConfigError(
            f"{option.flag} (or {option.env}): expected {expected}, got {raw!r}"
        ) from None
    return raw


def load_config(
    flags: Mapping[str, str | list[str] | None] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Build the config: a flag given wins over `CLIPSERVE_*`, which wins over the default.

    `flags` maps field names to raw strings (or lists for repeatable flags); absent or None
    means "not given".
    """
    flags = flags or {}
    environ = os.environ if environ is None else environ
    sections: dict[str, dict[str, object]] = {name: {} for name in SECTIONS}
    for option in iter_options():
        raw = flags.get(option.name)
        if raw is None:
            raw = environ.get(option.env)
        if raw is not None:
            sections[option.section][option.name] = _coerce(option, raw)
    given = {name for values in sections.values() for name in values}
    defaulted = frozenset(DEVICE_DEFAULTS) - given
    built = {name: SECTIONS[name](**values) for name, values in sections.items()}
    return ServerConfig(**built, defaulted=defaulted)


# Options whose default depends on the devices served (resolve_device_defaults).
DEVICE_DEFAULTS = ("max_batch_size", "max_queue_size")
GPU_MAX_BATCH_SIZE = 256  # not yet chosen from a measured knee: no GPU has run this
GPU_QUEUE_BATCHES = 4  # queue room per device, in batches: two in flight, two waiting


def resolve_device_defaults(config: ServerConfig, devices: Sequence[str]) -> ServerConfig:
    """The config with device-dependent defaults filled in, once the devices are known.

    On CUDA devices a batch of 32 leaves a GPU mostly idle and a queue of 256 admits one large
    batch before answering 503, so options left to their defaults become --max-batch-size 256
    and --max-queue-size 4 x batch x devices. A flag or variable always wins (precedence is
    unchanged), and on the CPU and simulated devices the static defaults stay.
    """
    b = config.batching
    if not config.defaulted or not any(is_cuda(d) for d in devices):
        return config
    batch = b.max_batch_size
    if "max_batch_size" in config.defaulted:
        batch = GPU_MAX_BATCH_SIZE
        if "max_queue_size" not in config.defaulted:  # a queue given smaller than that batch
            batch = min(batch, b.max_queue_size)
    queue = b.max_queue_size
    if "max_queue_size" in config.defaulted:
        queue = max(GPU_QUEUE_BATCHES * batch * len(devices), b.max_queue_size)
    return dataclasses.replace(
        config,
        batching=dataclasses.replace(b, max_batch_size=batch, max_queue_size=queue),
        defaulted=frozenset(),
    )


def resolve_workers(requested: int) -> int:
    """0 means one per core this process may use."""
    if requested:
        return requested
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
