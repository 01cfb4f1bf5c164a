"""Mooncake's standalone deployment shape: a store-client process (`kvferry store-client`,
Mooncake's `mooncake_client`) contributes the memory; processes on the same host call
`setup_dummy(mem_pool_size, local_buffer_size, "127.0.0.1:<port>")` and use the pool with
Mooncake's calls (the sequence of Mooncake's own test_dummy_client.py). Everything on 127.0.0.1."""

import ctypes
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvferry.mooncake.store import MooncakeDistributedStore
from test_store import Proc, start_master, value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def real_client():
    m = start_master()
    port = free_port()
    sc = Proc(["store-client", "--master_server_address=" + m.field("rpc="), "--global_segment_size=64MB", "--host=127.0.0.1", "--port=%d" % port],
              "KVFERRY_STORE_CLIENT")
    assert sc.field("dummy=") == "127.0.0.1:%d" % port
    yield "127.0.0.1:%d" % port, sc.field("segment=")
    sc.stop()
    m.stop()


def dummy(addr: str, local_buffer: int = 16 << 20) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    assert s.setup_dummy(3200 << 20, local_buffer, addr) == 0
    return s


def test_dummy_clients_share_the_store_clients_pool(real_client):
    addr, segment = real_client
    a, b = dummy(addr), dummy(addr)
    assert a.get_hostname() and a.get_hostname() != b.get_hostname(), "each dummy client is its own segment name"
    assert a.put("dk", value("dk", 200_000)) == 0
    assert b.get("dk") == value("dk", 200_000)
    assert b.is_exist("dk") == 1 and b.batch_is_exist(["dk", "nope"]) == [1, 0]
    desc = b.get_replica_desc("dk")
    assert desc and all(r.get_memory_descriptor().buffer_descriptor.transport_endpoint == segment for r in desc), "the value lives in the store-client's segment"
    # Mooncake's sequence: buffers from alloc_from_mem_pool, registered, batch put_from / get_into.
    n, size = 4, 64 << 10
    src = a.alloc_from_mem_pool(n * size)
    dst = b.alloc_from_mem_pool(n * size)
    assert src and dst and src % 4096 == 0
    assert a.register_buffer(src, n * size) == 0 and b.register_buffer(dst, n * size) == 0
    keys = ["dm-%d" % i for i in range(n)]
    for i, k in enumerate(keys):
        ctypes.memmove(src + i * size, value(k, size), size)
    assert a.batch_put_from(keys, [src + i * size for i in range(n)], [size] * n) == [0] * n
    assert b.batch_get_into(keys, [dst + i * size for i in range(n)], [size] * n) == [size] * n
    for i, k in enumerate(keys):
        assert ctypes.string_at(dst + i * size, size) == value(k, size), k
    assert a.batch_put_from(keys[:2], [src], [size]) != [0, 0], "mismatched lengths are refused"
    assert a.unregister_buffer(src) == 0 and b.unregister_buffer(dst) == 0
    assert a.remove_all(True) >= 0
    assert a.close() == 0 and b.close() == 0


def test_a_dummy_client_in_another_process_reads_what_this_one_put(real_client, tmp_path):
    addr, _ = real_client
    a = dummy(addr)
    assert a.put("xproc", value("xproc", 123_457)) == 0
    code = textwrap.dedent("""
        import sys
        from kvferry.mooncake.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup_dummy(1 << 30, 16 << 20, sys.argv[1]) == 0
        got = s.get("xproc")
        assert got == bytes((i * 7 + (sum(b"xproc") & 0xFF)) & 0xFF for i in range(123_457)), len(got)
        assert s.put("from-child", b"child was here") == 0
        assert s.close() == 0
        print("CHILD OK")
    """)
    out = subprocess.run([sys.executable, "-c", code, addr], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "CHILD OK" in out.stdout, out.stderr[-2000:]
    assert a.get("from-child") == b"child was here"
    assert a.remove("xproc", True) == 0 and a.remove("from-child", True) == 0
    assert a.close() == 0


def test_setup_dummy_fails_clearly_without_a_store_client():
    t0 = time.monotonic()
    s = MooncakeDistributedStore()
    assert s.setup_dummy(1 << 30, 16 << 20, "127.0.0.1:%d" % free_port()) == -1, "nothing listens there"
    # Something that is not a kvferry store-client's service: an HTTP server's refusal.
    srv = socket.create_server(("127.0.0.1", 0))
    def answer():
        c, _ = srv.accept()
        with c:
            c.recv(100)
            c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    t = threading.Thread(target=answer, daemon=True)
    t.start()
    assert s.setup_dummy(1 << 30, 16 << 20, "127.0.0.1:%d" % srv.getsockname()[1]) == -1
    t.join(10)
    srv.close()
    assert s.setup_dummy(1 << 30, 16 << 20, "no-port-here") == -1
    assert time.monotonic() - t0 < 15
    assert s.health_check() == 1, "not set up"
    assert s.alloc_from_mem_pool(4096) == 0, "no pool before setup"
