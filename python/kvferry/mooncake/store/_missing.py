"""The ``MooncakeDistributedStore`` names kvferry does not provide, each with the reason its
AttributeError gives (docs/PYTHON.md's table says the same)."""

from typing import Dict

_PARALLELISM = "Mooncake's generalised parallelism tensor calls came after 0.3.14 (kvferry serves 0.3.14's *_tensor_with_tp calls); use put_tensor_with_tp/get_tensor_with_tp"
_NOT_PROVIDED: Dict[str, str] = {
    **{n: _PARALLELISM for n in (
        "get_tensor_with_parallelism", "batch_get_tensor_with_parallelism", "get_tensor_with_parallelism_into",
        "batch_get_tensor_with_parallelism_into", "put_tensor_with_parallelism", "batch_put_tensor_with_parallelism",
        "put_tensor_with_parallelism_from", "batch_put_tensor_with_parallelism_from", "upsert_tensor_with_parallelism",
        "upsert_tensor_with_parallelism_from", "batch_upsert_tensor_with_parallelism_from", "batch_upsert_tensor_with_parallelism",
    )},
    **{n: "kvferry mounts only memory it allocates as a segment (allocate_and_mount_segment / unmount_and_free_segment), not a file or device mapping" for n in (
        "mount_segment", "unmount_segment",
    )},
    **{n: "no local-disk segment or offload RPC reads in kvferry's store" for n in (
        "unmount_local_disk_segment", "get_offload_rpc_read_count",
    )},
    "begin_weight_snapshot": "no model-weight snapshots (Mooncake 0.3.14's weight management: revisions and residency kept by the master); store weights as values with put_from/batch_put_from",
}

#: Module-level names of Mooncake 0.3.14's ``mooncake.store`` that kvferry does not provide.
_MODULE_NOT_PROVIDED: Dict[str, str] = {
    **{n: "Mooncake returns the address of its C hugepage allocator function for native code to call; kvferry's allocator is not a C function: use MooncakeHostMemAllocator or MooncakeDistributedStore.alloc_from_mem_pool" for n in ("get_alloc_func_addr", "get_free_func_addr")},
    **{n: "a lease's buffer is a plain memoryview" for n in ("BufferLeaseView", "RegisteredBufferLeaseView")},
    "EngramStore": "no Engram tier",
    "MooncakeDistributedNoFRegister": "no NVMe-oF tier",
}
