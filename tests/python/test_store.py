"""kvferry Store from Python: the native API (kvferry.store) and Mooncake's
MooncakeDistributedStore (kvferry.mooncake.store), against a real `kvferry master` and a
serving client in another process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvferry
from kvferry.mooncake.store import MooncakeDistributedStore
from kvferry.mooncake.store import ReplicateConfig as McReplicateConfig
from kvferry.store import (
    LeaseExpired,
    NoAvailableHandle,
    ObjectAlreadyExists,
    ObjectHasLease,
    ObjectNotFound,
    ReplicateConfig,
    Store,
    StoreError,
)

ROOT = Path(__file__).resolve().parents[2]


def kvferry_bin() -> str:
    # $KVFERRY_BIN, else the installed wheel's own `kvferry` command (the build under test),
    # else a binary built from source.
    wheel_cli = Path(sys.executable).parent / "kvferry"
    for c in (os.environ.get("KVFERRY_BIN", ""), wheel_cli, ROOT / "target" / "release" / "kvferry", ROOT / "target" / "debug" / "kvferry"):
        if c and Path(c).is_file():
            return str(c)
    subprocess.run(["cargo", "build", "--release", "-p", "kvferry-cli"], cwd=ROOT, check=True)
    return str(ROOT / "target" / "release" / "kvferry")


class Proc:
    def __init__(self, args, tag):
        self.p = subprocess.Popen([kvferry_bin()] + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.line = self.p.stdout.readline()
        assert self.line.startswith(tag), "%s expected, got %r" % (tag, self.line)

    def field(self, key):
        return next(w[len(key):] for w in self.line.split() if w.startswith(key))

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)


def start_master(*extra):
    return Proc(["master", "--port", "0", "--metrics-port", "-1", "--summary-interval", "0", *extra], "KVFERRY_MASTER")


@pytest.fixture()
def cluster():
    m = start_master()
    addr = m.field("rpc=")
    s = Proc(["store-bench", "--serve-segment", addr, "--segment-size", str(64 << 20)], "KVFERRY_STORE_SERVER")
    yield addr
    s.stop()
    m.stop()


def value(key: str, n: int) -> bytes:
    seed = sum(key.encode()) & 0xFF
    return bytes((i * 7 + seed) & 0xFF for i in range(n))


def test_native_bytes_api(cluster):
    with Store(master_server_addr=cluster, global_segment_size=0) as a, Store(master_server_addr=cluster, global_segment_size=16 << 20) as b:
        a.put("k", value("k", 100_000))
        assert b.get("k") == value("k", 100_000)
        with pytest.raises(ObjectAlreadyExists) as ei:
            a.put("k", b"x")
        assert ei.value.code == -705
        with pytest.raises(ObjectNotFound) as ei:
            a.get("nope")
        assert ei.value.code == -704 and isinstance(ei.value, KeyError)
        a.upsert("k", b"new value")
        assert b.get("k") == b"new value"
        assert a.get_size("k") == 9
        assert a.is_exist("k") and not a.is_exist("nope")
        assert a.batch_is_exist(["k", "nope"]) == [True, False]
        a.put_batch(["b1", "b2"], [value("b1", 4096), value("b2", 70000)], ReplicateConfig(replica_num=2))
        assert b.get_batch(["b1", "b2"]) == [value("b1", 4096), value("b2", 70000)]
        with pytest.raises(ObjectNotFound):
            a.get_batch(["b1", "missing"])
        with pytest.raises(kvferry.KvferryError):
            a.put("", b"x")
        with pytest.raises(StoreError) as ei:
            a.put("huge", bytes(100 << 20))  # larger than the local staging buffer
        assert "local_buffer_size" in str(ei.value)
        big = bytearray(100 << 20)
        a.register_buffer(big)
        with pytest.raises(NoAvailableHandle) as ei:
            a.put_from("huge", big)  # larger than any segment
        assert ei.value.code == -200 and "larger than any segment" in str(ei.value)


def test_native_zero_copy_with_buffers_and_numpy(cluster):
    with Store(master_server_addr=cluster, global_segment_size=0) as a, Store(master_server_addr=cluster, global_segment_size=0) as b:
        src = np.arange(1 << 18, dtype=np.uint32)  # 1 MiB
        dst = np.zeros_like(src)
        a.register_buffer(src)
        b.register_buffer(dst)
        a.put_from("arr", src)
        assert b.get_into("arr", dst) == src.nbytes
        assert np.array_equal(src, dst)
        ba = bytearray(value("x", 8192))
        out = bytearray(8192 * 2)
        a.register_buffer(ba)
        b.register_buffer(out)
        a.batch_put_from(["x0", "x1"], [memoryview(ba)[:4096], memoryview(ba)[4096:]])
        assert b.batch_get_into(["x0", "x1"], [memoryview(out)[:8192], memoryview(out)[8192:]]) == [4096, 4096]
        assert bytes(out[:4096]) == bytes(ba[:4096]) and bytes(out[8192:12288]) == bytes(ba[4096:])
        with pytest.raises(StoreError) as ei:
            b.get_into("arr", memoryview(out)[:100])
        assert ei.value.code == -10


def test_native_leases_and_removal(cluster):
    with Store(master_server_addr=cluster, global_segment_size=0) as a:
        a.put("l1", b"abc")
        a.get("l1")  # leased now
        with pytest.raises(ObjectHasLease):
            a.remove("l1")
        a.remove("l1", force=True)
        assert not a.is_exist("l1")
        for k in ("r1", "r2", "q1"):
            a.put(k, b"v")
        assert a.remove_by_regex("^r", force=True) == 2
        assert a.remove_all(force=True) == 1
        a.close()
        with pytest.raises(StoreError):
            a.get("q1")


def test_lease_expired_read_is_refused():
    m = start_master("--default-kv-lease-ttl", "1")
    addr = m.field("rpc=")
    s = Proc(["store-bench", "--serve-segment", addr, "--segment-size", str(64 << 20)], "KVFERRY_STORE_SERVER")
    try:
        with Store(master_server_addr=addr, global_segment_size=0, local_buffer_size=64 << 20) as a:
            a.put("big", bytes(32 << 20))
            with pytest.raises(LeaseExpired):
                a.get("big")
    finally:
        s.stop()
        m.stop()


def test_threads_share_one_store(cluster):
    with Store(master_server_addr=cluster, global_segment_size=0, local_buffer_size=64 << 20) as a:
        errors = []

        def work(t):
            try:
                for i in range(40):
                    k = "t%d-%d" % (t, i)
                    a.put(k, value(k, 4096 + i))
                    assert a.get(k) == value(k, 4096 + i)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors, errors


def test_bytes_gets_of_mixed_sizes_return_every_value_exactly():
    """get, get_batch and batch_get_buffer copy each value once out of the local buffer into
    the new object; a batch mixing sizes (more than 64 MiB in all: the call's copy is split
    among threads) with a missing key gives every found value byte for byte."""
    sizes = {"m-tiny": 100, "m-page": 4097, "m-mib": (1 << 20) + 5, "m-big": (40 << 20) + 4099, "m-big2": (24 << 20) + 1}

    def val(k, n):
        return np.random.default_rng(sum(k.encode())).integers(0, 256, n, dtype=np.uint8).tobytes()

    m = start_master()
    addr = m.field("rpc=")
    srv = Proc(["store-bench", "--serve-segment", addr, "--segment-size", str(160 << 20)], "KVFERRY_STORE_SERVER")
    try:
        with Store(master_server_addr=addr, global_segment_size=0, local_buffer_size=80 << 20) as a:
            for k, n in sizes.items():
                a.put(k, val(k, n))
            keys = list(sizes)
            for _ in range(2):  # the second round reads into memory the first one freed
                got = a.get_batch(keys)
                assert [len(g) for g in got] == [sizes[k] for k in keys]
                for k, g in zip(keys, got):
                    assert type(g) is bytes and g == val(k, sizes[k]), k
            for k in keys:
                assert a.get(k) == val(k, sizes[k]), k
            with pytest.raises(ObjectNotFound):
                a.get("m-missing")
        r = MooncakeDistributedStore()
        assert r.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "master_server_address": addr, "global_segment_size": 0, "local_buffer_size": 80 << 20}) == 0
        try:
            mixed = ["m-big", "m-missing", "m-tiny", "m-mib", "m-big2", "m-page"]
            got = r.get_batch(mixed)
            assert got == [b"" if k == "m-missing" else val(k, sizes[k]) for k in mixed]
            handles = r.batch_get_buffer(mixed)
            assert handles[1] is None
            for k, h in zip(mixed, handles):
                if h is not None:
                    assert bytes(memoryview(h)) == val(k, sizes[k]), k
        finally:
            r.close()
    finally:
        srv.stop()
        m.stop()


def test_mooncake_compatible_store(cluster):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", cluster) == 0
    r = MooncakeDistributedStore()
    assert r.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "master_server_address": cluster, "global_segment_size": 0}) == 0
    assert s.put("a", b"hello") == 0
    assert s.put("a", b"again") == 0, "as Mooncake: a put of an existing key succeeds and keeps the value"
    assert r.get("a") == b"hello"
    assert r.get("missing") == b""
    assert r.get_batch(["a", "missing"]) == [b"hello", b""]
    assert s.upsert("a", b"bye") == 0 and r.get("a") == b"bye"
    assert r.is_exist("a") == 1 and r.is_exist("missing") == 0
    assert r.batch_is_exist(["a", "missing"]) == [1, 0]
    assert r.get_size("a") == 3 and r.get_size("missing") == -704
    buf = np.zeros(1 << 16, dtype=np.uint8)
    src = np.frombuffer(value("z", 1 << 16), dtype=np.uint8).copy()
    assert s.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert r.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    assert s.put_from("z", src.ctypes.data, src.nbytes, McReplicateConfig(replica_num=1)) == 0
    assert r.get_into("z", buf.ctypes.data, buf.nbytes) == src.nbytes
    assert np.array_equal(buf, src)
    assert r.get_into("missing", buf.ctypes.data, buf.nbytes) == -704
    assert s.batch_put_from(["z1", "z2"], [src.ctypes.data, src.ctypes.data + 1024], [1024, 1024]) == [0, 0]
    assert r.batch_get_into(["z1", "missing"], [buf.ctypes.data, buf.ctypes.data + 1024], [1024, 1024]) == [1024, -704]
    assert r.remove("z1") == -706  # leased by the read above
    assert r.remove("z1", True) == 0
    assert r.remove_by_regex("^z", True) >= 1
    assert r.remove_all(True) >= 1
    assert r.close() == 0 and s.close() == 0
    bad = MooncakeDistributedStore()
    t = time.time()
    assert bad.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", "127.0.0.1:1") < 0
    assert time.time() - t < 15
    assert bad.put("x", b"y") < 0, "calls before a successful setup fail, they do not crash"


def test_a_cluster_key_is_proved_through_the_mooncake_and_native_apis(tmp_path, monkeypatch):
    """KVFERRY_AUTH_KEY_FILE in the environment: the master started with it serves
    MooncakeDistributedStore and Store set up with it, unchanged calls; without it, setup fails
    at once, saying what to set."""
    key = tmp_path / "cluster.key"
    key.write_text("# the cluster's key\n" + "k" * 64 + "\n")
    key.chmod(0o600)
    monkeypatch.setenv("KVFERRY_AUTH_KEY_FILE", str(key))
    m = start_master()
    try:
        addr = m.field("rpc=")
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", addr) == 0
        assert s.put("a", b"hello") == 0 and s.get("a") == b"hello"
        with Store(master_server_addr=addr, global_segment_size=0) as n:
            assert n.get("a") == b"hello"
        monkeypatch.delenv("KVFERRY_AUTH_KEY_FILE")
        t = time.time()
        bad = MooncakeDistributedStore()
        assert bad.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", addr) < 0
        with pytest.raises(StoreError, match="KVFERRY_AUTH_KEY_FILE"):
            Store(master_server_addr=addr, global_segment_size=0)
        assert time.time() - t < 10, "refused at once, not retried"
        assert s.close() == 0
    finally:
        m.stop()
