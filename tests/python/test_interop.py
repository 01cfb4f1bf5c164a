"""kvferry (this process, driven from Python) <-> stock Mooncake (the PyPI wheel, another
process running tests/interop/mooncake_peer.py), both directions, WRITE and READ, bytes
verified by SHA-256. Skipped, loudly, only when the Mooncake wheel cannot be installed."""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from conftest import Buf, Peer, pattern_bytes, peer_env, run_initiator, sha256, wait_for

SIZE = 4 << 20


@pytest.fixture
def mc_target(mooncake_py):
    p = Peer(mooncake_py, SIZE, seed=2)
    yield p
    p.close()


@pytest.mark.parametrize("block", [4096, 65536, 1 << 20])
@pytest.mark.parametrize("api", ["compat", "native"])
def test_kvferry_writes_and_reads_mooncake(mc_target, te_pair, pair, api, block):
    seg, raddr = mc_target.segment, mc_target.addr
    src, back = Buf(SIZE), Buf(SIZE)
    src.fill(13)
    offs = list(range(0, SIZE, block))
    if api == "compat":
        te, _ = te_pair
        assert te.register_memory(src.addr, SIZE) == 0 and te.register_memory(back.addr, SIZE) == 0
        assert te.get_first_buffer_address(seg) == raddr
        for i in range(0, len(offs), 16):
            g = offs[i:i + 16]
            assert te.batch_transfer_sync_write(seg, [src.addr + o for o in g], [raddr + o for o in g], [block] * len(g)) == 0
        assert mc_target.checksum(0, SIZE) == src.sha()
        for i in range(0, len(offs), 16):
            g = offs[i:i + 16]
            assert te.batch_transfer_sync_read(seg, [back.addr + o for o in g], [raddr + o for o in g], [block] * len(g)) == 0
    else:
        eng, _ = pair
        eng.register_memory(src.mm)
        eng.register_memory(back.mm)
        assert eng.segment_buffers(seg)[0].addr == raddr
        assert eng.batch_write(seg, [src.addr + o for o in offs], [raddr + o for o in offs], [block] * len(offs)) == SIZE
        assert mc_target.checksum(0, SIZE) == src.sha()
        with eng.submit_read(seg, [back.addr + o for o in offs], [raddr + o for o in offs], [block] * len(offs)) as b:
            assert b.wait().transferred_bytes == SIZE
    assert back.sha() == src.sha()


def test_kvferry_single_ops_and_errors_against_mooncake(mc_target, te_pair, kv, pair):
    te, _ = te_pair
    seg, raddr = mc_target.segment, mc_target.addr
    buf = Buf(65536)
    buf.fill(4)
    assert te.register_memory(buf.addr, buf.size) == 0
    assert te.transfer_sync_write(seg, buf.addr, raddr + 100, 5000) == 0
    assert mc_target.checksum(100, 5000) == buf.sha(0, 5000)
    assert te.transfer_sync_read(seg, buf.addr + 8192, raddr + (1 << 20), 4096) == 0
    assert buf.bytes(8192, 4096) == pattern_bytes(1 << 20, 4096, 2)
    x = te.transfer_submit_write(seg, buf.addr, raddr + 4096, 4096)
    assert wait_for(lambda: te.transfer_check_status(x) == 1, timeout=10)
    # outside Mooncake's registered buffer: refused without touching memory
    assert te.transfer_sync_write(seg, buf.addr, raddr + SIZE, 16) == -1
    eng, _ = pair
    eng.register_memory(buf.mm)
    with pytest.raises(kv.AddressNotRegistered):
        eng.write(seg, buf.mm, raddr + SIZE - 8, 16)
    assert te.send_probe(seg) == 0
    eng.probe(seg)


def test_notify_kvferry_to_mooncake(mc_target, te_pair):
    from kvferry.mooncake.engine import TransferNotify, Write

    te, _ = te_pair
    buf = Buf(4096)
    assert te.register_memory(buf.addr, 4096) == 0
    assert te.transfer_sync(mc_target.segment, buf.addr, mc_target.addr, 64, Write, TransferNotify("kv", "hello")) == 0
    got = []
    wait_for(lambda: got.extend(mc_target.notifies()) or got)
    assert got == [["kv", "hello"]]


@pytest.mark.parametrize("op", ["write", "read"])
def test_mooncake_initiator_against_kvferry(mooncake_py, pair, op):
    _, eng = pair
    target = Buf(SIZE)
    target.fill(8)
    eng.register_memory(target.mm)
    out = run_initiator(mooncake_py, eng.segment_name, target.addr, SIZE, op, 65536, batch=16, seed=6)
    assert out["ok"] and out["rc"] == 0, out
    if op == "write":
        assert target.sha() == sha256(pattern_bytes(0, SIZE, 6))
    else:
        assert out["sha256"] == target.sha() == sha256(pattern_bytes(0, SIZE, 8))


def test_mooncake_notify_and_probe_to_kvferry(mooncake_py, pair):
    """Stock Mooncake's transfer_sync(..., notify) and send_probe against a kvferry engine."""
    _, eng = pair
    target = bytearray(4096)
    eng.register_memory(target)
    script = textwrap.dedent(
        """
        import ctypes, mmap, sys
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        mm = mmap.mmap(-1, 4096); mm[:5] = b"hello"
        a = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        assert te.register_memory(a, 4096) == 0
        seg, raddr = sys.argv[1], int(sys.argv[2])
        print("probe", te.send_probe(seg))
        print("first", te.get_first_buffer_address(seg) == raddr)
        print("sync", te.transfer_sync(seg, a, raddr, 5, TransferOpcode.Write, TransferNotify("mc", "sent")))
        sys.stdout.flush()
        import os; os._exit(0)
        """
    )
    addr = eng.registered()[0].addr
    r = subprocess.run([mooncake_py, "-c", script, eng.segment_name, str(addr)], capture_output=True, text=True, timeout=120, env=peer_env(False))
    lines = [ln for ln in r.stdout.splitlines() if ln.split(" ")[0] in ("probe", "first", "sync")]
    assert lines == ["probe 0", "first True", "sync 0"], (r.stdout, r.stderr[-3000:])
    assert target[:5] == b"hello"
    assert eng.wait_notifies(5) == [("mc", "sent")]


def test_probe_dead_mooncake(mooncake_py, te_pair):
    p = Peer(mooncake_py, 4096)
    te, _ = te_pair
    assert te.send_probe(p.segment) == 0
    p.kill()
    p.close()
    assert te.send_probe(p.segment) == -102
    assert te.get_first_buffer_address(p.segment) == 0  # never opened, and now gone
