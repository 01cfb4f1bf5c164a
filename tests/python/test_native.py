"""kvferry.Engine, the native API: every method, buffer objects, typed exceptions."""

from __future__ import annotations

import array
import json
import mmap
import socket
import struct
import threading
import time

import pytest

from conftest import HOST, Buf, pattern_bytes, wait_for

import numpy as np  # installed by scripts/python-test


# -- identity and lifecycle ---------------------------------------------------------------------

def test_identity(pair, kv):
    a, b = pair
    assert a.segment_name == "%s:%d" % (HOST, a.rpc_port)
    assert 1024 <= a.rpc_port <= 65535 and 1024 <= a.data_port <= 65535
    assert a.rpc_port != b.rpc_port
    assert a.transfer_timeout > 0
    assert not a.closed
    assert a.segment_name in repr(a)
    assert kv.__version__
    # cuda: True only where the CUDA driver is usable (never on the CI host).
    assert kv.features()["cuda"] in (True, False) and kv.features()["tcp"] is True
    # GPUDirect RDMA needs both GPU memory and RDMA.
    f = kv.features()
    assert f["gpu_rdma"] in (True, False) and (not f["gpu_rdma"] or (f["cuda"] and f["rdma"])), f


def test_host_port_and_config_errors(kv):
    with kv.Engine(HOST + ":1") as e:  # the port part is ignored in P2P mode, as in Mooncake
        assert e.segment_name.startswith(HOST + ":")
    with pytest.raises(kv.KvferryError, match="etcd"):
        kv.Engine(HOST, "etcd://127.0.0.1:1")  # unsupported or unreachable: either way it says so
    with pytest.raises(kv.ConfigError, match="bogus"):
        kv.Engine(HOST, "bogus://x")
    with pytest.raises(kv.ConfigError, match="not an address of this host"):
        kv.Engine("192.0.2.1")
    with pytest.raises(kv.InvalidArgument):
        kv.Engine(HOST, protocol="nvlink")
    with pytest.raises(kv.InvalidArgument):
        kv.Engine(5)  # type: ignore[arg-type]


def test_close_and_context_manager(kv):
    with kv.Engine(HOST) as e:
        addr = e.allocate_managed_buffer(4096)
        assert e.registered()[0].addr == addr
    assert e.closed and "closed" in repr(e)
    with pytest.raises(kv.EngineClosed):
        e.segment_name
    with pytest.raises(kv.EngineClosed) as ei:
        e.register_memory(bytearray(16))
    assert ei.value.code == -202
    e.close()  # idempotent


def test_close_releases_the_ports_before_it_returns(kv):
    """After close() no peer can reach the engine: both listeners are gone at once."""
    import socket

    e = kv.Engine(HOST)
    ports = (e.rpc_port, e.data_port)
    e.close()
    for p in ports:
        with socket.socket() as s:
            s.settimeout(2)
            with pytest.raises(OSError):
                s.connect((HOST, p))
    # The ports are free for a new listener right away (SO_REUSEADDR, as every server sets:
    # an old connection's TIME_WAIT must not count).
    for p in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((HOST, p))
            s.listen()


# -- registration -------------------------------------------------------------------------------

def test_register_buffer_objects(pair, kv):
    a, _ = pair
    ba = bytearray(4096)
    arr = np.zeros((16, 16), dtype=np.float64)
    mv = memoryview(bytearray(100))
    mm = mmap.mmap(-1, 8192)
    ar = array.array("i", [0] * 64)
    addrs = [a.register_memory(x) for x in (ba, arr, mv, mm, ar)]
    regs = {r.addr: r for r in a.registered()}
    assert regs[addrs[0]].length == 4096
    assert regs[addrs[1]].length == arr.nbytes
    assert addrs[1] == arr.__array_interface__["data"][0]
    assert regs[addrs[2]].length == 100
    assert regs[addrs[3]].length == 8192
    assert regs[addrs[4]].length == 64 * ar.itemsize
    assert all(r.location == "*" for r in regs.values())
    # A registered bytearray is pinned: it cannot be resized behind the engine's back.
    with pytest.raises(BufferError):
        ba.extend(b"x")
    a.unregister_memory(ba)
    ba.extend(b"x")  # released on unregister
    a.unregister_memory_batch([arr, addrs[2]])
    a.unregister_memory_batch([mm, ar])
    assert a.registered() == []


def test_register_address_and_batch(pair, kv):
    a, _ = pair
    b1, b2 = Buf(8192), Buf(8192)
    assert a.register_memory(b1.addr, 8192, "cpu:0") == b1.addr
    assert a.registered() == [kv.Region(b1.addr, 8192, "cpu:0")]
    assert a.register_memory_batch([b2.addr, bytearray(10)], [4096, None]) [0] == b2.addr
    with pytest.raises(kv.AddressOverlap) as ei:
        a.register_memory(b1.addr + 4096, 100)
    assert ei.value.code == -7
    with pytest.raises(kv.InvalidArgument) as ei:
        a.register_memory(b1.addr + 8192 * 4, 0)
    assert ei.value.code == -1 and "length 0" in str(ei.value)
    with pytest.raises(kv.InvalidArgument, match="location"):
        a.register_memory(bytearray(8), location="bogus")
    with pytest.raises(kv.AddressNotRegistered) as ei:
        a.unregister_memory(b1.addr + 8)
    assert ei.value.code == -3
    a.unregister_memory(b1.addr)
    a.unregister_memory(b2.addr)


@pytest.mark.parametrize(
    "args, match",
    [
        ((-1, 4096), ">= 0"),
        ((4096, -5), ">= 0"),
        ((2 ** 64, 16), "2\\*\\*64"),
        ((1.5, 16), "integer"),
        (("x",), "integer address or a writable buffer"),
        ((b"read-only",), "read-only"),
        ((memoryview(b"ro"),), "read-only"),
        ((12345,), "pass its length"),
        ((bytearray(8), 9), "exceeds"),
        ((True, 8), "bool"),
    ],
)
def test_register_bad_input(pair, kv, args, match):
    a, _ = pair
    with pytest.raises(kv.InvalidArgument, match=match) as ei:
        a.register_memory(*args)
    assert isinstance(ei.value, (TypeError, ValueError))  # InvalidArgument is both


def test_register_bad_numpy(pair, kv):
    a, _ = pair
    x = np.zeros((8, 8), dtype=np.uint8)
    with pytest.raises(kv.InvalidArgument, match="C-contiguous"):
        a.register_memory(x[:, ::2])
    ro = np.zeros(8)
    ro.setflags(write=False)
    with pytest.raises(kv.InvalidArgument, match="read-only"):
        a.register_memory(ro)
    with pytest.raises(kv.InvalidArgument, match="C-contiguous"):
        a.register_memory(np.asfortranarray(np.zeros((4, 4))))


def test_managed_buffer_view_and_bytes(pair, kv):
    a, _ = pair
    addr = a.allocate_managed_buffer(10000)
    assert addr % mmap.PAGESIZE == 0
    reg = [r for r in a.registered() if r.addr == addr][0]
    assert reg.length >= 10000 and reg.length % mmap.PAGESIZE == 0 and reg.location == "cpu:0"
    v = a.view(addr, 16)
    v[:5] = b"hello"
    assert a.read_bytes(addr, 5) == b"hello"
    a.write_bytes(addr + 5, b" world")
    assert bytes(v[:11]) == b"hello world"
    with pytest.raises(kv.InvalidArgument):
        a.view(addr + reg.length - 4, 16)
    with pytest.raises(kv.InvalidArgument, match="not mapped"):
        a.read_bytes(8, 4)
    with pytest.raises(kv.InvalidArgument, match="not mapped"):
        a.write_bytes(8, b"x")
    with pytest.raises(kv.InvalidArgument):
        a.read_bytes(addr, -1)
    del v
    a.free_managed_buffer(addr)
    assert all(r.addr != addr for r in a.registered())
    with pytest.raises(kv.InvalidArgument):
        a.free_managed_buffer(addr)


# -- segments and transfers ---------------------------------------------------------------------

def test_segment_buffers_and_open(pair, kv):
    a, b = pair
    dst = bytearray(4096)
    b.register_memory(dst)
    seg = a.open_segment(b.segment_name)
    assert isinstance(seg, int) and seg > 0
    assert a.open_segment(b.segment_name) == seg
    assert a.open_segment(a.segment_name) == 0
    bufs = a.segment_buffers(b.segment_name)
    assert [(r.length, r.location) for r in bufs] == [(4096, "*")]
    with pytest.raises(kv.SegmentNotFound) as ei:
        a.open_segment("127.0.0.1:1")
    assert ei.value.code == -200 and "127.0.0.1:1" in str(ei.value)
    assert isinstance(ei.value, LookupError)
    with pytest.raises(kv.SegmentNotFound, match="host>:<rpc port"):
        a.segment_buffers("nonsense")


def test_write_read_bytearray(pair):
    a, b = pair
    src = bytearray(pattern_bytes(0, 65536, 3))
    dst = bytearray(65536)
    a.register_memory(src)
    b.register_memory(dst)
    remote = a.segment_buffers(b.segment_name)[0].addr
    assert a.write(b.segment_name, src, remote) == 65536
    assert dst == src
    back = bytearray(65536)
    a.register_memory(back)
    assert a.read(b.segment_name, back, remote, 1000) == 1000
    assert back[:1000] == src[:1000] and back[1000:] == bytearray(64536)
    # transfer() with an explicit opcode and an integer address
    assert a.transfer(b.segment_name, a.registered()[0].addr, remote + 10, 6, opcode=0) == 6


def test_numpy_roundtrip(pair, kv):
    a, b = pair
    src = np.arange(1 << 16, dtype=np.float32)
    dst = np.zeros_like(src)
    a.register_memory(src)
    b.register_memory(dst)
    remote = a.segment_buffers(b.segment_name)[0].addr
    assert a.write(b.segment_name, src, remote) == src.nbytes
    np.testing.assert_array_equal(src, dst)
    out = np.empty((256, 256), dtype=np.float32)
    a.register_memory(out)
    a.read(b.segment_name, out, remote)
    np.testing.assert_array_equal(out.ravel(), src)
    # a contiguous slice of a registered array (its own address)
    half = src[: src.size // 2]
    assert a.write(b.segment_name, half, remote) == half.nbytes


def test_batch_write_read(pair, kv):
    a, b = pair
    n, blk = 32, 4096
    src = np.frombuffer(pattern_bytes(0, n * blk, 9), dtype=np.uint8).copy()
    dst = np.zeros(n * blk, dtype=np.uint8)
    a.register_memory(src)
    b.register_memory(dst)
    base_l = src.__array_interface__["data"][0]
    base_r = a.segment_buffers(b.segment_name)[0].addr
    locs = [base_l + i * blk for i in range(n)]
    rems = [base_r + i * blk for i in range(n)]
    assert a.batch_write(b.segment_name, locs, rems, [blk] * n) == n * blk
    assert dst.tobytes() == src.tobytes()
    src[:] = 0
    assert a.batch_read(b.segment_name, locs[:4], rems[:4], [blk] * 4) == 4 * blk
    assert src[: 4 * blk].tobytes() == dst[: 4 * blk].tobytes()
    assert a.batch_transfer(b.segment_name, [], [], []) == 0
    views = [bytearray(16), bytearray(16)]
    for v in views:
        a.register_memory(v)
    assert a.batch_read(b.segment_name, views, rems[:2]) == 32  # lengths default to the buffers' sizes
    with pytest.raises(kv.InvalidArgument, match="same number"):
        a.batch_write(b.segment_name, locs[:2], rems[:1], [blk, blk])
    with pytest.raises(kv.InvalidArgument, match="opcode"):
        a.batch_transfer(b.segment_name, locs[:1], rems[:1], [blk], opcode=7)


def test_transfer_errors_are_typed(pair, kv):
    a, b = pair
    src, dst = bytearray(4096), bytearray(4096)
    a.register_memory(src)
    b.register_memory(dst)
    seg = b.segment_name
    remote = a.segment_buffers(seg)[0].addr
    with pytest.raises(kv.AddressNotRegistered, match="local range") as ei:
        a.write(seg, Buf(4096).addr, remote, 16)
    assert ei.value.code == -3
    assert ei.value.cause == kv.FailCause.LOCAL_NOT_REGISTERED
    with pytest.raises(kv.AddressNotRegistered, match="remote range") as ei:
        a.write(seg, src, remote + 4096, 16)
    assert ei.value.cause == kv.FailCause.REMOTE_NOT_REGISTERED
    with pytest.raises(kv.AddressNotRegistered, match="remote range"):
        a.write(seg, src, remote + 1, 4096)
    with pytest.raises(kv.InvalidArgument, match="exceeds"):
        a.write(seg, src, remote, 4097)
    with pytest.raises(kv.SegmentNotFound):
        a.write("127.0.0.1:1", src, remote)
    with pytest.raises(kv.SegmentNotFound):
        a.write("", src, remote)
    with pytest.raises(kv.InvalidArgument):
        a.write(seg, src, -1)
    with pytest.raises(kv.InvalidArgument):
        a.write(seg, src, remote, timeout=-1)
    with pytest.raises(kv.InvalidArgument):
        a.write(None, src, remote)  # type: ignore[arg-type]
    with pytest.raises(kv.InvalidArgument):
        a.batch_write(seg, ["x"], [remote], [4])
    with pytest.raises(kv.InvalidArgument):
        a.batch_write(seg, [1], [remote], [2 ** 64])
    assert a.write(seg, src, remote, 0) == 0


def test_a_cluster_key_guards_the_handshake_and_the_data_port(kv, tmp_path, monkeypatch):
    """KVFERRY_AUTH_KEY_FILE set where two engines start: they move bytes as before; an engine
    started without it cannot open the keyed engine's segment, nor the keyed engine its own,
    each told what to set, and nothing lands."""
    key = tmp_path / "cluster.key"
    key.write_text("k" * 64 + "\n")
    # A key others may read is refused, naming the fix.
    key.chmod(0o644)
    monkeypatch.setenv("KVFERRY_AUTH_KEY_FILE", str(key))
    with pytest.raises(Exception, match="chmod 600"):
        kv.Engine(HOST)
    key.chmod(0o600)
    a, b = kv.Engine(HOST), kv.Engine(HOST)
    monkeypatch.delenv("KVFERRY_AUTH_KEY_FILE")
    c = kv.Engine(HOST)
    try:
        src, dst = bytearray(pattern_bytes(0, 65536, 7)), bytearray(65536)
        a.register_memory(src)
        b.register_memory(dst)
        remote = a.segment_buffers(b.segment_name)[0].addr
        assert a.write(b.segment_name, src, remote) == 65536
        assert dst == src
        back = bytearray(65536)
        a.register_memory(back)
        a.read(b.segment_name, back, remote)
        assert back == src
        theirs = bytearray(65536)
        c.register_memory(theirs)
        with pytest.raises(kv.PeerUnreachable, match="KVFERRY_AUTH_KEY_FILE") as ei:
            c.write(b.segment_name, theirs, remote)
        assert ei.value.code == -104
        with pytest.raises(kv.PeerUnreachable, match="cluster key"):
            a.segment_buffers(c.segment_name)
        assert dst == src, "nothing of the engine without the key landed"
        assert kv.FailCause.UNAUTHORIZED == 9
    finally:
        for e in (a, b, c):
            e.close()


# -- async batches ------------------------------------------------------------------------------

def test_submit_poll_wait_free(pair, kv):
    a, b = pair
    n, blk = 64, 16384
    src = bytearray(pattern_bytes(0, n * blk, 5))
    dst = bytearray(n * blk)
    a.register_memory(src)
    b.register_memory(dst)
    base_l = a.registered()[0].addr
    base_r = a.segment_buffers(b.segment_name)[0].addr
    batch = a.submit_write(b.segment_name, [base_l + i * blk for i in range(n)], [base_r + i * blk for i in range(n)], [blk] * n)
    assert batch.size == n and batch.segment == b.segment_name and str(batch.id) in repr(batch)
    st = wait_for(lambda: batch.status().done, timeout=10) and batch.status()
    assert st.ok and st.status == kv.TaskStatus.COMPLETED and st.transferred_bytes == n * blk
    assert batch.task_status(0).ok and batch.task_status(n - 1).transferred_bytes == blk
    with pytest.raises(kv.InvalidArgument):
        batch.task_status(n)
    assert batch.wait().ok
    batch.free()
    assert dst == src
    with pytest.raises(kv.InvalidArgument):  # freed
        batch.status()
    # read with a context manager; buffers given as objects are kept alive by the batch
    back = bytearray(blk)
    a.register_memory(back)
    with a.submit_read(b.segment_name, [back], [base_r]) as rb:
        assert rb.wait(5).transferred_bytes == blk
    assert back == dst[:blk]


def test_submit_failed_task(pair, kv):
    a, b = pair
    src, dst = bytearray(4096), bytearray(4096)
    a.register_memory(src)
    b.register_memory(dst)
    remote = a.segment_buffers(b.segment_name)[0].addr
    batch = a.submit(b.segment_name, [src, src], [remote, remote + (1 << 30)], [16, 16], kv.Opcode.WRITE)
    st = batch.wait(check=False)
    assert st.status == kv.TaskStatus.FAILED and "remote range" in st.reason
    assert st.cause is kv.FailCause.REMOTE_NOT_REGISTERED
    with pytest.raises(kv.AddressNotRegistered) as ei:
        batch.wait()
    assert ei.value.cause == kv.FailCause.REMOTE_NOT_REGISTERED
    assert batch.task_status(1).status == kv.TaskStatus.FAILED
    wait_for(lambda: batch.task_status(0).done)
    batch.free()
    with pytest.raises(kv.SegmentNotFound):
        a.submit("127.0.0.1:1", [src], [remote], [16])


def test_batch_busy(kv, monkeypatch):
    """A batch with a request in flight to a stalled peer cannot be freed; it times out."""
    monkeypatch.setenv("KVFERRY_TRANSFER_TIMEOUT", "1")
    with kv.Engine(HOST) as a, _StalledPeer(a) as peer:
        src = bytearray(4096)
        a.register_memory(src)
        batch = a.submit_write(peer.segment, [src], [peer.remote_addr], [4096])
        with pytest.raises(kv.BatchBusy) as ei:
            batch.free()
        assert ei.value.code == -4
        t0 = time.monotonic()
        with pytest.raises(kv.TransferTimeout) as ei:
            batch.wait(10)
        assert isinstance(ei.value, TimeoutError)
        assert ei.value.cause == kv.FailCause.TIMEOUT
        assert time.monotonic() - t0 < 8
        wait_for(lambda: batch.status().done)
        batch.release()


def test_sync_timeout(kv, monkeypatch):
    monkeypatch.setenv("KVFERRY_TRANSFER_TIMEOUT", "1")
    with kv.Engine(HOST) as a, _StalledPeer(a) as peer:
        assert a.transfer_timeout == 1.0
        src = bytearray(4096)
        a.register_memory(src)
        t0 = time.monotonic()
        with pytest.raises(kv.TransferTimeout):
            a.write(peer.segment, src, peer.remote_addr)
        assert time.monotonic() - t0 < 8


def test_a_sync_call_of_several_requests_ends_at_its_timeout(kv, monkeypatch):
    """batch_transfer(timeout=...) of several requests raises TransferTimeout at its timeout,
    not at the engine's transfer timeout: each request's deadline is capped by it (before,
    only the wait was, and the call then waited for the requests' own deadlines)."""
    monkeypatch.setenv("KVFERRY_TRANSFER_TIMEOUT", "30")
    with kv.Engine(HOST) as a, _StalledPeer(a) as peer:
        src = bytearray(8192)
        a.register_memory(src)
        view = memoryview(src)
        t0 = time.monotonic()
        with pytest.raises(kv.TransferTimeout):
            a.batch_transfer(peer.segment, [view[:4096], view[4096:]], [peer.remote_addr, peer.remote_addr + 4096], [4096, 4096], kv.Opcode.WRITE, timeout=0.5)
        took = time.monotonic() - t0
        assert 0.4 < took < 5, took


class _StalledPeer:
    """A fake peer: answers the handshake with a descriptor whose TCP data port accepts
    connections and never replies, so transfers to it stall until their deadline."""

    def __init__(self, engine):
        self.data = socket.socket()
        self.data.bind((HOST, 0))
        self.data.listen(16)
        self.hs = socket.socket()
        self.hs.bind((HOST, 0))
        self.hs.listen(16)
        self.segment = "%s:%d" % (HOST, self.hs.getsockname()[1])
        self.remote_addr = 0x10000000
        # Mooncake's fields only: kvferry's own extensions (e.g. the same-host shared-memory
        # path) would let the engine bypass the stalled TCP port.
        desc = {k: v for k, v in json.loads(_fetch_descriptor(engine)).items() if not k.startswith("kvferry")}
        desc["name"] = self.segment
        desc["tcp_data_port"] = self.data.getsockname()[1]
        desc["buffers"] = [{"name": "cpu:0", "addr": self.remote_addr, "length": 1 << 20, "rkey": [], "lkey": []}]
        self.desc = json.dumps(desc).encode()
        self._conns = []
        self._stop = False
        self._threads = [threading.Thread(target=self._serve_hs, daemon=True), threading.Thread(target=self._serve_data, daemon=True)]
        for t in self._threads:
            t.start()

    def _serve_hs(self):
        while not self._stop:
            try:
                c, _ = self.hs.accept()
            except OSError:
                return
            try:
                n = struct.unpack("<Q", _recv_exact(c, 8))[0]
                kind = _recv_exact(c, n)[0]
                c.sendall(struct.pack("<Q", len(self.desc) + 1) + bytes([kind]) + self.desc)
                c.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            finally:
                c.close()

    def _serve_data(self):
        while not self._stop:
            try:
                c, _ = self.data.accept()
            except OSError:
                return
            self._conns.append(c)  # read nothing, answer nothing

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop = True
        for s in [self.hs, self.data] + self._conns:
            try:
                s.close()
            except OSError:
                pass


def _recv_exact(s, n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise OSError("closed")
        out += chunk
    return out


def _fetch_descriptor(engine) -> bytes:
    """Asks `engine`'s handshake port for its descriptor (Metadata message, type 1)."""
    s = socket.create_connection((HOST, engine.rpc_port), timeout=5)
    body = b"{}"
    s.sendall(struct.pack("<Q", len(body) + 1) + b"\x01" + body)
    n = struct.unpack("<Q", _recv_exact(s, 8))[0]
    payload = _recv_exact(s, n)
    s.close()
    return payload[1:]


# -- notifies and probes ------------------------------------------------------------------------

def test_notifies(pair, kv):
    a, b = pair
    assert b.get_notifies() == []
    a.send_notify(b.segment_name, "hello")
    a.send_notify(b.segment_name, "second", name="custom")
    got = []
    wait_for(lambda: got.extend(b.get_notifies()) or len(got) >= 2)
    assert got == [kv.Notify(a.segment_name, "hello"), kv.Notify("custom", "second")]
    # wait_notifies blocks until one arrives
    threading.Timer(0.2, lambda: a.send_notify(b.segment_name, "late")).start()
    t0 = time.monotonic()
    assert b.wait_notifies(5) == [kv.Notify(a.segment_name, "late")]
    assert time.monotonic() - t0 < 4
    assert b.wait_notifies(0.05) == []
    # a notify attached to a transfer
    src, dst = bytearray(64), bytearray(64)
    a.register_memory(src)
    b.register_memory(dst)
    a.write(b.segment_name, src, a.segment_buffers(b.segment_name)[0].addr, notify=kv.Notify("n", "done"))
    assert b.wait_notifies(5) == [kv.Notify("n", "done")]
    with pytest.raises(kv.PeerUnreachable) as ei:
        a.send_notify("127.0.0.1:1", "x")
    assert ei.value.code == -102


def test_probe_alive_and_dead(pair, kv):
    a, b = pair
    a.probe(b.segment_name)
    dead = kv.Engine(HOST)
    name = dead.segment_name
    dead.close()
    with pytest.raises(kv.PeerUnreachable) as ei:
        a.probe(name)
    assert ei.value.code == -102 and isinstance(ei.value, ConnectionError)
    with pytest.raises(kv.SegmentNotFound) as ei:
        a.probe("no-port-here")
    assert ei.value.code == -101
