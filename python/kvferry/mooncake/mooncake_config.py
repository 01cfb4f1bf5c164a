"""Mooncake's ``mooncake.mooncake_config`` on kvferry: ``MooncakeConfig``, the store client's
settings from a JSON file (``MOONCAKE_CONFIG_PATH``) or ``MOONCAKE_*`` environment variables,
with Mooncake 0.3.14's fields, defaults, parsing and checks (tests/python/test_modules.py
runs the same inputs through the stock module and this one and compares the results).

``MooncakeDistributedStore().setup(...)`` takes the fields as Mooncake's does
(``config.master_server_address`` is ``setup``'s ``master_server_addr``). kvferry's store
refuses what it cannot honour at ``setup``, not here: ``tenant_id`` other than
``"default"`` and ``enable_client_http_server=True`` (``enable_ssd_offload`` with
``ssd_offload_path`` gives the client its disk tier).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["MooncakeConfig", "DEFAULT_GLOBAL_SEGMENT_SIZE", "DEFAULT_LOCAL_BUFFER_SIZE"]

logger = logging.getLogger(__name__)

DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200  # 3.125 GiB, as Mooncake
DEFAULT_LOCAL_BUFFER_SIZE = 1073741824  # 1 GiB, as Mooncake

# Longest suffix first, so "16mb" is read as MB and not as "16m" + "b".
_UNITS = (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40),
          ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40), ("b", 1))

# The protocols Mooncake 0.3.14 names; another one is passed on with a warning (the engine
# decides), as Mooncake does. kvferry's engine itself moves "tcp" and "rdma".
_KNOWN_PROTOCOLS = frozenset((
    "tcp", "rdma", "efa", "nvmeof", "nvlink", "musa", "nvlink_intra", "hip", "barex", "cxl",
    "ascend", "ub", "ubshmem", "maca", "sunrise_link", "rpc_only",
))
_REQUIRED = ("local_hostname", "metadata_server", "master_server_address")
_TRUE = ("true", "1", "yes", "on", "enable")
_FALSE = ("false", "0", "no", "off", "disable")


def _parse_segment_size(value: Any) -> int:
    """A size in bytes from an int or a string such as ``"3355443200"``, ``"16MB"``,
    ``"1.5 gb"``, ``"4k"`` (binary units); ValueError for an empty or malformed string."""
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return int(value)
    text = value.strip().lower()
    if not text:
        raise ValueError("Invalid segment size: empty string")
    for unit, scale in _UNITS:
        if text.endswith(unit):
            number = text[: len(text) - len(unit)].strip()
            if not number:
                raise ValueError("Invalid segment size: missing number before '%s'" % unit)
            return int(float(number) * scale)
    return int(float(text))


def _parse_bool(value: Any) -> bool:
    """A boolean from a bool, a number or a word (true/false, yes/no, on/off, 1/0,
    enable/disable); None and "" are False; another word raises ValueError (``bool("false")``
    would be True)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if value is None:
        return False
    word = str(value).strip().lower()
    if not word:
        return False
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError("Invalid boolean value: %r" % (value,))


@dataclass
class MooncakeConfig:
    """The store client's settings (Mooncake's fields, order and defaults).

    The protocol is lower-cased (an unknown one is logged and kept); sizes must not be
    negative; ``local_hostname``, ``metadata_server`` and ``master_server_address`` must be
    non-empty strings: ValueError otherwise, naming the field."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: Optional[str]
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError("Invalid protocol: %r. Protocol must be a non-empty string, e.g. 'tcp' or 'rdma'." % (self.protocol,))
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in _KNOWN_PROTOCOLS:
            logger.warning("Unrecognised protocol %r; passing it through to the Mooncake engine unchanged. Known protocols are: %s.",
                           self.protocol, ", ".join(sorted(_KNOWN_PROTOCOLS)))
        for name in ("global_segment_size", "local_buffer_size"):
            size = getattr(self, name)
            if size < 0:
                raise ValueError("Invalid %s: %s. Size must be non-negative." % (name, size))
        for name in _REQUIRED:
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ValueError("Config field %r must be a non-empty string, got %r." % (name, v))

    @staticmethod
    def from_file(file_path: str) -> "MooncakeConfig":
        """The settings of a JSON file (sizes may be strings with units); ValueError naming a
        missing required field."""
        with open(file_path) as f:
            cfg = json.load(f)
        for name in _REQUIRED:
            if name not in cfg:
                raise ValueError("Missing required config field: %s" % name)
        path, tenant = cfg.get("ssd_offload_path"), cfg.get("tenant_id")
        return MooncakeConfig(
            local_hostname=cfg.get("local_hostname"),
            metadata_server=cfg.get("metadata_server"),
            global_segment_size=_parse_segment_size(cfg.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_parse_segment_size(cfg.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=cfg.get("protocol", "tcp"),
            device_name=cfg.get("device_name", ""),
            master_server_address=cfg.get("master_server_address"),
            enable_ssd_offload=_parse_bool(cfg.get("enable_ssd_offload", False)),
            ssd_offload_path="" if path is None else str(path),
            tenant_id="default" if tenant is None else str(tenant),
            enable_client_http_server=_parse_bool(cfg.get("enable_client_http_server", False)),
            client_http_port=int(cfg.get("client_http_port", 9300)),
        )

    @staticmethod
    def load_from_env() -> "MooncakeConfig":
        """``from_file($MOONCAKE_CONFIG_PATH)`` when that is set; else the settings of
        ``MOONCAKE_MASTER`` (required), ``MOONCAKE_LOCAL_HOSTNAME`` (localhost),
        ``MOONCAKE_TE_META_DATA_SERVER`` (P2PHANDSHAKE), ``MOONCAKE_GLOBAL_SEGMENT_SIZE``,
        ``MOONCAKE_LOCAL_BUFFER_SIZE``, ``MOONCAKE_PROTOCOL`` (tcp), ``MOONCAKE_DEVICE``,
        ``MOONCAKE_OFFLOAD_ENABLED``, ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``,
        ``MOONCAKE_TENANT_ID``, ``MOONCAKE_ENABLE_CLIENT_HTTP_SERVER`` and
        ``MOONCAKE_CLIENT_HTTP_PORT`` (9300)."""
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path is not None:
            return MooncakeConfig.from_file(path)
        if not os.getenv("MOONCAKE_MASTER"):
            raise ValueError("Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor 'MOONCAKE_MASTER' is set.")
        env = os.getenv
        return MooncakeConfig(
            local_hostname=env("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=env("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=_parse_segment_size(env("MOONCAKE_GLOBAL_SEGMENT_SIZE", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_parse_segment_size(env("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=env("MOONCAKE_PROTOCOL", "tcp"),
            device_name=env("MOONCAKE_DEVICE", ""),
            master_server_address=env("MOONCAKE_MASTER"),
            enable_ssd_offload=_parse_bool(env("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=env("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=env("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=_parse_bool(env("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false")),
            client_http_port=int(env("MOONCAKE_CLIENT_HTTP_PORT", 9300)),
        )
