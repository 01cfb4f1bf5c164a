"""Issue 10 (Python side): the GIL while an engine is dropped, pins that outlive every task
of a batch, views that keep their memory, and engines inherited through fork()."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import warnings

import pytest

from conftest import HOST, wait_for
from test_store import cluster  # noqa: F401  (fixture: a master and a serving client)

MiB = 1 << 20


def _resizable(engine, buf: bytearray) -> bool:
    """True when nothing pins `buf` (a bytearray with a buffer export refuses to resize).
    Calls into the engine first, which frees released batches that have finished."""
    engine.registered()
    try:
        buf.extend(b"x")
    except BufferError:
        return False
    del buf[-1:]
    return True


def _has_test_hooks(kv):
    """Whether the extension was built with kvferry-python's `test-hooks` feature (the wheel
    scripts/python-test builds with KVFERRY_WHEEL_PROFILE=ci): only then is the hook's
    variable name in the library at all."""
    with open(kv._kvferry.__file__, "rb") as f:
        return b"KVFERRY_TEST_SLOW_DROP_MS" in f.read()


def test_drop_releases_the_gil(kv, monkeypatch):
    # The test hook makes dropping the engine take 400 ms (inside the section that runs
    # without the GIL); another Python thread must keep running meanwhile.
    if not _has_test_hooks(kv):
        pytest.skip("a release wheel has no test hooks: build with KVFERRY_WHEEL_PROFILE=ci scripts/python-test")
    monkeypatch.setenv("KVFERRY_TEST_SLOW_DROP_MS", "400")
    e = kv.Engine(HOST)
    e.register_memory(bytearray(4096))
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    t = threading.Thread(target=ticker, daemon=True)
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    del e
    gc.collect()
    t1 = time.monotonic()
    stop.set()
    t.join(5)
    assert t1 - t0 >= 0.35, "the drop hook did not run (%.3f s)" % (t1 - t0)
    during = [x for x in ticks if t0 < x < t1]
    assert len(during) >= 20, "only %d ticks of another thread during a %.0f ms drop: the GIL was held" % (len(during), (t1 - t0) * 1e3)


def _register_unpinned(engine, buf: bytearray) -> None:
    """Registers `buf` by integer address, so that the registration holds no pin of its own
    (the only pin is then the batch's). The test keeps `buf` alive."""
    from kvferry._buffers import address

    addr, keep = address(buf)
    del keep
    engine.register_memory(addr, len(buf))


class _HeldPeer:
    """A fake peer (the handshake of `test_native._StalledPeer`) whose data port receives each
    WRITE whole and answers OK only once `release` is set: a task to it stays in flight, for
    as long as the test wants, however fast the machine is."""

    def __init__(self, engine):
        from test_native import _StalledPeer

        self.release = threading.Event()
        self.received = []
        peer = _StalledPeer.__new__(_StalledPeer)
        peer._serve_data = self._serve_data  # the data side is ours
        self.peer = peer  # before __init__ starts the serving threads
        _StalledPeer.__init__(peer, engine)
        self.segment, self.remote_addr = peer.segment, peer.remote_addr

    def _serve_data(self):
        import struct

        from test_native import _recv_exact

        ok = struct.pack("<Q", 0x4D435456 << 32)  # v2 status frame: magic, status 0 (OK)
        while not self.peer._stop:
            try:
                c, _ = self.peer.data.accept()
            except OSError:
                return
            self.peer._conns.append(c)

            def serve(c=c):
                try:
                    while True:
                        size, _addr, _op = struct.unpack("<QQB7x", _recv_exact(c, 24))
                        self.received.append(_recv_exact(c, size))
                        if not self.release.wait(60):
                            return
                        c.sendall(ok)
                except OSError:
                    return

            threading.Thread(target=serve, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.peer.__exit__(*exc)


def _held_batch(kv, a, peer):
    """A batch whose task 1 fails at once (a remote range the peer does not publish) while
    task 0 (a 1 MiB WRITE) is held in flight by `peer` until `peer.release` is set."""
    buf = bytearray(bytes(range(256)) * (MiB // 256))
    small = bytearray(16)
    _register_unpinned(a, buf)
    _register_unpinned(a, small)
    bad = peer.remote_addr + (64 * MiB)  # outside the peer's 1 MiB buffer
    batch = a.submit(peer.segment, [buf, small], [peer.remote_addr, bad], [MiB, 16])
    assert wait_for(lambda: batch.task_status(1).done, 10)
    assert batch.task_status(1).status == kv.TaskStatus.FAILED
    assert not batch.task_status(0).done, "task 0 ended while its peer held it"
    return batch, buf


@pytest.fixture
def tcp_engine(kv, monkeypatch):
    monkeypatch.setenv("KVFERRY_TRANSPORT", "tcp")
    a = kv.Engine(HOST)
    yield a
    a.close()


def test_batch_pins_held_until_every_task_is_terminal(kv, tcp_engine):
    a = tcp_engine
    with _HeldPeer(a) as peer:
        batch, buf = _held_batch(kv, a, peer)
        sent = bytes(buf)
        # The failed sibling does not make the batch terminal while task 0 still runs.
        st = batch.status()
        assert not st.done, "batch reported %s while task 0 is in flight" % (st,)
        # Releasing it early (as `with a.submit(...)` does on an exception) must not release
        # the pin of task 0's buffer: the engine refuses to free a busy batch.
        assert not a._core.release_batch(batch.id), "a batch with a task in flight was freed"
        batch._released = True
        with pytest.raises(BufferError):
            buf.extend(b"x")
        time.sleep(0.2)
        with pytest.raises(BufferError):
            buf.extend(b"x")
        # Once task 0 is terminal the pin goes.
        peer.release.set()
        assert wait_for(lambda: _resizable(a, buf), 30, 0.05), "pin never released"
        assert peer.received == [sent]


def test_batch_wait_waits_for_every_task(kv, tcp_engine):
    a = tcp_engine
    with _HeldPeer(a) as peer:
        batch, buf = _held_batch(kv, a, peer)
        threading.Timer(0.5, peer.release.set).start()
        t0 = time.monotonic()
        st = batch.wait(60, check=False)
        assert time.monotonic() - t0 >= 0.4, "wait() returned before task 0 was released"
        assert st.status == kv.TaskStatus.FAILED
        assert batch.task_status(0).done, "wait() returned while task 0 was in flight"
        assert batch.task_status(0).status == kv.TaskStatus.COMPLETED
        batch.free()  # every task terminal: no BatchBusy
        assert _resizable(a, buf)


@pytest.fixture
def tcp_pair(kv, monkeypatch):
    # TCP with one lane: the large task takes long enough to be seen in flight.
    monkeypatch.setenv("KVFERRY_TRANSPORT", "tcp")
    monkeypatch.setenv("KVFERRY_TCP_LANES", "1")
    a, b = kv.Engine(HOST), kv.Engine(HOST)
    yield a, b
    a.close()
    b.close()


def test_sync_transfer_returns_after_every_task(kv, tcp_pair):
    a, b = tcp_pair
    size = 256 * MiB
    buf = bytearray(bytes(range(256)) * (size // 256))
    small = bytearray(16)
    _register_unpinned(a, buf)
    _register_unpinned(a, small)
    remote = b.allocate_managed_buffer(size)
    with pytest.raises(kv.AddressNotRegistered):
        a.batch_write(b.segment_name, [buf, small], [remote, remote + size + (1 << 30)], [size, 16], timeout=120)
    # The large sibling had landed before the call returned (and the pin was dropped).
    assert _resizable(a, buf)
    assert b.read_bytes(remote + size - 4096, 4096) == bytes(buf[-4096:])


def test_view_keeps_its_memory(kv, pair):
    a, _ = pair
    addr = a.allocate_managed_buffer(4096)
    v = a.view(addr, 16)
    v[:5] = b"hello"
    with pytest.raises(BufferError):
        a.free_managed_buffer(addr)
    del v
    gc.collect()
    a.free_managed_buffer(addr)

    # A registered buffer object stays pinned while a view of it exists, even unregistered.
    ba = bytearray(4096)
    a.register_memory(ba)
    from kvferry._buffers import address

    start = address(ba)[0]
    v = a.view(start, 16)
    a.unregister_memory(ba)
    with pytest.raises(BufferError):
        ba.extend(b"x")
    v[:3] = b"abc"
    assert bytes(ba[:3]) == b"abc"
    del v
    gc.collect()
    ba.extend(b"x")


def test_close_leaves_viewed_managed_memory_mapped(kv):
    a = kv.Engine(HOST)
    addr = a.allocate_managed_buffer(4096)
    v = a.view(addr, 4096)
    v[:3] = b"xyz"
    a.close()
    assert bytes(v[:3]) == b"xyz"  # still mapped: no crash
    v[4095] = 7
    del v, a
    gc.collect()


def _fork(child):
    """Forks; the child runs `child()` and exits 0 if it returned True, else 1 (never
    returns). Returns the child's exit status, killing it after 30 s."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if child() else 1
        except BaseException:
            code = 2
        finally:
            os._exit(code)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the fork() child hung")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_child_cannot_use_or_break_the_parents_engine(kv):
    a, b = kv.Engine(HOST), kv.Engine(HOST)
    try:
        size = 1 * MiB
        addr = a.allocate_managed_buffer(size)
        data = bytes(range(256)) * (size // 256)
        a.write_bytes(addr, data)
        v = a.view(addr, 16)
        src = b.allocate_managed_buffer(4096)
        b.write_bytes(src, b"\xab" * 4096)

        def child():
            nonlocal a, b, v
            ok = True
            for call in (lambda: a.segment_name, lambda: a.registered(), lambda: a.read_bytes(addr, 16), lambda: a.close()):
                try:
                    call()
                    ok = False  # must raise
                except kv.EngineClosed as e:
                    ok = ok and "belongs to process %d" % os.getppid() in str(e)
            try:
                v[0]
                ok = False  # views of the parent's managed memory are released in the child
            except ValueError:
                pass
            ok = ok and "inherited" in repr(a)
            del a, b, v
            gc.collect()
            return ok

        assert _fork(child) == 0, "the child's copies did not raise the expected error"
        # The parent's memory, listener and transfers are intact.
        assert a.read_bytes(addr, size) == data
        assert bytes(v[:16]) == data[:16]
        b.probe(a.segment_name)
        assert b.write(a.segment_name, src, addr + 4096, 4096) == 4096
        assert a.read_bytes(addr + 4096, 4096) == b"\xab" * 4096
        c = kv.Engine(HOST)
        try:
            assert any(r.addr == addr for r in c.segment_buffers(a.segment_name))
        finally:
            c.close()
        del v
    finally:
        a.close()
        b.close()


def _socket_inodes(ports):
    """Inodes of the TCP sockets whose local port is in `ports` (/proc/net/tcp, tcp6)."""
    out = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(f) as fh:
            for line in fh.readlines()[1:]:
                w = line.split()
                if len(w) >= 10 and int(w[1].rsplit(":", 1)[1], 16) in ports and w[9] != "0":
                    out.add(w[9])
    return out


def _fds_on(inodes):
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            n += 1
    return n


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_child_lets_go_of_the_parents_sockets_at_once(kv):
    """Right after fork() (the package's at-fork handler), with the engine object still
    referenced, the child holds none of the parent engine's listening sockets: once the parent
    is gone its ports refuse connections, whatever the child goes on doing."""
    a = kv.Engine(HOST)
    try:
        inodes = _socket_inodes({a.rpc_port, a.data_port})
        held = _fds_on(inodes)
        assert held >= 2, "the parent holds its two listeners: %d descriptors on %s" % (held, inodes)

        def child():
            return _fds_on(inodes) == 0 and "inherited" in repr(a)

        assert _fork(child) == 0, "the child still held the parent's listening sockets after fork()"
        assert _fds_on(inodes) == held
        b = kv.Engine(HOST)
        try:
            b.probe(a.segment_name)  # the parent's handshake port still answers
        finally:
            b.close()
    finally:
        a.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_child_cannot_use_or_break_the_parents_store(cluster):
    from kvferry.store import ReplicateConfig, Store, StoreInvalidArgument

    s = Store(master_server_addr=cluster, global_segment_size=16 * MiB, local_buffer_size=16 * MiB)
    try:
        value = bytes(range(256)) * 64
        # Stored in this client's own segment: a child that unmounted it would lose it.
        s.put("fork-key", value, ReplicateConfig(preferred_segment=s.segment_name))

        def child():
            nonlocal s
            try:
                s.get("fork-key")
                return False
            except StoreInvalidArgument as e:
                ok = "belongs to process %d" % os.getppid() in str(e)
            del s
            gc.collect()
            return ok

        # Right after the fork (at-fork handler), with `s` still referenced, the child holds
        # none of the store's engine's listening sockets.
        seg_port = int(s.segment_name.rsplit(":", 1)[1])
        inodes = _socket_inodes({seg_port})
        assert _fds_on(inodes) >= 1, inodes
        assert _fork(lambda: _fds_on(inodes) == 0) == 0, "the child still held the store engine's listener after fork()"
        assert _fork(child) == 0, "the child's copy did not raise the expected error"
        assert s.get("fork-key") == value
        s.put("after-fork", b"x" * 4096)
        with Store(master_server_addr=cluster, global_segment_size=16 * MiB, local_buffer_size=16 * MiB) as other:
            assert other.get("fork-key") == value
    finally:
        s.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_child_lets_go_of_a_mooncake_engines_sockets_and_can_start_its_own():
    """Mooncake's TransferEngine (what vLLM and SGLang use) is released in a fork() child as
    kvferry's own engines are: the child holds none of the parent's listening sockets; and
    initialize() in the child starts an engine of its own (0), not an error from closing the
    parent's."""
    from kvferry.mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    try:
        inodes = _socket_inodes({te.get_rpc_port(), te._core.data_port})
        held = _fds_on(inodes)
        assert held >= 2, "the parent holds its two listeners: %d descriptors on %s" % (held, inodes)
        assert _fork(lambda: _fds_on(inodes) == 0) == 0, "the child still held the Mooncake engine's listening sockets"
        assert _fork(lambda: te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0 and te.get_rpc_port() > 0) == 0
        assert _fds_on(inodes) == held
    finally:
        te._core.close()


def test_a_batch_dropped_after_a_failed_wait_lets_its_buffers_go(kv, tcp_engine):
    """The documented pattern `b = submit(...); b.wait(); b.free()` skips free() when wait()
    raises: dropping the batch must still release the engine's batch and its buffers' pins
    (before, the buffer could never be resized or freed until the engine closed)."""
    a = tcp_engine
    b = kv.Engine(HOST)
    try:
        buf = bytearray(4096)
        batch = a.submit_write(b.segment_name, [buf], [0x1000])  # outside b's memory
        with pytest.raises(kv.KvferryError):
            batch.wait()
        assert not _resizable(a, buf), "pinned while the batch is referenced"
        del batch
        gc.collect()
        assert wait_for(lambda: _resizable(a, buf), 10, 0.05), "the dropped batch still pins its buffer"
    finally:
        b.close()


def test_a_mooncake_managed_buffer_is_not_unmapped_under_a_view():
    """A view from get_engine().view() keeps its managed buffer mapped through Mooncake's API
    too: free_managed_buffer refuses (-1) while the view lives, and initialize() again leaves
    it mapped (before, both unmapped it and touching the view crashed the interpreter)."""
    from kvferry.mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    a = te.allocate_managed_buffer(4096)
    assert a
    v = te.get_engine().view(a, 16)
    v[0] = 7
    assert te.free_managed_buffer(a, 4096) == -1
    assert v[0] == 7
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    v[1] = 8
    assert (v[0], v[1]) == (7, 8), "still mapped after the engine it came from was replaced"
    b = te.allocate_managed_buffer(4096)
    w = te.get_engine().view(b, 16)
    w.release()
    assert te.free_managed_buffer(b, 4096) == 0, "without a view it is freed"
    del v
    te.get_engine().close()


def test_close_ends_a_waiter_and_stops_the_engine(kv):
    """close() while another thread waits for notifies (default: forever): the waiter returns
    and the engine stops (its handshake port refuses), instead of both lasting as long as the
    wait."""
    a = kv.Engine(HOST)
    b = kv.Engine(HOST)
    try:
        seg = a.segment_name
        got = []
        t = threading.Thread(target=lambda: got.append(a.wait_notifies()), daemon=True)
        t.start()
        time.sleep(0.3)
        a.close()
        t.join(5)
        assert not t.is_alive(), "the waiter still waits after close()"
        assert got == [[]]
        assert wait_for(lambda: _refuses(b, seg), 10, 0.1), "the closed engine still answers probes"
    finally:
        b.close()


def _refuses(engine, segment) -> bool:
    import kvferry

    try:
        engine.probe(segment)
        return False
    except kvferry.PeerUnreachable:
        return True
