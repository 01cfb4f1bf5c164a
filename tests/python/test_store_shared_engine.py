"""MooncakeDistributedStore.setup(..., engine): the store shares the caller's TransferEngine,
as in Mooncake -- one engine, one segment name, one set of listeners, registered memory
usable by both -- against a real `kvferry master` and a serving client in another process.
Every value read is checked."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kvferry.mooncake.engine import TransferEngine
from kvferry.mooncake.store import MooncakeDistributedStore, ReplicateConfig
from test_store import cluster, value  # noqa: F401 - the fixture is used by name

HOST = "127.0.0.1"
SEG = 16 << 20


def engine() -> TransferEngine:
    te = TransferEngine()
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    return te


def shared_store(te: TransferEngine, addr: str, host: str = HOST, segment: int = SEG) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sharing is real now: no "starts its own engine" warning
        assert s.setup(host, "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", addr, te) == 0
    return s


def test_store_mounts_the_engines_own_segment(cluster):
    te = engine()
    native = te.get_engine()
    before = {r.addr for r in native.registered()}
    s = shared_store(te, cluster)
    try:
        name = "%s:%d" % (HOST, te.get_rpc_port())
        assert s.get_hostname() == name == native.segment_name, "one segment name: the engine's"
        # The store's segment is a buffer registered on the shared engine (no second engine).
        added = [r for r in native.registered() if r.addr not in before]
        assert SEG in [r.length for r in added], added
        # Values land in that segment and read back through the engine's listeners.
        v = value("mine", 200_000)
        assert s.put("mine", v, ReplicateConfig(preferred_segment=name)) == 0
        assert s.get("mine") == v
        descs = s.get_replica_desc("mine")
        assert [d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in descs] == [name]
        bd = descs[0].get_memory_descriptor().buffer_descriptor
        peer = engine()
        buf = peer.allocate_managed_buffer(len(v))
        assert peer.transfer_sync_read(name, buf, bd.buffer_address, len(v)) == 0
        assert peer.read_bytes_from_buffer(buf, len(v)) == v, "a peer reads the replica from the engine's segment"
        # Other values (other segments too) still work.
        keys = ["k%d" % i for i in range(8)]
        vals = [value(k, 4096 * (i + 1)) for i, k in enumerate(keys)]
        assert s.put_batch(keys, vals) == 0
        assert s.get_batch(keys) == vals
    finally:
        assert s.close() == 0


def test_memory_registered_on_either_serves_both(cluster):
    te = engine()
    s = shared_store(te, cluster)
    peer = engine()
    try:
        # Registered on the engine -> the store's zero-copy calls accept it.
        src = np.frombuffer(value("src", 1 << 20), dtype=np.uint8).copy()
        dst = np.zeros(1 << 20, dtype=np.uint8)
        assert te.register_memory(src.ctypes.data, src.nbytes) == 0
        assert te.register_memory(dst.ctypes.data, dst.nbytes) == 0
        assert s.put_from("zc", src.ctypes.data, src.nbytes) == 0
        assert s.get_into("zc", dst.ctypes.data, dst.nbytes) == src.nbytes
        assert bytes(dst) == bytes(src)
        # Registered through the store -> a peer engine writes into it via the shared engine.
        land = np.zeros(256 << 10, dtype=np.uint8)
        assert s.register_buffer(land.ctypes.data, land.nbytes) == 0
        payload = value("peer", land.nbytes)
        pbuf = peer.allocate_managed_buffer(land.nbytes)
        assert peer.write_bytes_to_buffer(pbuf, payload, land.nbytes) == 0
        assert peer.transfer_sync_write(s.get_hostname(), pbuf, land.ctypes.data, land.nbytes) == 0
        assert bytes(land) == payload, "the peer's bytes landed in the store client's registered buffer"
        # ... and the engine moves data out of it too.
        assert te.transfer_sync_write(peer_name(peer), land.ctypes.data, pbuf, land.nbytes) == 0
        assert s.unregister_buffer(land.ctypes.data) == 0
        assert te.unregister_memory(src.ctypes.data) == 0 and te.unregister_memory(dst.ctypes.data) == 0
    finally:
        assert s.close() == 0


def peer_name(te: TransferEngine) -> str:
    return "%s:%d" % (HOST, te.get_rpc_port())


def test_closing_the_store_leaves_the_engine_running(cluster):
    te = engine()
    native = te.get_engine()
    before = sorted((r.addr, r.length) for r in native.registered())
    s = shared_store(te, cluster)
    assert s.put("gone", b"with the segment", ReplicateConfig(preferred_segment=s.get_hostname())) == 0
    # Memory from the store's pool, registered through the store: freed with the store, so it
    # must leave the engine, which outlives the store, when the store closes.
    pooled = s.alloc_from_mem_pool(1 << 16)
    assert pooled and s.register_buffer(pooled, 1 << 16) == 0
    assert pooled in {r.addr for r in native.registered()}
    port = te.get_rpc_port()
    assert s.close() == 0
    assert sorted((r.addr, r.length) for r in native.registered()) == before, "the store's buffers, its pool's pages too, are withdrawn from the engine"
    assert te.get_rpc_port() == port and not native.closed
    # The engine still serves peers.
    mine = te.allocate_managed_buffer(4096)
    peer = engine()
    pbuf = peer.allocate_managed_buffer(4096)
    assert peer.write_bytes_to_buffer(pbuf, b"z" * 4096, 4096) == 0
    assert peer.transfer_sync_write(peer_name(te), pbuf, mine, 4096) == 0
    assert te.read_bytes_from_buffer(mine, 4096) == b"z" * 4096
    # A new store on the same engine mounts the same segment name again.
    s2 = shared_store(te, cluster)
    try:
        assert s2.get_hostname() == peer_name(te)
        assert s2.put("again", b"value") == 0 and s2.get("again") == b"value"
    finally:
        assert s2.close() == 0


def test_closing_the_engine_first_makes_store_calls_fail_clearly(cluster):
    import kvferry
    from kvferry.store import Store, StoreInvalidArgument

    eng = kvferry.Engine(HOST)
    st = Store(HOST, global_segment_size=SEG, master_server_addr=cluster, engine=eng)
    assert st.segment_name == eng.segment_name
    st.put("before", b"ok")
    eng.close()
    for call in (lambda: st.put("after", b"x"), lambda: st.get("before")):
        with pytest.raises(StoreInvalidArgument, match="shares was closed") as ei:
            call()
        assert ei.value.code == -600
    st.close()  # still unmounts cleanly
    # The same through Mooncake's API: error numbers, no crash.
    te = engine()
    s = shared_store(te, cluster)
    assert s.put("before", b"ok") == 0
    te.get_engine().close()
    assert s.put("after", b"x") == -600
    assert s.get("before") == b""
    assert s.close() == 0, "the store still closes (unmounts) cleanly"
    # Re-initializing the engine (Mooncake's way to replace it) closes the old one the same way.
    te = engine()
    s = shared_store(te, cluster)
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    assert s.put("after2", b"x") == -600
    assert s.close() == 0
    s = shared_store(te, cluster)
    try:
        assert s.get_hostname() == peer_name(te)
        assert s.put("fresh", b"engine") == 0 and s.get("fresh") == b"engine"
    finally:
        assert s.close() == 0


def test_local_hostname_must_name_the_engines_segment(cluster):
    te = engine()
    name = peer_name(te)
    for ok in (HOST, name):
        s = shared_store(te, cluster, host=ok)
        assert s.get_hostname() == name
        assert s.close() == 0
    for bad in ("127.0.0.2", "%s:%d" % (HOST, te.get_rpc_port() + 1)):
        s = MooncakeDistributedStore()
        assert s.setup(bad, "P2PHANDSHAKE", SEG, 16 << 20, "tcp", "", cluster, te) == -600, bad
        assert s.health_check() == 1
    uninit = TransferEngine()
    assert MooncakeDistributedStore().setup(HOST, "P2PHANDSHAKE", SEG, 16 << 20, "tcp", "", cluster, uninit) == -600
