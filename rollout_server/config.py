"""The rollout server's configuration: the `server` section of a run YAML
(docs/ARCHITECTURE.md#configuration).

The schema and the loader are shared with the learner and defined once, in `shared_schemas.server_config`
(`ServerConfig` and its sections, `load_server_config`) and `shared_schemas.config` (the `extends:` loader,
`ConfigError`, `REPO_ROOT`, `LOOPBACK_HOSTS`); this module is the server's import path for them.
"""

from __future__ import annotations

from shared_schemas.config import LOOPBACK_HOSTS, REPO_ROOT, ConfigError, deep_merge, load_yaml_tree
from shared_schemas.server_config import (
    HfServerConfig,
    ServerConfig,
    VllmServerConfig,
    load_server_config,
    server_config_from_mapping,
)

__all__ = [
    "LOOPBACK_HOSTS",
    "REPO_ROOT",
    "ConfigError",
    "HfServerConfig",
    "ServerConfig",
    "VllmServerConfig",
    "deep_merge",
    "load_server_config",
    "load_yaml_tree",
    "server_config_from_mapping",
]
