"""Store high availability from Python: Mooncake's `master_server_addr = "etcd://..."` through
`MooncakeDistributedStore.setup` and kvferry's `Store`, against a real etcd (Debian's `etcd`,
started here on free ports, killed by pid) and two `kvferry master --enable_ha` processes
launched with Mooncake's flags. The leader is SIGKILLed; the clients keep working with the
new one. The new leader starts from what the old one had acknowledged (its in-sync mirror, or
the etcd journal while it was not in sync yet), so what was put before the kill is still
there."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

from kvferry.mooncake.store import MooncakeDistributedStore
from test_store import kvferry_bin


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    def __init__(self) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            if os.environ.get("KVFERRY_SKIP_SERVICES") == "1":
                pytest.skip("NOT RUN (KVFERRY_SKIP_SERVICES=1): etcd is missing")
            raise AssertionError("etcd is missing: apt-get install etcd-server (scripts/test does), or set KVFERRY_SKIP_SERVICES=1 to leave this test out")
        self.dir = tempfile.mkdtemp(prefix="kvferry-py-etcd-")
        self.port, peer = free_port(), free_port()
        c, p = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        args = [binary, "--data-dir", os.path.join(self.dir, "data"), "--listen-client-urls", c, "--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p, "--initial-cluster", f"default={p}", "--log-level", "error"]
        self.p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while True:
            try:
                if b'"health":"true"' in urllib.request.urlopen(f"{c}/health", timeout=1).read():
                    return
            except OSError:
                pass
            assert self.p.poll() is None and time.time() < deadline, "etcd did not become ready"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


class HaMaster:
    def __init__(self, etcd_port: int) -> None:
        args = ["master", "--rpc_port=0", "--metrics_port=0", "--enable_metric_reporting=false", "--enable_ha", "--ha_backend_connstring", f"etcd://127.0.0.1:{etcd_port}", "--ha-lease-ttl=2s"]
        env = {k: v for k, v in os.environ.items() if k not in ("MC_STORE_CLUSTER_ID", "KVFERRY_STORE_CLUSTER_ID")}
        self.p = subprocess.Popen([kvferry_bin()] + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = self.p.stdout.readline()
        assert line.startswith("KVFERRY_MASTER") and "ha=mooncake-store/mooncake_cluster/master_view" in line, line
        self.http = next(w[len("http=") :] for w in line.split() if w.startswith("http="))

    def role(self) -> str:
        return urllib.request.urlopen(f"http://{self.http}/role", timeout=5).read().decode()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait(timeout=10)


def leader_of(masters, timeout: float = 10.0) -> int:
    deadline = time.time() + timeout
    while True:
        roles = [m.role() for m in masters]
        if roles.count("leader") == 1 and roles.count("standby") == len(masters) - 1:
            return roles.index("leader")
        assert roles.count("leader") <= 1, roles
        assert time.time() < deadline, roles
        time.sleep(0.05)


def test_mooncake_store_follows_the_leader_through_etcd():
    etcd = Etcd()
    masters = []
    store = MooncakeDistributedStore()
    try:
        masters = [HaMaster(etcd.port), HaMaster(etcd.port)]
        lead = leader_of(masters)
        addr = f"etcd://127.0.0.1:{etcd.port}"
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", addr) == 0
        assert store.put("before", b"b" * 50_000) == 0
        assert store.get("before") == b"b" * 50_000
        masters[lead].kill()
        other = masters[1 - lead]
        deadline = time.time() + 4.0  # 2 x the lease TTL
        while other.role() != "leader":
            assert time.time() < deadline, "the standby did not lead within 2 x TTL"
            time.sleep(0.02)
        deadline = time.time() + 15
        while store.put("after", b"a" * 50_000) != 0:
            assert time.time() < deadline, "the client never worked with the new leader"
            time.sleep(0.1)
        assert store.get("after") == b"a" * 50_000
        # The new leader loaded the old one's journal: the object put before the kill is there.
        assert store.is_exist("before") == 1
        assert store.get("before") == b"b" * 50_000
    finally:
        store.close()
        for m in masters:
            m.kill()
        etcd.stop()
