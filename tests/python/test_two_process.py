"""kvferry in two processes.

The other process runs tests/interop/mooncake_peer.py -- a script written for stock
Mooncake (``from mooncake.engine import TransferEngine``) -- unmodified, on kvferry through
KVFERRY_MOONCAKE_SHIM=1. So these tests also prove the drop-in shim end to end.
"""

from __future__ import annotations

import sys
import time

import pytest

from conftest import HOST, RELEASES, Buf, Peer, pattern_bytes, run_initiator, sha256, stock_python, wait_for

SIZE = 1 << 20


@pytest.fixture
def kv_target():
    p = Peer(sys.executable, SIZE, seed=3, shim=True)
    yield p
    p.close()


def test_peer_runs_on_kvferry(kv_target):
    assert kv_target.segment.startswith(HOST + ":")
    assert kv_target.checksum(0, SIZE) == sha256(pattern_bytes(0, SIZE, 3))


@pytest.mark.parametrize("api", ["compat", "native"])
def test_write_read_across_processes(kv_target, te_pair, pair, api):
    seg, raddr = kv_target.segment, kv_target.addr
    src = Buf(SIZE)
    src.fill(7)
    back = Buf(SIZE)
    if api == "compat":
        te, _ = te_pair
        assert te.register_memory(src.addr, SIZE) == 0
        assert te.register_memory(back.addr, SIZE) == 0
        assert te.get_first_buffer_address(seg) == raddr
        blocks = [(off, 65536) for off in range(0, SIZE, 65536)]
        assert te.batch_transfer_sync_write(seg, [src.addr + o for o, _ in blocks], [raddr + o for o, _ in blocks], [n for _, n in blocks]) == 0
        assert kv_target.checksum(0, SIZE) == src.sha()
        assert te.transfer_sync_read(seg, back.addr, raddr, SIZE) == 0
        assert te.send_probe(seg) == 0
    else:
        eng, _ = pair
        eng.register_memory(src.mm)
        eng.register_memory(back.mm)
        assert eng.segment_buffers(seg)[0].addr == raddr
        assert eng.write(seg, src.mm, raddr) == SIZE
        assert kv_target.checksum(0, SIZE) == src.sha()
        assert eng.read(seg, back.mm, raddr) == SIZE
        eng.probe(seg)
    assert back.sha() == src.sha()


def test_notify_across_processes(kv_target, te_pair, pair, kv):
    te, _ = te_pair
    from kvferry.mooncake.engine import TransferNotify, Write

    buf = Buf(4096)
    assert te.register_memory(buf.addr, 4096) == 0
    assert te.transfer_sync(kv_target.segment, buf.addr, kv_target.addr, 16, Write, TransferNotify("req-1", "done")) == 0
    eng, _ = pair
    eng.send_notify(kv_target.segment, "standalone")
    got = []
    wait_for(lambda: got.extend(kv_target.notifies()) or len(got) >= 2)
    assert got == [["req-1", "done"], [eng.segment_name, "standalone"]]


def test_kvferry_initiator_process(pair):
    """The peer script as initiator (on kvferry) against a target in this process."""
    _, eng = pair
    target = Buf(SIZE)
    target.fill(1)
    eng.register_memory(target.mm)
    out = run_initiator(sys.executable, eng.segment_name, target.addr, SIZE, "write", 65536, batch=4, seed=9, shim=True)
    assert out["ok"] and out["rc"] == 0, out
    assert target.sha() == sha256(pattern_bytes(0, SIZE, 9))
    out = run_initiator(sys.executable, eng.segment_name, target.addr, SIZE, "read", 32768, batch=8, shim=True)
    assert out["ok"] and out["sha256"] == target.sha(), out


def test_probe_dead_process(te_pair, pair, kv):
    p = Peer(sys.executable, 4096, shim=True)
    seg = p.segment
    te, _ = te_pair
    assert te.send_probe(seg) == 0
    p.kill()
    p.close()
    assert te.send_probe(seg) == -102
    buf = Buf(4096)
    assert te.register_memory(buf.addr, 4096) == 0
    t0 = time.monotonic()
    assert te.transfer_sync_write(seg, buf.addr, p.addr, 16) == -1
    assert time.monotonic() - t0 < 15
    eng, _ = pair
    with pytest.raises(kv.PeerUnreachable) as ei:
        eng.probe(seg)
    assert ei.value.code == -102


@pytest.fixture(params=["kvferry"] + ["mooncake-" + r for r in RELEASES])
def any_target(request):
    """A target process on kvferry (through the shim) or on a stock Mooncake release."""
    if request.param == "kvferry":
        p = Peer(sys.executable, SIZE, seed=4, shim=True)
    else:
        p = Peer(stock_python(request.param.split("-", 1)[1]), SIZE, seed=4)
    yield p
    p.close()


def test_every_transfer_method_across_processes(any_target, te_pair):
    """Each Mooncake-API transfer method of kvferry against another process, bytes verified."""
    from kvferry.mooncake.engine import Read, TransferNotify, Write

    te, _ = te_pair
    seg, r = any_target.segment, any_target.addr
    k = 65536
    m = te.allocate_managed_buffer(8 * k)
    assert m != 0
    pat = pattern_bytes(0, 8 * k, 12)
    assert te.write_bytes_to_buffer(m, pat, len(pat)) == 0

    def remote_is(off, n, data):
        return any_target.checksum(off, n) == sha256(data)

    assert te.transfer_sync_write(seg, m, r, k) == 0 and remote_is(0, k, pat[:k])
    assert te.transfer_sync(seg, m + k, r + k, k, Write) == 0 and remote_is(k, k, pat[k:2 * k])
    assert te.batch_transfer_sync_write(seg, [m + 2 * k], [r + 2 * k], [k]) == 0 and remote_is(2 * k, k, pat[2 * k:3 * k])
    assert te.batch_transfer_sync(seg, [m + 3 * k], [r + 3 * k], [k], Write, TransferNotify("b", "sync")) == 0
    x = te.batch_transfer_async_write(seg, [m + 4 * k], [r + 4 * k], [k])
    y = te.batch_transfer_async(seg, [m + 5 * k], [r + 5 * k], [k], Write)
    assert x and y and te.get_batch_transfer_status([x, y]) == 0
    z = te.transfer_submit_write(seg, m + 6 * k, r + 6 * k, 2 * k)
    assert wait_for(lambda: te.transfer_check_status(z) == 1, timeout=10)
    assert remote_is(0, 8 * k, pat)
    got = []
    wait_for(lambda: got.extend(any_target.notifies()) or got)
    assert got == [["b", "sync"]]

    # reads: zero the local buffer, read back from the peer
    assert te.write_bytes_to_buffer(m, bytes(8 * k), 8 * k) == 0
    assert te.transfer_sync_read(seg, m, r, k) == 0
    assert te.transfer_sync(seg, m + k, r + k, k, Read) == 0
    assert te.batch_transfer_sync_read(seg, [m + 2 * k, m + 3 * k], [r + 2 * k, r + 3 * k], [k, k]) == 0
    assert te.batch_transfer_sync(seg, [m + 4 * k], [r + 4 * k], [k], Read) == 0
    x = te.batch_transfer_async_read(seg, [m + 5 * k], [r + 5 * k], [k])
    y = te.batch_transfer_async(seg, [m + 6 * k], [r + 6 * k], [2 * k], Read)
    assert wait_for(lambda: te.transfer_check_status(x) == 1, timeout=10)
    assert te.get_batch_transfer_status([y]) == 0
    assert te.read_bytes_from_buffer(m, 8 * k) == pat
    assert te.get_first_buffer_address(seg) == r
    assert te.send_probe(seg) == 0
    assert te.free_managed_buffer(m, 8 * k) == 0


def test_native_api_across_processes(any_target, pair, kv):
    import numpy as np  # installed by scripts/python-test
    eng, _ = pair
    seg, r = any_target.segment, any_target.addr
    src = np.frombuffer(pattern_bytes(0, SIZE, 15), dtype=np.uint8).copy()
    back = np.zeros_like(src)
    eng.register_memory(src)
    eng.register_memory(back)
    blk = SIZE // 16
    with eng.submit_write(seg, [src[i * blk:(i + 1) * blk] for i in range(16)], [r + i * blk for i in range(16)]) as b:
        assert b.wait().transferred_bytes == SIZE
    assert any_target.checksum(0, SIZE) == sha256(src.tobytes())
    assert eng.batch_read(seg, [back[:blk], back[blk:]], [r, r + blk]) == SIZE
    assert back.tobytes() == src.tobytes()
    with pytest.raises(kv.AddressNotRegistered):
        eng.read(seg, back, r + 1)  # one byte past the peer's buffer
    eng.send_notify(seg, "native", name="n1")
    got = []
    wait_for(lambda: got.extend(any_target.notifies()) or got)
    assert got == [["n1", "native"]]
