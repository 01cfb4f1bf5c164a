"""What kvferry does with each Python module of Mooncake 0.3.14's wheel.

Every module name the stock ``mooncake-transfer-engine-cuda13`` 0.3.14 wheel installs under
``mooncake/`` is either **served** (the shim answers ``import mooncake.X`` with a module
re-exporting a ``kvferry.mooncake`` module) or **refused**: the import raises
:class:`MooncakeModuleUnavailable` (a ``ModuleNotFoundError``, so ``except ImportError`` and
``except ModuleNotFoundError`` handlers keep working) whose message names what the module is,
why kvferry does not provide it and what to use instead. No ``mooncake.*`` import under the
shim ends in Python's bare "No module named ..." for a name of the 0.3.14 wheel.

``tests/python/test_modules.py`` lists the modules of the installed stock wheel and checks
each against this table; docs/PYTHON.md ("Mooncake 0.3.14's Python modules") is written from it.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

#: mooncake name -> the kvferry module the shim re-exports under it.
SERVED: Dict[str, str] = {
    "mooncake": "kvferry.mooncake",
    "mooncake.engine": "kvferry.mooncake.engine",
    "mooncake.store": "kvferry.mooncake.store",
    # The C++ extension behind mooncake.store (mooncake.store re-exports it): the same API.
    "mooncake._store": "kvferry.mooncake.store",
    "mooncake.buffer_pool": "kvferry.mooncake.buffer_pool",
    "mooncake.http_metadata_server": "kvferry.mooncake.http_metadata_server",
    "mooncake.async_store": "kvferry.mooncake.async_store",
    "mooncake.mooncake_config": "kvferry.mooncake.mooncake_config",
    "mooncake.cli": "kvferry.mooncake.cli",
}

#: Private names a served module re-exports too (Mooncake's ``mooncake.store`` serves its C++
#: module's tensor (de)serializers under these names).
PRIVATE_EXPORTS: Dict[str, Tuple[str, ...]] = {
    name: ("_serialize_tensor", "_tensor_metadata_size", "_deserialize_tensor") for name in ("mooncake.store", "mooncake._store")
}

#: The served aliases that are packages in the 0.3.14 wheel (their refused children,
#: e.g. ``mooncake.store.rs``, must reach the finder instead of "... is not a package").
PACKAGES = frozenset({"mooncake", "mooncake.store"})

_NO_TORCH_GPU = (
    "kvferry moves host memory (and GPU memory through its transfer engine), but does not "
    "implement Mooncake's torch-side GPU components"
)
_VERL = (
    "it is Mooncake's DataProto/structured-object layer for verl (pure Python over "
    "MooncakeDistributedStore calls), which kvferry does not reimplement; store the arrays "
    "with mooncake.store's put_from/get_into/get_into_ranges (or put_tensor/get_tensor)"
)
_NOF = (
    "kvferry has no NVMe-oF/SPDK tier, so there is nothing for Mooncake's SSD/SPDK "
    "administration tools to set up; see docs/MIGRATING.md for kvferry master's storage flags"
)

#: mooncake name -> why kvferry does not provide it (and what to use instead).
REFUSED: Dict[str, str] = {
    "mooncake.mooncake_connector_v1": (
        "Mooncake's out-of-tree vLLM v1 KV connector (loaded with kv_connector_module_path) "
        "is not shipped by kvferry; use vLLM's built-in MooncakeConnector "
        "(--kv-transfer-config '{\"kv_connector\":\"MooncakeConnector\",...}'), which imports "
        "mooncake.engine and runs on kvferry through this shim (docs/PYTHON.md, \"vLLM "
        "MooncakeConnector\")"
    ),
    "mooncake.structured_object_store": "mooncake.structured_object_store: " + _VERL,
    "mooncake._structured_ranges": "mooncake._structured_ranges (structured_object_store's range planner): " + _VERL,
    "mooncake._partial_read": "mooncake._partial_read (structured_object_store's matrix read planner): " + _VERL,
    "mooncake.dataproto_catalog": "mooncake.dataproto_catalog: " + _VERL,
    "mooncake.mooncake_store_service": (
        "Mooncake's aiohttp REST front end for the store is not provided; call "
        "mooncake.store.MooncakeDistributedStore directly, or run `kvferry store-client` "
        "for a store service other processes reach with setup_dummy"
    ),
    "mooncake.vllm_v1_proxy_server": (
        "Mooncake's example vLLM prefill/decode proxy (FastAPI) is not part of the transfer "
        "engine and is not provided; use vLLM's own disaggregated-serving proxy"
    ),
    "mooncake.cli_client": (
        "`mooncake_client` (a standalone store client process) is not provided as such; run "
        "`kvferry store-client` (the same role: a store client other processes reach with "
        "setup_dummy)"
    ),
    "mooncake.cli_bench": (
        "`transfer_engine_bench` is Mooncake's C++ benchmark binary; run `kvferry bench` "
        "(engine) or `kvferry store-bench` (store) instead"
    ),
    "mooncake._launcher": (
        "it locates the native binaries bundled in Mooncake's wheel, which kvferry does not "
        "bundle; kvferry's binaries are subcommands of `kvferry` (`kvferry master`, "
        "`kvferry store-client`, `kvferry bench`): use mooncake.cli for mooncake_master"
    ),
    "mooncake.transfer_engine_topology_dump": (
        "it dumps the C++ engine's NIC/GPU topology; run `kvferry doctor` (the NICs, ports "
        "and GPU paths kvferry would use) or TransferEngine.get_local_topology()"
    ),
    "mooncake.ep": "Mooncake EP (expert-parallel all-to-all over its C++ _ep module) is not provided: " + _NO_TORCH_GPU,
    "mooncake._ep": "Mooncake EP's C++ extension is not provided: " + _NO_TORCH_GPU,
    "mooncake.mooncake_ep_buffer": "Mooncake EP's buffer (torch, CUDA) is not provided: " + _NO_TORCH_GPU,
    "mooncake.mooncake_elastic_buffer": "Mooncake EP's elastic buffer (torch, CUDA) is not provided: " + _NO_TORCH_GPU,
    "mooncake.pg": "Mooncake's torch.distributed process-group backend is not provided: " + _NO_TORCH_GPU + "; use torch's gloo/nccl backends",
    "mooncake.allocator": "Mooncake's NVLink/fabric CUDA pluggable allocator is not provided: " + _NO_TORCH_GPU,
    "mooncake.nvlink_allocator": "Mooncake's NVLink allocator extension is not provided: " + _NO_TORCH_GPU,
    "mooncake.fabric_allocator_utils": "Mooncake's fabric allocator helpers are not provided: " + _NO_TORCH_GPU,
    "mooncake.shared_segment": (
        "Mooncake's process-shared offload segment (torch.distributed, the C++ engine's "
        "SharedSegment) is not provided; share host memory between processes with "
        "TransferEngine.allocate_managed_buffer and transfers (kvferry maps managed buffers "
        "between processes of one host)"
    ),
    "mooncake._fast_copy": (
        "Mooncake's C copy helper for structured_object_store is not provided: " + _VERL
    ),
    "mooncake.mooncake_ssd_register": "mooncake.mooncake_ssd_register: " + _NOF,
    "mooncake.mooncake_ssd_unregister": "mooncake.mooncake_ssd_unregister: " + _NOF,
    "mooncake.spdk_tgt_create": "mooncake.spdk_tgt_create: " + _NOF,
    "mooncake._administration": "mooncake._administration (the SSD tools' SSH helper): " + _NOF,
}

#: Packages refused with everything under them: prefix -> reason.
REFUSED_TREES: Dict[str, str] = {
    "mooncake.reshard": (
        "Mooncake's resharding library (KV-cache and weight resharding plans executed over "
        "its transfer engine and store) is not provided by kvferry; move the shards with "
        "mooncake.engine batch transfers or mooncake.store put_from/get_into"
    ),
    "mooncake.store.rs": (
        "Mooncake's Rust store backend (MOONCAKE_STORE_BACKEND='rs') is not provided: "
        "kvferry's mooncake.store is the one store implementation (MooncakeDistributedStore "
        "against `kvferry master`); leave MOONCAKE_STORE_BACKEND unset or 'cpp'"
    ),
    "mooncake._pg_jit": "the C++ sources of Mooncake's process-group backend (mooncake.pg) are not provided: " + _NO_TORCH_GPU,
    "mooncake.mooncake_ep_jit": "the C++ sources of Mooncake EP are not provided: " + _NO_TORCH_GPU,
}


class MooncakeModuleUnavailable(ModuleNotFoundError):
    """``import mooncake.X`` of a 0.3.14 module kvferry does not provide; the message says
    why and what to use. A ``ModuleNotFoundError`` (hence an ``ImportError``), with ``name``
    set to the module."""


def refusal(name: str) -> Optional[str]:
    """Why ``name`` is not provided, or None when it is served or not a 0.3.14 module."""
    if name in REFUSED:
        return REFUSED[name]
    for prefix, why in REFUSED_TREES.items():
        if name == prefix or name.startswith(prefix + "."):
            return why
    return None


def status(name: str) -> Tuple[str, str]:
    """("served", kvferry module) or ("refused", reason) or ("unknown", "")."""
    if name in SERVED:
        return "served", SERVED[name]
    why = refusal(name)
    if why is not None:
        return "refused", why
    return "unknown", ""


def message(name: str, why: str) -> str:
    return "%s is not provided by kvferry's mooncake shim: %s (docs/PYTHON.md lists every module of Mooncake 0.3.14)" % (name, why)
