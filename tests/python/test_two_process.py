"""kvferry in two processes.

The other process runs tests/interop/mooncake_peer.py -- a script written for stock
Mooncake (``from mooncake.engine import TransferEngine``) -- unmodified, on kvferry through
KVFERRY_MOONCAKE_SHIM=1. So these tests also prove the drop-in shim end to end.
"""

from __future__ import annotations

import sys
import time

import pytest

from conftest import HOST, Buf, Peer, pattern_bytes, run_initiator, sha256, wait_for

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
