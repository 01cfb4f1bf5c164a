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


def test_drop_releases_the_gil(kv, monkeypatch):
    # The test hook makes dropping the engine take 400 ms (inside the section that runs
    # without the GIL); another Python thread must keep running meanwhile.
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


def _slow_batch(kv, a, b, size):
    """A batch whose task 1 fails at once (unregistered remote range) while task 0 (a large
    WRITE over TCP) is still moving bytes. Returns (batch, buf) or None if task 0 was done
    before it could be observed in flight."""
    buf = bytearray(bytes(range(256)) * (size // 256))
    small = bytearray(16)
    _register_unpinned(a, buf)
    _register_unpinned(a, small)
    remote = b.allocate_managed_buffer(size)
    bad = remote + size + (1 << 30)  # not registered by b
    batch = a.submit(b.segment_name, [buf, small], [remote, bad], [size, 16])
    assert wait_for(lambda: batch.task_status(1).done, 10)
    assert batch.task_status(1).status == kv.TaskStatus.FAILED
    if batch.task_status(0).done:
        batch.release()
        return None
    return batch, buf, remote


@pytest.fixture
def tcp_pair(kv, monkeypatch):
    # TCP with one lane: the large task takes long enough to be seen in flight.
    monkeypatch.setenv("KVFERRY_TRANSPORT", "tcp")
    monkeypatch.setenv("KVFERRY_TCP_LANES", "1")
    a, b = kv.Engine(HOST), kv.Engine(HOST)
    yield a, b
    a.close()
    b.close()


def test_batch_pins_held_until_every_task_is_terminal(kv, tcp_pair):
    a, b = tcp_pair
    for size in (128 * MiB, 512 * MiB):
        got = _slow_batch(kv, a, b, size)
        if got is not None:
            break
    else:
        pytest.skip("the large task finished before the failed one could be observed")
    batch, buf, remote = got
    # The failed sibling does not make the batch terminal while task 0 still runs.
    st = batch.status()
    if not batch.task_status(0).done:
        assert not st.done, "batch reported %s while task 0 is in flight" % (st,)
    # Releasing it early (as `with a.submit(...)` does on an exception) must not release
    # the pin of task 0's buffer. release_batch answers False when the batch is still busy;
    # no engine call happens between it and the resize attempt.
    busy = not a._core.release_batch(batch.id)
    batch._released = True
    if busy:
        with pytest.raises(BufferError):
            buf.extend(b"x")
    # Once task 0 is terminal the pin goes.
    assert wait_for(lambda: _resizable(a, buf), 120, 0.05), "pin never released"
    assert b.read_bytes(remote, 4096) == bytes(buf[:4096])


def test_batch_wait_waits_for_every_task(kv, tcp_pair):
    a, b = tcp_pair
    for size in (128 * MiB, 512 * MiB):
        got = _slow_batch(kv, a, b, size)
        if got is not None:
            break
    else:
        pytest.skip("the large task finished before the failed one could be observed")
    batch, buf, remote = got
    st = batch.wait(120, check=False)
    assert st.status == kv.TaskStatus.FAILED
    assert batch.task_status(0).done, "wait() returned while task 0 was in flight"
    assert batch.task_status(0).status == kv.TaskStatus.COMPLETED
    batch.free()  # every task terminal: no BatchBusy
    assert _resizable(a, buf)


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

        assert _fork(child) == 0, "the child's copy did not raise the expected error"
        assert s.get("fork-key") == value
        s.put("after-fork", b"x" * 4096)
        with Store(master_server_addr=cluster, global_segment_size=16 * MiB, local_buffer_size=16 * MiB) as other:
            assert other.get("fork-key") == value
    finally:
        s.close()
