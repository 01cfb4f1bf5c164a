"""Issue 45: no byte lands in a caller's buffer after a call reported its request over.

A fake peer answers a READ's status at once and then trickles the data, one byte every few
milliseconds, so bytes keep arriving past the request's deadline (MC_TRANSFER_TIMEOUT). Its
handshake port answers slowly, as a loaded peer's may: the engine starts a request's clock
only once it has the peer's descriptor. Whatever reports the request over (failed or timed
out) through Mooncake's asynchronous API must do so only once nothing more can land in the
buffer: the test keeps the peer sending until the engine cut it off, then checks that the
buffer did not change after the report.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import threading
import time

import pytest

from conftest import HOST
from test_native import _recv_exact, _StalledPeer

LEN = 4096
# v2 status frame: magic, status 0 (OK).
OK = struct.pack("<Q", 0x4D435456 << 32)


class _TricklingPeer(_StalledPeer):
    """Answers its handshake after `hs_delay` s; on its data port answers each READ with OK
    and then its bytes (0xEE), one every 2 ms, until the connection is cut (`cut` is set
    then) or all were sent."""

    def __init__(self, engine, hs_delay: float):
        self.hs_delay = hs_delay
        self.cut = threading.Event()
        self.sent = 0
        super().__init__(engine)

    def _serve_hs(self):
        while not self._stop:
            try:
                c, _ = self.hs.accept()
            except OSError:
                return
            try:
                n = struct.unpack("<Q", _recv_exact(c, 8))[0]
                kind = _recv_exact(c, n)[0]
                time.sleep(self.hs_delay)  # a slow peer, not synchronisation
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
            self._conns.append(c)
            threading.Thread(target=self._trickle, args=(c,), daemon=True).start()

    def _trickle(self, c):
        try:
            size, _addr, op = struct.unpack("<QQB7x", _recv_exact(c, 24))
            assert op & 0x7F == 0, "a READ (0x80: v2 framing)"
            c.sendall(OK)
            until = time.monotonic() + 20
            for _ in range(size):
                if self._stop or time.monotonic() > until:
                    return
                c.sendall(b"\xee")
                self.sent += 1
                time.sleep(0.002)  # the trickle's pace, not synchronisation
        except OSError:
            pass
        finally:
            self.cut.set()


@pytest.mark.parametrize("report", ["get_batch_transfer_status", "transfer_check_status"])
def test_an_async_read_reported_over_gets_no_more_bytes(monkeypatch, report):
    from kvferry.mooncake.engine import TransferEngine

    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")
    monkeypatch.setenv("KVFERRY_TRANSPORT", "tcp")
    te = TransferEngine()
    assert te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    buf = ctypes.create_string_buffer(LEN)
    addr = ctypes.addressof(buf)
    assert te.register_memory(addr, LEN) == 0
    peer = _TricklingPeer(te.get_engine(), hs_delay=0.3)
    try:
        t0 = time.monotonic()
        bid = te.batch_transfer_async_read(peer.segment, [addr], [peer.remote_addr], [LEN])
        assert bid != 0
        if report == "get_batch_transfer_status":
            ret = te.get_batch_transfer_status([bid])
        else:
            until = time.monotonic() + 10
            ret = 0
            while ret == 0:
                assert time.monotonic() < until, "transfer_check_status said in progress for 10 s"
                ret = te.transfer_check_status(bid)
                time.sleep(0.001)
        took = time.monotonic() - t0
        after_report = bytes(buf.raw)
        landed = after_report.count(b"\xee")
        assert ret in (-1, -2), "%s returned %d" % (report, ret)
        assert 0 < landed < LEN, "%d bytes had landed when the READ was reported over" % landed
        assert took < 5, "reported over after %.2f s (timeout 1 s)" % took
        # The peer sends until the engine cut its connection.
        assert peer.cut.wait(10), "the engine never cut the trickling connection"
        now = bytes(buf.raw)
        assert now == after_report, "%d more bytes landed in the buffer after %s reported the READ over (%d)" % (
            now.count(b"\xee") - landed,
            report,
            ret,
        )
    finally:
        peer.__exit__(None, None, None)
        te.unregister_memory(addr)
        te.get_engine().close()
