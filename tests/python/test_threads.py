"""Concurrency: many Python threads share one engine; blocking calls release the GIL."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import HOST, Buf, pattern_bytes

import numpy as np  # installed by scripts/python-test

THREADS = 8


def _run_threads(fn, n=THREADS):
    errors = []
    barrier = threading.Barrier(n)

    def wrap(i):
        try:
            barrier.wait()
            fn(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    ts = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts), "threads hung"
    assert not errors, errors


def test_native_threads_share_one_engine(pair):
    a, b = pair
    blk, rounds = 32768, 20
    src = np.frombuffer(pattern_bytes(0, THREADS * blk, 21), dtype=np.uint8).copy()
    dst = np.zeros(THREADS * blk, dtype=np.uint8)
    back = np.zeros(THREADS * blk, dtype=np.uint8)
    a.register_memory(src)
    a.register_memory(back)
    b.register_memory(dst)
    remote = a.segment_buffers(b.segment_name)[0].addr
    seg = b.segment_name

    def work(i):
        lo, hi = i * blk, (i + 1) * blk
        for r in range(rounds):
            if r % 3 == 0:
                assert a.write(seg, src[lo:hi], remote + lo) == blk
            elif r % 3 == 1:
                with a.submit_read(seg, [back[lo:hi]], [remote + lo]) as batch:
                    assert batch.wait(30).ok
                assert back[lo:hi].tobytes() == src[lo:hi].tobytes()
            else:
                half = blk // 2
                assert a.batch_write(seg, [src[lo:lo + half], src[lo + half:hi]], [remote + lo, remote + lo + half]) == blk
            a.probe(seg)

    _run_threads(work)
    assert dst.tobytes() == src.tobytes()


def test_compat_threads_share_one_engine(te_pair):
    a, b = te_pair
    blk, rounds = 16384, 20
    src, dst = Buf(THREADS * blk), Buf(THREADS * blk)
    src.fill(5)
    assert a.register_memory(src.addr, src.size) == 0
    assert b.register_memory(dst.addr, dst.size) == 0
    seg = "%s:%d" % (HOST, b.get_rpc_port())

    def work(i):
        off = i * blk
        for r in range(rounds):
            if r % 2:
                assert a.transfer_sync_write(seg, src.addr + off, dst.addr + off, blk) == 0
            else:
                x = a.batch_transfer_async_write(seg, [src.addr + off], [dst.addr + off], [blk])
                assert x != 0 and a.get_batch_transfer_status([x]) == 0
            assert a.send_probe(seg) == 0

    _run_threads(work)
    assert dst.sha() == src.sha()


def test_register_and_transfer_concurrently(pair):
    """Threads register and unregister their own buffers while others transfer."""
    a, b = pair
    dst = bytearray(1 << 20)
    b.register_memory(dst)
    remote = a.segment_buffers(b.segment_name)[0].addr

    def work(i):
        for r in range(20):
            buf = bytearray(pattern_bytes(0, 4096, i + r))
            a.register_memory(buf)
            try:
                assert a.write(b.segment_name, buf, remote + i * 4096) == 4096
            finally:
                a.unregister_memory(buf)

    _run_threads(work)


class _Owned(bytearray):
    """A bytearray that a weak reference can watch."""


def test_racing_register_and_unregister_of_one_buffer_keep_its_pin(kv):
    """One thread unregisters a buffer while another registers it again as soon as it may,
    the buffer held by nothing but its registration, 200 times: whichever way each pair
    falls, a registered buffer's pin is held (an unregister never drops the pin of the
    registration made just after it: before, each call updated the pins after its engine
    call, in either order, and left registered memory that nothing kept alive), and an
    unregistered one is held by nothing."""
    import gc
    import weakref

    with kv.Engine(HOST) as a:
        watch = None
        for rnd in range(200):
            if watch is None or watch() is None:
                buf = _Owned(4096)
                addr = a.register_memory(buf)
                watch = weakref.ref(buf)
                del buf
            barrier = threading.Barrier(2)

            def unregister():
                barrier.wait()
                try:
                    a.unregister_memory(addr)
                except kv.AddressNotRegistered:
                    pass

            def register(held=watch()):
                # Tried until the unregister let it in (or for 50 ms): it lands right after.
                barrier.wait()
                until = time.monotonic() + 0.05
                while time.monotonic() < until:
                    try:
                        a.register_memory(held)
                        return
                    except kv.AddressOverlap:
                        pass

            ts = [threading.Thread(target=f, daemon=True) for f in (unregister, register)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            assert not any(t.is_alive() for t in ts), "round %d: hung" % rnd
            del ts, register
            gc.collect()
            if any(r.addr == addr for r in a.registered()):
                assert watch() is not None and a._core.pin_of(addr, 4096) is not None, "round %d: registered, nothing holds it" % rnd
            else:
                assert watch() is None, "round %d: unregistered, something still holds it" % rnd
        if watch() is not None:
            a.unregister_memory(addr)
            gc.collect()
            assert watch() is None


def _gil_free_while(call, duration):
    """Runs `call` (which blocks ~`duration` s in native code) in a thread and measures how
    long a pure-Python loop in this thread takes meanwhile."""
    started = threading.Event()

    def bg():
        started.set()
        call()

    t = threading.Thread(target=bg)
    t.start()
    started.wait()
    time.sleep(0.05)  # let it enter the native call
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < 0.2:
        n += 1
    elapsed = time.monotonic() - t0
    t.join()
    return elapsed, n


def test_blocking_calls_release_the_gil(pair, kv, monkeypatch):
    a, b = pair
    # wait_notifies blocks for 1.5 s with the GIL released: this thread keeps running.
    elapsed, n = _gil_free_while(lambda: b.wait_notifies(1.5), 1.5)
    assert elapsed < 1.0 and n > 1000
    # a sync transfer to a stalled peer blocks until its deadline, also without the GIL
    from test_native import _StalledPeer

    monkeypatch.setenv("KVFERRY_TRANSFER_TIMEOUT", "1")
    with kv.Engine(HOST) as c, _StalledPeer(c) as peer:
        src = bytearray(4096)
        c.register_memory(src)

        def stalled():
            with pytest.raises(kv.TransferTimeout):
                c.write(peer.segment, src, peer.remote_addr)

        elapsed, n = _gil_free_while(stalled, 1.0)
        assert elapsed < 0.8 and n > 1000
