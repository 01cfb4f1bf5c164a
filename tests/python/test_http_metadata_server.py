"""mooncake.http_metadata_server on kvferry: KVBootstrapServer and `python -m`, serving the
HTTP metadata contract through the kvferry binary, on 127.0.0.1."""

from __future__ import annotations

import http.client
import os
import select
import socket
import subprocess
import sys
import time

import pytest

from kvferry.mooncake import http_metadata_server as hms
from kvferry.mooncake.http_metadata_server import KVBootstrapServer, KVPoll
from test_store import kvferry_bin

HOST = "127.0.0.1"


def req(port, method, path, body=None):
    c = http.client.HTTPConnection(HOST, port, timeout=5)  # no proxy: straight to 127.0.0.1
    try:
        c.request(method, path, body=body)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def check_contract(port):
    assert req(port, "GET", "/metadata?key=mooncake/ram/a")[0] == 404
    assert req(port, "PUT", "/metadata?key=mooncake/ram/a", b'{"x": 1}') == (200, b"metadata updated")
    assert req(port, "GET", "/metadata?key=mooncake/ram/a") == (200, b'{"x": 1}')
    assert req(port, "PUT", "/metadata?key=mooncake/ram/a", b'{"x": 2}')[0] == 200
    assert req(port, "GET", "/metadata?key=mooncake/ram/a") == (200, b'{"x": 2}')
    assert req(port, "GET", "/metadata")[0] == 400, "no key"
    assert req(port, "DELETE", "/metadata?key=mooncake/ram/a") == (200, b"metadata deleted")
    assert req(port, "GET", "/metadata?key=mooncake/ram/a")[0] == 404
    assert req(port, "DELETE", "/metadata?key=mooncake/ram/a")[0] == 404


def refused(port):
    try:
        socket.create_connection((HOST, port), timeout=2).close()
        return False
    except OSError:
        return True


def gone(pid):
    try:
        os.kill(pid, 0)
        return False
    except ProcessLookupError:
        return True


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.fixture()
def kv_bin(monkeypatch):
    b = kvferry_bin()
    assert os.path.exists(b), "build the kvferry binary first (cargo build --release -p kvferry-cli)"
    monkeypatch.setenv("KVFERRY_BIN", b)
    return b


def test_kvbootstrapserver_serves_and_stops(kv_bin):
    srv = KVBootstrapServer(0, HOST)
    assert srv.poll() == KVPoll.Failed, "not started"
    t = srv.run()
    try:
        assert srv.port != 0 and t.is_alive() and srv.poll() == KVPoll.Success
        assert srv.url == "http://127.0.0.1:%d/metadata" % srv.port
        check_contract(srv.port)
        pid = srv.pid
    finally:
        srv.close()
    assert srv.poll() == KVPoll.Failed and not t.is_alive()
    assert gone(pid) and refused(srv.port)
    srv.close()  # twice is fine


def test_kvbootstrapserver_as_context_manager_and_port_taken(kv_bin):
    with KVBootstrapServer(0, HOST) as a:
        assert req(a.port, "PUT", "/metadata?key=k", b"v")[0] == 200
        b = KVBootstrapServer(a.port, HOST)
        with pytest.raises(RuntimeError, match="did not start on 127.0.0.1:%d" % a.port):
            b.run()
        assert b.poll() == KVPoll.Failed
        assert req(a.port, "GET", "/metadata?key=k") == (200, b"v"), "the first one still serves"
    assert refused(a.port)


def test_without_kvferry_bin_the_wheels_own_command_serves(monkeypatch):
    monkeypatch.delenv("KVFERRY_BIN", raising=False)
    # Whatever is on PATH or next to the package is not needed: the extension carries the CLI.
    monkeypatch.setattr(hms, "_candidates", lambda: [])
    assert hms.kvferry_command() == [sys.executable, "-m", "kvferry"]
    with KVBootstrapServer(0, HOST) as srv:
        assert srv.poll() == KVPoll.Success
        check_contract(srv.port)
        pid = srv.pid
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[1:4] == [b"-m", b"kvferry", b"metadata-server"], argv
    assert gone(pid) and refused(srv.port)


def test_missing_binary_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFERRY_BIN", str(tmp_path / "no-kvferry"))
    with pytest.raises(FileNotFoundError, match="KVFERRY_BIN"):
        KVBootstrapServer(0, HOST).run()
    monkeypatch.delenv("KVFERRY_BIN")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(hms, "_candidates", lambda: [str(tmp_path / "kvferry")])
    with pytest.raises(FileNotFoundError, match="kvferry metadata-server"):
        hms.find_kvferry_binary()
    with pytest.raises(TypeError):
        KVBootstrapServer("8080")  # type: ignore[arg-type]


@pytest.mark.parametrize("module,shim", [("mooncake.http_metadata_server", True), ("kvferry.mooncake.http_metadata_server", False)])
def test_python_dash_m_serves_until_terminated(kv_bin, module, shim):
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("KVFERRY_MOONCAKE_SHIM", None)
    if shim:
        env["KVFERRY_MOONCAKE_SHIM"] = "1"
    p = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), "--host", HOST], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 30)
        line = p.stdout.readline().decode() if ready else ""
        assert "port=%d" % port in line, "%r / stderr: %s" % (line, p.stderr.read().decode() if p.poll() is not None else "")
        check_contract(port)
    finally:
        p.terminate()
        rc = p.wait(10)
    assert rc is not None and gone(p.pid) and refused(port)


def test_python_dash_m_without_binary_says_so(tmp_path):
    env = dict(os.environ, KVFERRY_BIN=str(tmp_path / "none"), KVFERRY_MOONCAKE_SHIM="1")
    r = subprocess.run([sys.executable, "-m", "mooncake.http_metadata_server", "--port", "0"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "KVFERRY_BIN" in r.stderr, r.stderr


def test_shim_serves_the_module():
    import importlib.util

    import kvferry

    kvferry.install_mooncake_shim()
    try:
        assert importlib.util.find_spec("mooncake.http_metadata_server") is not None
        import mooncake.http_metadata_server as m

        assert m.KVBootstrapServer is KVBootstrapServer and m.KVPoll is KVPoll
    finally:
        kvferry.uninstall_mooncake_shim()
