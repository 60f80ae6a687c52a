"""Configuration: frozen dataclasses from CLI flags, then `CLIPSERVE_*` variables, then defaults.

Each field's metadata holds its help text; the flag is `--field-name` and the variable
`CLIPSERVE_FIELD_NAME`, so the CLI, the environment and the README table share one source.
The environment is read only by `load_config`, never at import time.

Modules: schema.py (the sections' dataclasses and `validate`), loading.py (flags and variables
to a ServerConfig, device-dependent defaults).
"""

from clipserve.config.loading import (
    DEVICE_DEFAULTS,
    GPU_MAX_BATCH_SIZE,
    GPU_QUEUE_BATCHES,
    Option,
    iter_options,
    load_config,
    resolve_device_defaults,
    resolve_workers,
)
from clipserve.config.schema import (
    DECODERS,
    ENV_PREFIX,
    JPEG_SCALINGS,
    LOG_FORMATS,
    LOG_LEVELS,
    PRECISIONS,
    SECTIONS,
    SELF_CHECKS,
    AccessConfig,
    BackendConfig,
    BatchingConfig,
    CacheConfig,
    HttpConfig,
    LimitsConfig,
    ModelConfig,
    ServerConfig,
    validate,
)
from clipserve.errors import ConfigError

__all__ = [
    "DECODERS",
    "DEVICE_DEFAULTS",
    "ENV_PREFIX",
    "GPU_MAX_BATCH_SIZE",
    "GPU_QUEUE_BATCHES",
    "JPEG_SCALINGS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "PRECISIONS",
    "SECTIONS",
    "SELF_CHECKS",
    "AccessConfig",
    "BackendConfig",
    "BatchingConfig",
    "CacheConfig",
    "ConfigError",
    "HttpConfig",
    "LimitsConfig",
    "ModelConfig",
    "Option",
    "ServerConfig",
    "iter_options",
    "load_config",
    "resolve_device_defaults",
    "resolve_workers",
    "validate",
]
