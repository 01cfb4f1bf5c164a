"""Issue 11 drop-in cases through Mooncake's API (kvferry.mooncake.store), in Mooncake's
deployment shape: `kvferry master` with the embedded HTTP metadata server, clients of one
host passing the same bare hostname, and put_from -> get_into -> remove(force) cycles over a
segment much smaller than what goes through it."""

from __future__ import annotations

import socket
import subprocess
import time

import numpy as np

from kvferry.mooncake.store import MooncakeDistributedStore
from test_store import kvferry_bin


class Master:
    """A `kvferry master` with the embedded metadata server; killed (this process only) on stop."""

    def __init__(self) -> None:
        args = ["master", "--port", "0", "--metrics-port", "0", "--summary-interval", "0", "--enable-http-metadata-server", "--http-metadata-server-port", "0"]
        self.p = subprocess.Popen([kvferry_bin()] + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.line = self.p.stdout.readline()
        assert self.line.startswith("KVFERRY_MASTER"), self.line
        self.rpc = self.field("rpc=")
        self.metadata = self.field("metadata=")
        host, port = self.metadata[len("http://") : -len("/metadata")].rsplit(":", 1)
        deadline = time.time() + 10
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "the embedded metadata server never listened"
                time.sleep(0.05)

    def field(self, key: str) -> str:
        return next(w[len(key) :] for w in self.line.split() if w.startswith(key))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)


def value(key: str, version: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(abs(hash((key, version))) % (1 << 32))
    return rng.integers(0, 256, n, dtype=np.uint8)


def test_two_clients_with_one_hostname_both_set_up():
    m = Master()
    stores = []
    try:
        for _ in range(2):
            s = MooncakeDistributedStore()
            assert s.setup("127.0.0.1", m.metadata, 16 << 20, 16 << 20, "tcp", "", m.rpc) == 0
            stores.append(s)
        a, b = stores
        ha, hb = a.get_hostname(), b.get_hostname()
        assert ha != hb, (ha, hb)
        for h in (ha, hb):
            host, port = h.rsplit(":", 1)
            assert host == "127.0.0.1" and 12300 <= int(port) <= 14300, h
        assert a.put("from-a", b"A" * 100_000) == 0
        assert b.put("from-b", b"B" * 100_000) == 0
        for s in (a, b):
            assert s.get("from-a") == b"A" * 100_000
            assert s.get("from-b") == b"B" * 100_000
    finally:
        for s in stores:
            s.close()
        m.stop()


def test_put_get_remove_cycles_reuse_a_small_segment():
    m = Master()
    provider, user = MooncakeDistributedStore(), MooncakeDistributedStore()
    try:
        seg = 4 << 20
        assert provider.setup("127.0.0.1", m.metadata, seg, 0, "tcp", "", m.rpc) == 0
        assert user.setup("127.0.0.1", m.metadata, 0, 0, "tcp", "", m.rpc) == 0
        src = np.zeros(1 << 20, dtype=np.uint8)
        dst = np.zeros(1 << 20, dtype=np.uint8)
        assert user.register_buffer(src.ctypes.data, src.nbytes) == 0
        assert user.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        failures, moved, i = [], 0, 0
        stop = time.time() + 3
        while time.time() < stop and len(failures) < 5:
            n = (64 << 10) if i % 2 == 0 else (1 << 20)
            key = "cyc-%d" % (i % 16)
            v = value(key, i, n)
            src[:n] = v
            i += 1
            rc = user.put_from(key, src.ctypes.data, n)
            if rc != 0:
                failures.append("put_from %s -> %d" % (key, rc))
                continue
            got = user.get_into(key, dst.ctypes.data, dst.nbytes)
            if got != n or not np.array_equal(dst[:n], v):
                failures.append("get_into %s right after its put -> %d" % (key, got))
            rc = user.remove(key, force=True)
            if rc != 0:
                failures.append("remove %s -> %d" % (key, rc))
            moved += n
        assert not failures, failures
        assert moved >= 8 * seg, "only %d bytes went through the %d-byte segment" % (moved, seg)
    finally:
        user.close()
        provider.close()
        m.stop()
