"""kvferry.mooncake.store: the calls SGLang HiCache, vLLM's MooncakeStoreConnector and LMCache
make on Mooncake's MooncakeDistributedStore, made the way they make them (numpy buffers),
against a real `kvferry master` and a serving client in another process. Every value read is
checked."""

from __future__ import annotations

import importlib.util
import os
import threading
import warnings

import numpy as np
import pytest

import kvferry
from kvferry.mooncake import store as mcs
from kvferry.mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
from test_store import cluster, value  # noqa: F401 - the fixture is used by name

HOST = "127.0.0.1"


def client(addr, segment=16 << 20, local=16 << 20, **kw):
    s = MooncakeDistributedStore()
    assert s.setup(HOST, "P2PHANDSHAKE", segment, local, "tcp", "", addr, **kw) == 0
    return s


def _cpus(text):
    out = []
    for part in text.strip().split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1)) if part else []
    return out


def arr(key, n):
    return np.frombuffer(value(key, n), dtype=np.uint8).copy()


# -- the meta-path finder ----------------------------------------------------------------------

def test_find_spec_of_a_module_the_shim_does_not_serve_is_none():
    kvferry.install_mooncake_shim()
    try:
        assert importlib.util.find_spec("mooncake.store") is not None
        # A module of Mooncake 0.3.14's wheel that kvferry refuses: a spec whose loader raises the reason.
        assert importlib.util.find_spec("mooncake.structured_object_store") is not None
        assert importlib.util.find_spec("mooncake.kvferry_no_such_module") is None
        with pytest.raises(ModuleNotFoundError):
            import mooncake.kvferry_no_such_module  # noqa: F401
        import mooncake.store as ms

        assert ms.MooncakeDistributedStore is MooncakeDistributedStore and ms.bind_to_numa_node is mcs.bind_to_numa_node
        assert ms.ObjectDataType is mcs.ObjectDataType and ms.KVCACHE == 1 and ms.COMPLETE == 3 and ms.BufferHandle is mcs.BufferHandle
    finally:
        kvferry.uninstall_mooncake_shim()


# -- setup -------------------------------------------------------------------------------------

def test_setup_keyword_arguments_work_or_raise_type_error_naming_them():
    s = MooncakeDistributedStore()
    args = (HOST, "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", "127.0.0.1:1")
    with pytest.raises(TypeError, match="bogus_option"):
        s.setup(*args, bogus_option=1)
    with pytest.raises(TypeError, match="tenant_id"):
        s.setup(*args, tenant_id="team-a")
    with pytest.raises(TypeError, match="enable_client_http_server"):
        s.setup(*args, enable_client_http_server=True, client_http_port=9300)
    with pytest.raises(TypeError, match="TransferEngine"):
        s.setup(*args, object())
    assert s.health_check() == 1, "nothing was set up"


def test_setup_with_sglang_arguments_and_a_shared_engine(cluster):
    from kvferry.mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    s = MooncakeDistributedStore()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        rc = s.setup(HOST, "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", cluster, te.get_engine(),
                     enable_ssd_offload=False, ssd_offload_path="", tenant_id="default", enable_client_http_server=False, client_http_port=9300)
    assert rc == 0
    assert not [x for x in w if issubclass(x.category, RuntimeWarning)], "the engine is shared: nothing to warn about"
    assert s.get_hostname() == te.get_engine().segment_name, "the store's segment is the shared engine's (test_store_shared_engine.py)"
    assert s.put("e", b"engine") == 0 and s.get("e") == b"engine"
    assert s.close() == 0


def test_parse_size_matches_mooncake():
    p = mcs._parse_size
    assert p("16MB") == 16 << 20 and p("16 MB") == 16 << 20 and p(" 16 mb ") == 16 << 20
    assert p("1.5 GB") == 3 << 29 and p("4k") == 4096 and p("100") == 100 and p(100) == 100 and p("2T") == 2 << 40
    assert p("50%") is None and p("-1") is None and p("") is None and p("MB") is None and p("16 XB") is None


def test_setup_dict_accepts_human_readable_sizes(cluster):
    s = MooncakeDistributedStore()
    assert s.setup({"local_hostname": HOST, "metadata_server": "P2PHANDSHAKE", "master_server_addr": cluster,
                    "global_segment_size": "16MB", "local_buffer_size": "16 MB"}) == 0
    assert s.put("d", b"dict") == 0 and s.get("d") == b"dict"
    assert s.close() == 0
    bad = MooncakeDistributedStore()
    assert bad.setup({"local_hostname": HOST, "metadata_server": "P2PHANDSHAKE", "master_server_addr": cluster,
                      "global_segment_size": "50%"}) == -600
    assert bad.setup({"local_hostname": HOST, "metadata_server": "P2PHANDSHAKE", "master_server_addr": cluster,
                      "global_segment_size": "512"}) == -600, "below Mooncake's 1 KiB minimum"
    assert bad.health_check() == 1



# -- ReplicateConfig ---------------------------------------------------------------------------

def test_replicate_config_defaults_and_checks():
    c = ReplicateConfig()
    assert c.soft_pin_action is SoftPinAction.PRESERVE and c.soft_pin_ttl_ms is None
    assert c.group_ids is None and c.replica_num == 1 and c.preferred_segment == "" and c.preferred_segments == []
    for bad in (-1, 2 ** 64, 1.5, "5"):
        with pytest.raises(TypeError, match="soft_pin_ttl_ms"):
            c.soft_pin_ttl_ms = bad
    c.soft_pin_ttl_ms = 2 ** 64 - 1
    assert c.soft_pin_ttl_ms == 2 ** 64 - 1
    c.soft_pin_ttl_ms = np.uint64(7)
    assert c.soft_pin_ttl_ms == 7 and type(c.soft_pin_ttl_ms) is int
    with pytest.raises(TypeError, match="soft_pin_action"):
        c.soft_pin_action = 7
    with pytest.raises(TypeError, match="soft_pin_ttl_ms"):
        ReplicateConfig(soft_pin_ttl_ms=-1)
    assert ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=5)._native()[1:3] == (1, 5)
    assert ReplicateConfig(with_soft_pin=True)._native()[1] == 1, "older Mooncake's with_soft_pin means ENABLE"
    assert ReplicateConfig(group_ids=["g", "g"])._native()[5] == "g"


def test_ttl_without_enable_is_refused(cluster):
    s = client(cluster)
    try:
        assert s.put("t1", b"x", ReplicateConfig(soft_pin_ttl_ms=1000)) == -600
        assert s.put("t2", b"x", ReplicateConfig(soft_pin_action=SoftPinAction.DISABLE, soft_pin_ttl_ms=1000)) == -600
        assert s.is_exist("t1") == 0 and s.is_exist("t2") == 0
        assert s.put("t3", b"x", ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=1000)) == 0
        assert s.get("t3") == b"x"
        assert s.put("t4", b"x", ReplicateConfig(group_ids=["a", "b"])) == -600
    finally:
        s.close()


# -- SGLang HiCache ----------------------------------------------------------------------------

def test_sglang_hicache_sequence(cluster):
    s = client(cluster, 32 << 20, 16 << 20, engine=None)
    try:
        # startup warm-up
        assert s.put("warmup", b"x" * 4096) == 0 and s.is_exist("warmup") == 1 and s.get("warmup") == b"x" * 4096
        assert ReplicateConfig().group_ids is None
        # a host KV pool of two regions (k and v), registered separately
        layers, page = 4, 4096
        k_pool = np.zeros(layers * page * 8, dtype=np.uint8)
        v_pool = np.zeros_like(k_pool)
        assert s.register_buffer(k_pool.ctypes.data, k_pool.nbytes) == 0
        assert s.register_buffer(v_pool.ctypes.data, v_pool.nbytes) == 0
        for i in range(8):
            k_pool[i * layers * page:(i + 1) * layers * page] = arr("k%d" % i, layers * page)
            v_pool[i * layers * page:(i + 1) * layers * page] = arr("v%d" % i, layers * page)
        keys = ["p%d" % i for i in range(8)]
        assert s.batch_is_exist(keys) == [0] * 8
        # MHA: one key per page and k/v region: [k buffer, v buffer] -> two parts, not contiguous
        ptrs = [[k_pool.ctypes.data + i * layers * page, v_pool.ctypes.data + i * layers * page] for i in range(8)]
        sizes = [[layers * page, layers * page] for _ in range(8)]
        assert s.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * 8
        assert s.batch_put_from_multi_buffers(keys[:1], [[v_pool.ctypes.data, k_pool.ctypes.data]], sizes[:1]) == [0], "exists: kept"
        assert s.batch_is_exist(keys + ["absent"]) == [1] * 8 + [0]
        k_out, v_out = np.zeros_like(k_pool), np.zeros_like(v_pool)
        assert s.register_buffer(k_out.ctypes.data, k_out.nbytes) == 0
        assert s.register_buffer(v_out.ctypes.data, v_out.nbytes) == 0
        optrs = [[k_out.ctypes.data + i * layers * page, v_out.ctypes.data + i * layers * page] for i in range(8)]
        assert s.batch_get_into_multi_buffers(keys, optrs, sizes) == [2 * layers * page] * 8
        assert np.array_equal(k_out, k_pool) and np.array_equal(v_out, v_pool)
        # MLA: one contiguous buffer per key split in parts (zero-copy path)
        cptrs = [[k_pool.ctypes.data + i * layers * page + j * page for j in range(layers)] for i in range(2)]
        csizes = [[page] * layers for _ in range(2)]
        assert s.batch_put_from_multi_buffers(["mla0", "mla1"], cptrs, csizes, ReplicateConfig()) == [0, 0]
        k_out[:] = 0
        assert s.batch_get_into_multi_buffers(["mla0", "mla1"], [[k_out.ctypes.data + i * layers * page + j * page for j in range(layers)] for i in range(2)], csizes) == [layers * page] * 2
        assert np.array_equal(k_out[:2 * layers * page], k_pool[:2 * layers * page])
        # errors per key: missing, buffers smaller than the value, mismatched lists
        assert s.batch_get_into_multi_buffers(["absent"], [[k_out.ctypes.data]], [[page]]) == [-704]
        assert s.batch_get_into_multi_buffers(["p0", "mla0"], [[k_out.ctypes.data, v_out.ctypes.data], [k_out.ctypes.data]], [[page, page], [page]]) == [-600, -600]
        assert s.batch_put_from_multi_buffers(["x"], [[k_pool.ctypes.data]], [[page, page]]) == [-600]
        assert s.batch_put_from_multi_buffers(["x", "y"], [[k_pool.ctypes.data]], [[page]]) == [-600, -600]
        assert s.batch_put_from_multi_buffers([], [], []) == []
        # one contiguous buffer outside registered memory: gathered through staging, both ways
        # (it used to go down the zero-copy path and fail with -800)
        u_in, u_out = arr("unregistered", page), np.zeros(page, dtype=np.uint8)
        assert s.batch_put_from_multi_buffers(["ur"], [[u_in.ctypes.data]], [[page]]) == [0]
        assert s.batch_get_into_multi_buffers(["ur"], [[u_out.ctypes.data]], [[page]]) == [page]
        assert np.array_equal(u_out, u_in)
        # single-buffer batch calls
        assert s.batch_put_from(["b0", "b1"], [k_pool.ctypes.data, v_pool.ctypes.data], [page, page]) == [0, 0]
        assert s.batch_get_into(["b0", "b1"], [k_out.ctypes.data, v_out.ctypes.data], [page, page]) == [page, page]
        assert np.array_equal(k_out[:page], k_pool[:page]) and np.array_equal(v_out[:page], v_pool[:page])
        n = s.remove_all()
        assert n >= 0
        assert s.remove_all(force=True) + n == 8 + 2 + 2 + 1 + 1, "every key stored above is removed once"
        assert s.batch_is_exist(keys) == [0] * 8
    finally:
        assert s.close() == 0


def test_multi_buffer_gather_larger_than_half_the_local_buffer(cluster):
    """Gathered keys are staged in groups that fit; every value still comes back."""
    s = client(cluster, 32 << 20, 1 << 20)
    try:
        a = np.concatenate([arr("g%d" % i, 300_000) for i in range(6)])
        b = np.concatenate([arr("h%d" % i, 100_000) for i in range(6)])
        keys = ["g%d" % i for i in range(6)]
        ptrs = [[a.ctypes.data + i * 300_000, b.ctypes.data + i * 100_000] for i in range(6)]
        sizes = [[300_000, 100_000]] * 6
        assert s.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * 6
        a2, b2 = np.zeros_like(a), np.zeros_like(b)
        assert s.batch_get_into_multi_buffers(keys, [[a2.ctypes.data + i * 300_000, b2.ctypes.data + i * 100_000] for i in range(6)], sizes) == [400_000] * 6
        assert np.array_equal(a, a2) and np.array_equal(b, b2)
        # a key larger than half the local buffer goes through the scratch buffer
        big = [[a.ctypes.data, b.ctypes.data + 7]]
        assert s.batch_put_from_multi_buffers(["big"], big, [[a.nbytes, 300_000]]) == [0]
        a3, b3 = np.zeros_like(a), np.zeros_like(b)
        assert s.batch_get_into_multi_buffers(["big", "absent"], [[a3.ctypes.data, b3.ctypes.data], [a3.ctypes.data, b3.ctypes.data]], [[a.nbytes, 300_000]] * 2) == [a.nbytes + 300_000, -704]
        assert np.array_equal(a3, a) and np.array_equal(b3[:300_000], b[7:300_007])
        assert s.batch_get_into_multi_buffers(["big"], [[a3.ctypes.data, b3.ctypes.data]], [[a.nbytes, 1000]]) == [-600]
    finally:
        s.close()


def test_multi_buffers_without_a_local_buffer(cluster):
    """local_buffer_size=0 (nothing to stage through): scattered keys still work, from threads."""
    s = client(cluster, 0, 0)
    try:
        errors = []

        def work(t):
            try:
                x = arr("x%d" % t, 5000)
                y = arr("y%d" % t, 3000)
                assert s.batch_put_from_multi_buffers(["n%d" % t], [[x.ctypes.data, y.ctypes.data]], [[5000, 3000]]) == [0]
                x2, y2 = np.zeros_like(x), np.zeros_like(y)
                assert s.batch_get_into_multi_buffers(["n%d" % t], [[x2.ctypes.data, y2.ctypes.data]], [[5000, 3000]]) == [8000]
                assert np.array_equal(x, x2) and np.array_equal(y, y2)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors, errors
        assert s.remove_all(force=True) == 4
    finally:
        s.close()


# -- vLLM MooncakeStoreConnector ---------------------------------------------------------------

def test_vllm_store_connector_sequence_from_threads(cluster):
    provider = client(cluster, 32 << 20, 16 << 20)
    s = client(cluster, 0, 16 << 20)  # standalone-style: segment size 0
    try:
        cfg = ReplicateConfig()
        cfg.preferred_segment = provider.get_hostname()
        layers, blk = 3, 8192
        kv = [np.zeros(16 * blk, dtype=np.uint8) for _ in range(layers)]
        for li, region in enumerate(kv):
            assert s.register_buffer(region.ctypes.data, region.nbytes) == 0
            for b in range(16):
                region[b * blk:(b + 1) * blk] = arr("L%dB%d" % (li, b), blk)
        errors = []

        def work(t):
            try:
                keys = ["t%d-b%d" % (t, b) for b in range(4)]
                blocks = [t * 4 + b for b in range(4)]
                ptrs = [[kv[li].ctypes.data + bl * blk for li in range(layers)] for bl in blocks]
                sizes = [[blk] * layers for _ in blocks]
                assert s.batch_is_exist(keys) == [0] * 4
                assert s.batch_put_from_multi_buffers(keys, ptrs, sizes, cfg) == [0] * 4
                assert s.batch_is_exist(keys) == [1] * 4
                out = [np.zeros(4 * blk, dtype=np.uint8) for _ in range(layers)]
                for o in out:
                    assert s.register_buffer(o.ctypes.data, o.nbytes) == 0
                optrs = [[out[li].ctypes.data + j * blk for li in range(layers)] for j in range(4)]
                assert s.batch_get_into_multi_buffers(keys, optrs, sizes) == [layers * blk] * 4
                for li in range(layers):
                    assert np.array_equal(out[li], kv[li][t * 4 * blk:(t + 1) * 4 * blk])
                for o in out:
                    assert s.unregister_buffer(o.ctypes.data) == 0
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors, errors
        assert s.remove_all(force=True) == 16
    finally:
        assert s.close() == 0 and provider.close() == 0


# -- LMCache -----------------------------------------------------------------------------------

def test_lmcache_sequence(cluster):
    s = client(cluster)
    try:
        assert s.get_hostname().startswith(HOST)
        cfg = ReplicateConfig()
        cfg.replica_num = 1
        cfg.preferred_segment = s.get_hostname()
        meta = np.frombuffer(b"META" * 4, dtype=np.uint8)
        body = arr("body", 10_000)
        assert s.put_parts("obj", meta, memoryview(body), b"tail", config=cfg) == 0
        expect = meta.tobytes() + body.tobytes() + b"tail"
        assert s.get("obj") == expect
        assert s.put_parts("obj", b"other") == 0 and s.get("obj") == expect, "an existing key is kept (Mooncake's put)"
        assert s.upsert_parts("obj", b"new", b"value") == 0 and s.get("obj") == b"newvalue"
        assert s.put_parts("obj2", np.arange(4, dtype=np.uint32)) == 0
        assert s.get("obj2") == np.arange(4, dtype=np.uint32).tobytes()
        got = s.batch_get_buffer(["obj", "missing", "obj2"])
        assert got[1] is None
        assert bytes(memoryview(got[0])) == b"newvalue" and len(got[0]) == 8 and got[0].size() == 8 and got[0].ptr() != 0
        assert np.array_equal(np.frombuffer(got[2], dtype=np.uint32), np.arange(4, dtype=np.uint32))
        one = s.get_buffer("obj")
        assert bytes(one) == b"newvalue" and s.get_buffer("missing") is None
        # zero copy as LMCache does it: a registered staging buffer
        buf = np.zeros(1 << 16, dtype=np.uint8)
        assert s.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        src = arr("z", 5000)
        buf[:5000] = src
        assert s.put_from("z", buf.ctypes.data, 5000, cfg) == 0
        assert s.batch_put_from(["z1"], [buf.ctypes.data], [5000], cfg) == [0]
        buf[:] = 0
        assert s.batch_get_into(["z", "z1", "missing"], [buf.ctypes.data, buf.ctypes.data + 8192, buf.ctypes.data + 16384], [8192, 8192, 8192]) == [5000, 5000, -704]
        assert np.array_equal(buf[:5000], src) and np.array_equal(buf[8192:13192], src)
        assert s.get_into("z", buf.ctypes.data, 100) < 0, "a buffer smaller than the value is refused"
        assert s.is_exist("z") == 1 and s.batch_is_exist(["z", "missing"]) == [1, 0]
        assert s.batch_upsert_from(["z"], [buf.ctypes.data], [10]) == [0] and s.get_size("z") == 10
        assert s.upsert_batch(["u1", "u2"], [b"a", b"bb"]) == 0 and s.get_batch(["u1", "u2"]) == [b"a", b"bb"]
        assert s.unregister_buffer(buf.ctypes.data) == 0
        assert s.batch_remove(["z", "missing", "z1"], force=True) == [0, -704, 0]
        assert s.is_exist("z") == 0
        assert s.health_check() == 0
        before = os.sched_getaffinity(0)
        try:
            assert mcs.bind_to_numa_node(0) is None
            node0 = "/sys/devices/system/node/node0/cpulist"
            if os.path.exists(node0):
                with open(node0) as f:
                    now = os.sched_getaffinity(0)
                    assert now and now <= set(_cpus(f.read())), "the thread runs on node 0's CPUs only"
            assert mcs.bind_to_numa_node(4096) is None, "an absent node is a warning, as in Mooncake"
        finally:
            os.sched_setaffinity(0, before)
    finally:
        assert s.close() == 0
    assert s.health_check() == 1


def test_batch_replica_clear_clears_this_clients_unleased_objects(cluster):
    s = client(cluster)
    try:
        for k in ("c1", "c2", "c3"):
            assert s.put(k, k.encode() * 100) == 0
        # The writer's own objects nobody holds a lease on: cleared, then gone.
        assert sorted(s.batch_replica_clear(["c1", "c2", "missing"])) == ["c1", "c2"]
        assert s.batch_is_exist(["c1", "c2", "c3"]) == [0, 0, 1]
        assert s.get("c3") == b"c3" * 100
        # Another segment name clears nothing here.
        assert s.batch_replica_clear(["c3"], segment_name="no-such-segment:1") == []
        assert s.is_exist("c3") == 1
    finally:
        s.close()


def test_not_provided_names_say_so():
    s = MooncakeDistributedStore()
    assert s.get_replica_desc("k") == [] and s.batch_get_replica_desc(["k"]) == {}, "not set up: empty, as Mooncake's failures"
    with pytest.raises(AttributeError, match="not provided by kvferry"):
        s.put_tensor_with_parallelism  # noqa: B018  (after 0.3.14)
    with pytest.raises(AttributeError, match="no attribute"):
        s.no_such_method  # noqa: B018


# -- replica descriptors -----------------------------------------------------------------------

def test_replica_desc_says_where_the_bytes_are(cluster):
    s = client(cluster)
    v = value("rd", 100_000)
    assert s.put("rd", v, ReplicateConfig(replica_num=2)) == 0
    assert s.put("rd2", b"second") == 0
    descs = s.get_replica_desc("rd")
    assert len(descs) == 2, "two segments, two replicas: %r" % descs
    eps = set()
    with kvferry.Engine(HOST) as eng:
        for d in descs:
            assert isinstance(d, mcs.ReplicaDescriptor) and d.status == mcs.ReplicaStatus.COMPLETE and d.status == mcs.COMPLETE
            assert d.is_memory_replica() and not d.is_disk_replica() and not d.is_local_disk_replica()
            with pytest.raises(RuntimeError, match="memory replica"):
                d.get_disk_descriptor()
            md = d.get_memory_descriptor()
            assert isinstance(md, mcs.MemoryDescriptor)
            bd = md.buffer_descriptor
            assert isinstance(bd, mcs.Descriptor) and bd.size == len(v) and bd.buffer_address > 0
            assert "size=%d" % len(v) in repr(bd)
            eps.add(bd.transport_endpoint)
            # The descriptor is right: a transfer engine reads the value from there.
            buf = bytearray(bd.size)
            eng.register_memory(buf)
            eng.read(bd.transport_endpoint, buf, bd.buffer_address)
            assert bytes(buf) == v, "replica on %s" % bd.transport_endpoint
            eng.unregister_memory(buf)
    assert len(eps) == 2 and s.get_hostname() in eps, "one replica in this client's segment, one in the server's"

    m = s.batch_get_replica_desc(["rd", "missing", "rd2"])
    assert isinstance(m, dict) and sorted(m) == ["rd", "rd2"], "missing keys are left out, as in Mooncake"
    assert len(m["rd"]) == 2 and [d.get_memory_descriptor().buffer_descriptor.size for d in m["rd2"]] == [6]
    assert s.get_replica_desc("missing") == []
    assert s.batch_get_replica_desc([]) == {}
    # Listing replicas grants a read lease, as Mooncake's Query does: remove waits for it, or forces.
    assert s.remove("rd") == -706
    assert s.remove("rd", force=True) == 0 and s.get_replica_desc("rd") == []
    assert s.close() == 0
    assert s.get_replica_desc("rd2") == [] and s.batch_get_replica_desc(["rd2"]) == {}, "closed: empty, as Mooncake's failures"


def test_replica_descriptor_names_are_exported():
    for n in ("ReplicaDescriptor", "MemoryDescriptor", "DiskDescriptor", "Descriptor"):
        assert n in mcs.__all__
    d = mcs.Descriptor()
    assert (d.size, d.buffer_address, d.transport_endpoint) == (0, 0, "")
    dd = mcs.DiskDescriptor()
    assert (dd.file_path, dd.object_size) == ("", 0)


# -- BufferPool --------------------------------------------------------------------------------

def test_buffer_pool_leases_move_values_zero_copy(cluster):
    from kvferry.mooncake.buffer_pool import BufferPool, RegisteredBufferPool

    s = client(cluster, local=16 << 20)
    pool = BufferPool(s)
    assert RegisteredBufferPool is BufferPool and mcs.BufferPool is BufferPool
    a = pool.acquire(1 << 20)
    assert a.size == 1 << 20 and a.ptr % (8 << 20) == 0, "Mooncake's default alignment"
    data = value("bp", 1 << 20)
    mv = a.buffer
    assert len(mv) == 1 << 20 and not mv.readonly
    mv[:] = data
    with pytest.raises(RuntimeError, match="exported views"):
        a.release()
    del mv
    assert s.put_from("bp", a.ptr, a.size) == 0, "the lease is registered with the store"
    with pool.buffer(1 << 20) as b:
        assert s.get_into("bp", b.ptr, b.size) == 1 << 20
        assert bytes(b.buffer) == data
    with pytest.raises(RuntimeError, match="closed"):
        b.ptr  # noqa: B018
    assert s.get("bp") == data
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    a.release()
    a.release()  # twice is fine
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(10)
    assert s.close() == 0


def test_buffer_pool_budget_blocks_fails_or_times_out(cluster):
    from kvferry.mooncake.buffer_pool import BufferPool

    s = client(cluster, local=4 << 20)
    pool = BufferPool(s, max_bytes=1 << 20, alignment=4096)  # raised to the local buffer, 4 MiB
    with pytest.raises(RuntimeError, match="exceeds pool capacity"):
        pool.acquire(5 << 20)
    big = pool.acquire(3 << 20)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(2 << 20, block=False)
    with pytest.raises(RuntimeError, match="timed out"):
        pool.acquire(2 << 20, timeout=0.05)
    small = pool.acquire(1 << 20, block=False)  # what is left fits
    small.release()
    t = threading.Timer(0.2, big.release)
    t.start()
    got = pool.acquire(2 << 20, timeout=10)  # waits for the release
    t.join()
    assert got.size == 2 << 20
    got.release()
    counted = BufferPool(s, max_regions=1, block_on_exhaustion=False)
    one = counted.acquire(100)
    with pytest.raises(RuntimeError, match="exhausted"):
        counted.acquire(100)
    del one  # dropping a lease gives it back
    counted.acquire(100).release()
    pool.close()
    counted.close()
    assert s.close() == 0


def test_buffer_pool_needs_a_store_with_a_local_buffer(cluster):
    from kvferry.mooncake.buffer_pool import BufferPool

    with pytest.raises(RuntimeError, match="not initialized"):
        BufferPool(MooncakeDistributedStore())
    s = client(cluster, local=0)
    with pytest.raises(RuntimeError, match="local buffer"):
        BufferPool(s)
    s.close()
    s = client(cluster)
    with pytest.raises(RuntimeError, match="power of two"):
        BufferPool(s, alignment=3000)
    with pytest.raises(TypeError):
        BufferPool(s, max_bytes=-1)
    assert s.close() == 0


def test_get_into_ranges_copies_each_range(cluster):
    s = client(cluster)
    v1, v2 = value("gr1", 10000), value("gr2", 5000)
    assert s.put("gr1", v1) == 0 and s.put("gr2", v2) == 0
    a = np.zeros(8192, dtype=np.uint8)
    b = np.zeros(16384, dtype=np.uint8)
    for buf in (a, b):
        assert s.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    res = s.get_into_ranges(
        [a.ctypes.data, b.ctypes.data],
        [["gr1", "gr2"], ["gr1", "missing"]],
        [[[0, 100], [2000]], [[0, 10000], [0]]],
        [[[100, 9000], [0]], [[0, 9990], [0]]],
        [[[50, 1000], [5000]], [[10000, 20], [10]]],
    )
    assert res == [[[50, 1000], [5000]], [[10000, -600], [-704]]]
    assert a[:50].tobytes() == v1[100:150] and a[100:1100].tobytes() == v1[9000:10000] and a[2000:7000].tobytes() == v2
    assert a[50:100].tobytes() == bytes(50), "nothing else written"
    assert b[:10000].tobytes() == v1 and b[10000:].tobytes() == bytes(6384), "the failed range wrote nothing"
    assert s.get_into_ranges([a.ctypes.data], [["gr1"]], [[[0]]], [[[0]]], []) == [[[-600]]], "mismatched lists"
    assert s.get_into_ranges([], [], [], [], []) == []
    for buf in (a, b):
        assert s.unregister_buffer(buf.ctypes.data) == 0
    assert s.close() == 0


def test_registered_scattered_buffers_move_without_a_copy(cluster):
    """vLLM's shape: one value per block made of per-layer regions of a registered KV cache.
    They go straight into the replica and back (no staging: the scratch buffer is never made,
    even with no local buffer), and come back exactly, split differently."""
    s = client(cluster, 0, 0)
    try:
        layers, part = 8, 16 << 10
        kv = np.zeros(layers * 4 * part, dtype=np.uint8)
        assert s.register_buffer(kv.ctypes.data, kv.nbytes) == 0
        want = {}
        ptrs = []
        for b in range(4):
            v = arr("blk%d" % b, layers * part)
            want["blk%d" % b] = v
            for l in range(layers):
                at = (l * 4 + b) * part  # interleaved: block b's layers are never adjacent
                kv[at:at + part] = v[l * part:(l + 1) * part]
            ptrs.append([kv.ctypes.data + (l * 4 + b) * part for l in range(layers)])
        keys = list(want)
        assert s.batch_put_from_multi_buffers(keys, ptrs, [[part] * layers] * 4) == [0] * 4
        assert s._scratch_buf is None, "no staging for registered buffers"
        out = np.zeros_like(kv)
        assert s.register_buffer(out.ctypes.data, out.nbytes) == 0
        # Read back in two halves per block, into the other buffer.
        half = layers * part // 2
        optrs = [[out.ctypes.data + b * 2 * half + half, out.ctypes.data + b * 2 * half] for b in range(4)]
        assert s.batch_get_into_multi_buffers(keys, optrs, [[half, half]] * 4) == [layers * part] * 4
        assert s._scratch_buf is None
        for b, k in enumerate(keys):
            got = np.concatenate([out[b * 2 * half + half:(b + 1) * 2 * half], out[b * 2 * half:b * 2 * half + half]])
            assert np.array_equal(got, want[k]), k
        # Too small: refused per key, nothing written.
        out[:] = 0
        assert s.batch_get_into_multi_buffers(keys[:1], [[out.ctypes.data, out.ctypes.data + half]], [[half, 100]]) == [-600]
        assert not out.any()
    finally:
        s.close()
