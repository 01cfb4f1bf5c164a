"""kvferry.mooncake.engine: Mooncake's API on kvferry.

test_compat_parity runs the shared cases of compat_cases.py against kvferry and, when the
wheel is available, against stock Mooncake, and checks both give the expected results. The
other tests here cover what cannot run on stock Mooncake (it crashes: calls before
initialize, bad raw addresses) and kvferry's own guarantees (logging, get_engine).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from conftest import HERE, HOST, RELEASES, Buf, mooncake_python, peer_env, stock_python, wait_for

import compat_cases

ALL_CASES = list(compat_cases.CASES) + list(compat_cases.DIVERGENT)

_RESULTS = {}
_RUNNING = {}


# Stock Mooncake's runs are split in this many processes: they mostly wait on its own
# timeouts (about 35 s per release, under a second of CPU; `initialize_etcd` alone waits 10 s).
_STOCK_SHARDS = 3


def _start(impl: str, python: str) -> None:
    if impl in _RESULTS or impl in _RUNNING:
        return
    shards = 1 if impl == "kvferry" else _STOCK_SHARDS
    _RUNNING[impl] = [
        subprocess.Popen(
            [python, str(HERE / "compat_cases.py"), "--impl", impl.split("-")[0], "--cases"] + ALL_CASES[i::shards],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=peer_env(shim=False),
        )
        for i in range(shards)
    ]


def _run_cases(impl: str, python: str):
    """The cases' results on `impl` (run once). The first call also starts the runs of the
    other implementations that are available, so they all go side by side."""
    if impl not in _RESULTS:
        _start(impl, python)
        _start("kvferry", sys.executable)
        for release in RELEASES if os.environ.get("KVFERRY_SKIP_MOONCAKE") != "1" else ():
            other = mooncake_python(release)
            if other is not None:
                _start("mooncake-" + release, other)
        result = {}
        for proc in _RUNNING.pop(impl):
            try:
                out, err = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            assert lines, "compat_cases.py --impl %s printed nothing (rc=%d):\n%s" % (impl, proc.returncode, err[-4000:])
            result.update(json.loads(lines[-1]))
        _RESULTS[impl] = result
    return _RESULTS[impl]


def _norm(v):
    if isinstance(v, dict) and "raises" in v:
        return {"raises": v["raises"]}
    return v


@pytest.mark.parametrize("impl", ["kvferry"] + ["mooncake-" + r for r in RELEASES])
@pytest.mark.parametrize("name", ALL_CASES)
def test_compat_parity(impl, name):
    """Each case on kvferry and on each stock release (the same calls, return codes and bytes)."""
    if impl == "kvferry":
        python = sys.executable
    else:
        python = stock_python(impl.split("-", 1)[1])
    got = _norm(_run_cases(impl, python).get(name))
    if impl == "kvferry" and name in compat_cases.PENDING_KVFERRY and got != compat_cases.expected(name, impl):
        pytest.xfail("PENDING on kvferry (issue 46's 0.3.14 engine calls): %s gives %r" % (name, got))
    assert got == compat_cases.expected(name, impl), "%s on %s: got %r, expected %r" % (name, impl, got, compat_cases.expected(name, impl))


def test_parity_cases_agree_between_implementations(mooncake_py, mooncake_release):
    """Every shared case gives the same result on both (beyond matching the expectation),
    except where that release's wheel is built with features kvferry does not claim
    (compat_cases.case(..., stock=...))."""
    kv = {k: _norm(v) for k, v in _run_cases("kvferry", sys.executable).items()}
    mc = {k: _norm(v) for k, v in _run_cases("mooncake-" + mooncake_release, mooncake_py).items()}
    shared = [k for k in compat_cases.CASES if mooncake_release not in compat_cases.STOCK.get(k, {})
              and not (k in compat_cases.PENDING_KVFERRY and kv.get(k) != compat_cases.expected(k, "kvferry"))]
    differ = {k: (kv.get(k), mc.get(k)) for k in shared if kv.get(k) != mc.get(k)}
    assert not differ


# -- kvferry-only behaviour ----------------------------------------------------------------------

@pytest.fixture
def te():
    from kvferry.mooncake.engine import TransferEngine

    e = TransferEngine()
    yield e
    if e._core is not None:
        e._core.close()


def test_calls_before_initialize_fail_cleanly(te, caplog):
    """Stock Mooncake segfaults here; kvferry returns the failure value and logs why."""
    from kvferry.mooncake.engine import TransferNotify, Write

    buf = Buf(4096)
    calls = [
        (lambda: te.get_rpc_port(), -1),
        (lambda: te.register_memory(buf.addr, 4096), -1),
        (lambda: te.unregister_memory(buf.addr), -1),
        (lambda: te.batch_register_memory([buf.addr], [4096]), -1),
        (lambda: te.batch_unregister_memory([buf.addr]), -1),
        (lambda: te.allocate_managed_buffer(4096), 0),
        (lambda: te.free_managed_buffer(buf.addr, 4096), -1),
        (lambda: te.transfer_sync_write("127.0.0.1:1", buf.addr, 0, 1), -1),
        (lambda: te.transfer_sync_read("127.0.0.1:1", buf.addr, 0, 1), -1),
        (lambda: te.transfer_sync("127.0.0.1:1", buf.addr, 0, 1, Write, TransferNotify("a", "b")), -1),
        (lambda: te.batch_transfer_sync_write("127.0.0.1:1", [buf.addr], [0], [1]), -1),
        (lambda: te.batch_transfer_sync_read("127.0.0.1:1", [buf.addr], [0], [1]), -1),
        (lambda: te.batch_transfer_sync("127.0.0.1:1", [buf.addr], [0], [1], Write), -1),
        (lambda: te.batch_transfer_async_write("127.0.0.1:1", [buf.addr], [0], [1]), 0),
        (lambda: te.batch_transfer_async_read("127.0.0.1:1", [buf.addr], [0], [1]), 0),
        (lambda: te.batch_transfer_async("127.0.0.1:1", [buf.addr], [0], [1], Write), 0),
        (lambda: te.get_batch_transfer_status([1]), -1),
        (lambda: te.transfer_submit_write("127.0.0.1:1", buf.addr, 0, 1), 0),
        (lambda: te.transfer_check_status(1), -1),
        (lambda: te.get_first_buffer_address("127.0.0.1:1"), 0),
        (lambda: te.get_notifies(), []),
        (lambda: te.send_probe("127.0.0.1:1"), -1),
        (lambda: te.get_engine(), None),
    ]
    for fn, expected in calls:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvferry"):
            assert fn() == expected
        msgs = [r.getMessage() for r in caplog.records if r.name == "kvferry"]
        assert len(msgs) == 1 and "initialize() has not been called" in msgs[0], msgs
    # The byte helpers need no engine.
    assert te.write_bytes_to_buffer(buf.addr, b"abc", 3) == 0
    assert te.read_bytes_from_buffer(buf.addr, 3) == b"abc"
    assert te.get_local_topology() == "{}\n"
    assert te.warmup_efa_segment("x") == 0


def test_failures_log_their_reason_once(te, caplog):
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    buf = Buf(4096)
    cases = [
        (lambda: te.register_memory(buf.addr, 0), -1, "length 0"),
        (lambda: te.unregister_memory(buf.addr), -3, "not the start of a registered range"),
        (lambda: te.transfer_sync_write("127.0.0.1:1", buf.addr, 0, 1), -1, "127.0.0.1:1"),
        (lambda: te.transfer_sync_write("nonsense", buf.addr, 0, 1), -1, "nonsense"),
        (lambda: te.batch_transfer_sync_write(te._core.segment_name, [buf.addr], [buf.addr], [8]), -1, "not inside registered memory"),
        (lambda: te.batch_register_memory([buf.addr, buf.addr + 8], [8]), -1, "capacities"),
        (lambda: te.send_probe("127.0.0.1:1"), -102, "Connection refused"),
        (lambda: te.get_first_buffer_address("127.0.0.1:1"), 0, "127.0.0.1:1"),
        (lambda: te.read_bytes_from_buffer(8, 4), b"", "not mapped"),
        (lambda: te.write_bytes_to_buffer(8, b"x", 1), -1, "not mapped"),
        (lambda: te.free_managed_buffer(buf.addr, 1), 0, "not an address returned by allocate_managed_buffer"),
        (lambda: te.transfer_check_status(987654), -1, "987654"),
        (lambda: te.get_batch_transfer_status([987654]), -1, "987654"),
    ]
    for fn, expected, needle in cases:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="kvferry"):
            assert fn() == expected
        msgs = [r.getMessage() for r in caplog.records if r.name == "kvferry" and r.levelno >= logging.WARNING]
        assert len(msgs) == 1 and needle in msgs[0], (needle, msgs)


def test_initialize_failures(te, caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert te.initialize("192.0.2.1", "P2PHANDSHAKE", "tcp", "") == -1
    assert "not an address of this host" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert te.initialize(HOST, "bogus://x", "tcp", "") == -1  # Mooncake aborts the process here
    assert "bogus" in caplog.text
    assert te.get_rpc_port() == -1  # still not initialized
    with pytest.raises(TypeError, match="incompatible function arguments"):
        te.initialize(HOST, None, "tcp", "")
    # protocol "rdma" (vLLM's and SGLang's default) under MC_FORCE_TCP=1 (as scripts/python-test
    # runs): TCP, as in Mooncake (without it, RDMA or -1: the test after this one).
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert te.initialize(HOST, "P2PHANDSHAKE", "rdma", "mlx5_0") == 0
    assert te.get_rpc_port() > 0


def _published(te) -> dict:
    """The segment descriptor `te` publishes, asked of its handshake port (Mooncake's
    Metadata message, type 1)."""
    import socket
    import struct

    s = socket.create_connection((HOST, te.get_rpc_port()), timeout=5)
    s.sendall(struct.pack("<Q", 3) + b"\x01{}")
    head = b""
    while len(head) < 8:
        head += s.recv(8 - len(head))
    n = struct.unpack("<Q", head)[0]
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        assert chunk, "the handshake port closed"
        body += chunk
    s.close()
    return json.loads(body[1:])


@pytest.fixture
def plain_env(monkeypatch):
    """No transport or NIC choice in the environment (scripts/python-test sets MC_FORCE_TCP=1)."""
    for v in ("MC_FORCE_TCP", "KVFERRY_TRANSPORT", "KVFERRY_RDMA_DEVICES", "MC_TE_FILTERS", "KVFERRY_AUTO_RDMA", "MC_FORCE_HCA"):
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_initialize_protocol_rdma_is_rdma_or_a_clear_failure(te, caplog, plain_env):
    """Issue 45: protocol="rdma" makes the engine RDMA-only, as a Mooncake RDMA engine: it
    publishes an RDMA descriptor, or (on a host without a usable RDMA NIC, such as CI's)
    initialize returns -1 and logs the cause and the fix. device_name names the NICs."""
    import kvferry

    if kvferry.features()["rdma"]:
        # (The Soft-RoCE VM checks this against a stock Mooncake RDMA initiator.)
        assert te.initialize(HOST, "P2PHANDSHAKE", "rdma", "") == 0
        assert _published(te)["protocol"] == "rdma"
        return
    for dev, needle in (("", 'protocol="rdma" asks for RDMA only'), ("mlx5_0, mlx5_1", 'device_name="mlx5_0,mlx5_1"')):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvferry"):
            assert te.initialize(HOST, "P2PHANDSHAKE", "rdma", dev) == -1
        msgs = [r.getMessage() for r in caplog.records if r.name == "kvferry"]
        assert len(msgs) == 1, msgs
        m = msgs[0]
        assert needle in m and "this host cannot do it" in m, m
        assert "Fix:" in m and 'protocol="tcp"' in m and "kvferry doctor" in m, m
        assert te.get_rpc_port() == -1, "not initialized"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert te.initialize_ext(HOST, "P2PHANDSHAKE", "rdma", "", "p2p") == -1
    assert "RDMA only" in caplog.text
    # A NIC priority matrix is not a list of NIC names.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", '{"cpu:0": [["mlx5_0"], []]}') == -1
    assert "comma-separated" in caplog.text and "KVFERRY_RDMA_TOPO" in caplog.text
    # The native API raises the same.
    with pytest.raises(kvferry.ConfigError, match="RDMA only"):
        kvferry.Engine(HOST, protocol="rdma")


def test_initialize_protocol_tcp_publishes_tcp_and_env_vars_win(te, plain_env):
    """protocol="tcp" publishes a TCP descriptor (any Mooncake TCP engine reaches it);
    Mooncake's MC_FORCE_TCP=1 and an explicit KVFERRY_TRANSPORT win over protocol="rdma"."""
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "mlx5_0") == 0
    assert _published(te)["protocol"] == "tcp"
    plain_env.setenv("MC_FORCE_TCP", "1")
    assert te.initialize(HOST, "P2PHANDSHAKE", "rdma", "mlx5_0") == 0
    assert _published(te)["protocol"] == "tcp"
    plain_env.delenv("MC_FORCE_TCP")
    plain_env.setenv("KVFERRY_TRANSPORT", "tcp")
    assert te.initialize(HOST, "P2PHANDSHAKE", "rdma", "") == 0
    assert _published(te)["protocol"] == "tcp"


def test_store_setup_protocol_rdma_is_rdma_or_a_clear_failure(plain_env):
    """The store's setup(..., protocol, rdma_devices, ...) the same way (no master needed: the
    engine is checked first)."""
    import kvferry
    from kvferry.store import Store

    if kvferry.features()["rdma"]:
        # A host that can do RDMA starts the engine, and setup goes on to the master, which is
        # not there: the failure is the master's, never the protocol's.
        with pytest.raises(kvferry.KvferryError, match="cannot reach the master at 127.0.0.1:1") as ei:
            Store(HOST, "P2PHANDSHAKE", 0, 0, "rdma", "", "127.0.0.1:1")
        assert "RDMA only" not in str(ei.value)
        return
    with pytest.raises(kvferry.KvferryError, match="RDMA only") as ei:
        Store(HOST, "P2PHANDSHAKE", 0, 0, "rdma", "mlx5_0", "127.0.0.1:1")
    assert "Fix:" in str(ei.value) and 'device_name="mlx5_0"' in str(ei.value)


def test_reinitialize_replaces_engine(te):
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    first = te._core
    assert te.initialize_ext(HOST, "P2PHANDSHAKE", "tcp", "", "p2p") == 0
    assert te._core is not first and first.closed


def test_get_engine_shares_the_engine(te):
    import kvferry

    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    native = te.get_engine()
    assert isinstance(native, kvferry.Engine)
    assert native.rpc_port == te.get_rpc_port()
    assert te.get_engine() is native
    addr = te.allocate_managed_buffer(4096)
    assert addr in [r.addr for r in native.registered()]
    assert te.get_engine_ptr() == 0


def test_sync_deadline_honours_mc_transfer_timeout(monkeypatch):
    """MC_TRANSFER_TIMEOUT bounds sync calls (plus 1 ns per byte); a stalled peer gives -1."""
    from kvferry.mooncake.engine import TransferEngine

    from test_native import _StalledPeer

    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")
    monkeypatch.delenv("KVFERRY_TRANSFER_TIMEOUT", raising=False)
    te = TransferEngine()
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    try:
        assert te._core.transfer_timeout == 1.0
        buf = Buf(4096)
        assert te.register_memory(buf.addr, 4096) == 0
        with _StalledPeer(te.get_engine()) as peer:
            t0 = time.monotonic()
            assert te.transfer_sync_write(peer.segment, buf.addr, peer.remote_addr, 4096) == -1
            assert time.monotonic() - t0 < 8
            x = te.transfer_submit_write(peer.segment, buf.addr, peer.remote_addr, 4096)
            assert x != 0
            assert te.transfer_check_status(x) == 0
            assert wait_for(lambda: te.transfer_check_status(x) == -2, timeout=8)
            y = te.batch_transfer_async_write(peer.segment, [buf.addr], [peer.remote_addr], [4096])
            assert te.get_batch_transfer_status([y]) == -1
    finally:
        te._core.close()


def test_async_batches_polled_to_completion(te_pair):
    """Many async batches in flight at once, polled with transfer_check_status."""
    a, b = te_pair
    n, blk = 16, 65536
    src, dst = Buf(n * blk), Buf(n * blk)
    src.fill(11)
    assert a.register_memory(src.addr, src.size) == 0
    assert b.register_memory(dst.addr, dst.size) == 0
    seg = "%s:%d" % (HOST, b.get_rpc_port())
    ids = [a.batch_transfer_async_write(seg, [src.addr + i * blk], [dst.addr + i * blk], [blk]) for i in range(n)]
    assert all(ids) and len(set(ids)) == n
    pending = set(ids)
    end = time.monotonic() + 20
    while pending and time.monotonic() < end:
        for x in list(pending):
            r = a.transfer_check_status(x)
            assert r in (0, 1), r
            if r == 1:
                pending.discard(x)
    assert not pending
    assert dst.sha() == src.sha()
    # and get_batch_transfer_status over a list of READ batches
    back = Buf(n * blk)
    assert a.register_memory(back.addr, back.size) == 0
    ids = [a.batch_transfer_async_read(seg, [back.addr + i * blk], [dst.addr + i * blk], [blk]) for i in range(n)]
    assert a.get_batch_transfer_status(ids) == 0
    assert back.sha() == src.sha()


def test_type_errors_look_like_pybind(te):
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    with pytest.raises(TypeError) as ei:
        te.register_memory(-1, 4096)
    msg = str(ei.value)
    assert msg.startswith("register_memory(): incompatible function arguments.")
    assert "buffer_addr: int, capacity: int, location: str = '*'" in msg
    with pytest.raises(TypeError):
        te.transfer_sync_write("x", 1, 2, 3, None)
    with pytest.raises(TypeError):
        te.batch_transfer_sync_write("x", "abc", [1], [1])
    with pytest.raises(TypeError):
        te.get_batch_transfer_status(5)
    with pytest.raises(TypeError):
        te.transfer_check_status(-1)
    with pytest.raises(TypeError):
        te.get_local_topology(5)


def test_exact_names():
    import kvferry.mooncake
    import kvferry.mooncake.engine as me

    assert set(me.__all__) == {
        "TransferEngine", "TransferNotify", "TransferOpcode", "InnerTransferEngine", "Read", "Write",
        "SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_INTRA_NVLINK", "SUPPORT_MNNVL", "SUPPORT_MUSA",
        "ScatterTransferTicket", "ScatterTransferCompletionStatus",  # 0.3.14
    }
    from kvferry.mooncake.buffer_pool import BufferPool

    assert kvferry.mooncake.BufferPool is BufferPool and kvferry.mooncake.RegisteredBufferPool is BufferPool
    with pytest.raises(AttributeError, match="not provided by kvferry"):
        me.RpcInterface
    assert repr(me.TransferNotify("a", "b")) == "TransferNotify(name='a', msg='b')"
    assert me.TransferNotify("a", "b") == me.TransferNotify("a", "b")
