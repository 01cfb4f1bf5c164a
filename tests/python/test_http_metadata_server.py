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


# -- parity with stock Mooncake 0.3.14's Python server (mooncake.http_metadata_server) ---------

# The stock server in its own interpreter: listens on the port given, prints "ready", serves
# until stdin closes.
_STOCK_SERVER = r"""
import sys, socket, time
from mooncake.http_metadata_server import KVBootstrapServer
port = int(sys.argv[1])
KVBootstrapServer(port, host="127.0.0.1").run()
end = time.monotonic() + 20
while True:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > end:
            raise SystemExit("stock server did not listen")
        time.sleep(0.02)  # polling the port with a deadline
print("ready", flush=True)
sys.stdin.read()
"""

# (method, path, body): what 0.3.14 refuses (no key, empty, blank), strips (" k "), and
# the rest of the contract; run in order against each server.
_REQUESTS = [
    ("GET", "/metadata", None),
    ("PUT", "/metadata", b"v"),
    ("DELETE", "/metadata", None),
    ("GET", "/metadata?key=", None),
    ("PUT", "/metadata?key=", b"v"),
    ("PUT", "/metadata?key=%20%20%20", b"v"),
    ("DELETE", "/metadata?key=%20", None),
    ("GET", "/metadata?key=+", None),
    ("PUT", "/metadata?key=%20%20valid%20%20", b"value-1"),
    ("GET", "/metadata?key=valid", None),
    ("GET", "/metadata?key=%20valid", None),
    ("GET", "/metadata?key=valid%09", None),
    ("PUT", "/metadata?key=valid", b"value-2"),
    ("GET", "/metadata?key=++valid++", None),
    ("POST", "/metadata?key=valid", b"x"),
    ("POST", "/metadata", b"x"),
    ("DELETE", "/metadata?key=valid%20", None),
    ("GET", "/metadata?key=valid", None),
    ("DELETE", "/metadata?key=valid", None),
    ("PUT", "/metadata?key=a%2Frpc_meta%2Fb", b"A"),
    ("PUT", "/metadata?key=a/rpc_meta/b", b"A"),
    ("PUT", "/metadata?key=a/rpc_meta/b", b"B"),
    ("GET", "/metadata?key=%20a/rpc_meta/b", None),
    ("PUT", "/metadata?key=a+b&x=1", b""),
    ("GET", "/metadata?x=1&key=a%20b", None),
    ("GET", "/metadata?key=missing", None),
]


def _replay(port, requests=_REQUESTS):
    return [[m, p, *req(port, m, p, b)] for m, p, b in requests]


def _stock_replay(requests, env=None):
    """The requests against stock 0.3.14's server (started with `env` added)."""
    from conftest import peer_env, stock_python

    port = free_port()
    e = dict(peer_env(False), **(env or {}))
    stock = subprocess.Popen([stock_python("0.3.14"), "-c", _STOCK_SERVER, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=e)
    try:
        ready, _, _ = select.select([stock.stdout], [], [], 30)
        assert ready and stock.stdout.readline().strip() == "ready", stock.stderr.read() if stock.poll() is not None else "no answer"
        return _replay(port, requests)
    finally:
        stock.stdin.close()
        stock.kill()
        stock.wait(timeout=10)


def _our_replay(requests, monkeypatch, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    with KVBootstrapServer(0, host=HOST) as srv:
        srv.run()
        return _replay(srv.port, requests)


def test_key_validation_and_contract_match_stock_0_3_14(kv_bin, monkeypatch):
    theirs = _stock_replay(_REQUESTS)
    ours = _our_replay(_REQUESTS, monkeypatch)
    # Bodies compared as bytes, statuses as numbers: every request, in order.
    assert [tuple(x) for x in ours] == [tuple(x) for x in theirs]
    # The cases reach each answer: refused keys, stripped keys, 404, 405 and the rpc_meta rules.
    statuses = {x[2] for x in theirs}
    assert {200, 400, 404, 405} <= statuses
    assert [b"metadata key is required"] == list({x[3] for x in theirs if x[2] == 400 and "rpc_meta" not in x[1]})


_BUDGET_ENV = {"MC_METADATA_MAX_KEYS": "2", "MC_METADATA_MAX_TOTAL_BYTES": "32", "MC_METADATA_MAX_BODY_BYTES": "16"}
_BUDGET_REQUESTS = [
    ("PUT", "/metadata?key=k1", b"0123456789"),
    ("PUT", "/metadata?key=k2", b"01234567890123456"),  # 17 bytes: over the body limit
    ("PUT", "/metadata?key=k2", b"0123456789012345"),
    ("PUT", "/metadata?key=k3", b"x"),  # a third key
    ("PUT", "/metadata?key=k1", b"0123456789012"),  # replacing k1: 30 - 12 + 15 > 32
    ("PUT", "/metadata?key=k1", b"abcdefghij"),  # 30 - 12 + 12 fits
    ("GET", "/metadata?key=k1", None),
    ("DELETE", "/metadata?key=k2", None),
    ("PUT", "/metadata?key=k3", b"x"),
    ("GET", "/metadata?key=k3", None),
]


def test_budgets_match_stock_0_3_14(kv_bin, monkeypatch):
    """MC_METADATA_MAX_KEYS / MAX_TOTAL_BYTES / MAX_BODY_BYTES: the same answers as 0.3.14's
    server (the 413 body aside: kvferry's names the limit and the flag)."""
    theirs = _stock_replay(_BUDGET_REQUESTS, _BUDGET_ENV)
    ours = _our_replay(_BUDGET_REQUESTS, monkeypatch, _BUDGET_ENV)
    strip = lambda rows: [tuple(x[:3]) if x[2] == 413 else tuple(x) for x in rows]  # noqa: E731
    assert strip(ours) == strip(theirs)
    assert {413, 507, 200, 404} >= {x[2] for x in theirs} and {413, 507} <= {x[2] for x in theirs}


def test_bad_budget_variables_and_open_binds_are_refused_as_stock(monkeypatch):
    monkeypatch.setenv("MC_METADATA_MAX_KEYS", "0")
    with pytest.raises(ValueError, match="MC_METADATA_MAX_KEYS must be a positive integer"):
        KVBootstrapServer(0, host=HOST)
    monkeypatch.delenv("MC_METADATA_MAX_KEYS")
    for var in ("MC_METADATA_HTTP_TOKEN", "KVFERRY_METADATA_HTTP_TOKEN", "MC_METADATA_HTTP_ALLOW_INSECURE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="refuses to bind 0.0.0.0:.*without an authentication token"):
        KVBootstrapServer(0, host="0.0.0.0").run()
    r = subprocess.run([sys.executable, "-m", "kvferry.mooncake.http_metadata_server", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "MC_METADATA_HTTP_ALLOW_INSECURE" in r.stderr, r.stderr
