"""Config-driven deployment: the schema and its loader."""

from hicache.config.loader import ENV_PREFIX, aload_config, check_backend, config_from_dict, env_overrides, env_variables, load_config
from hicache.config.schema import (
    CacheConfig,
    DeviceConfig,
    EventsConfig,
    ExtraPoolConfig,
    HiCacheConfig,
    HostConfig,
    ModelConfig,
    PrefetchConfig,
    ServerConfig,
    SessionConfig,
    StorageConfig,
    TracingConfig,
)

__all__ = [
    "CacheConfig",
    "DeviceConfig",
    "ENV_PREFIX",
    "EventsConfig",
    "ExtraPoolConfig",
    "HiCacheConfig",
    "HostConfig",
    "ModelConfig",
    "PrefetchConfig",
    "ServerConfig",
    "SessionConfig",
    "StorageConfig",
    "TracingConfig",
    "aload_config",
    "check_backend",
    "config_from_dict",
    "env_overrides",
    "env_variables",
    "load_config",
]
