"""Every Python module of Mooncake 0.3.14's wheel through kvferry's ``mooncake`` shim: served
(imports, mapped onto kvferry) or refused with its reason (``MooncakeModuleUnavailable``,
never Python's bare "No module named ..."); and the served pure-Python modules compared with
the stock ones (``mooncake_config``, ``async_store``, ``cli``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import peer_env, stock_python
from test_store import cluster, value  # noqa: F401 - the fixture is used by name

from kvferry import _mooncake_modules as registry

# Lists the modules of the installed stock wheel: every .py file and extension module under
# mooncake/, and every directory (a package, or a namespace package such as _pg_jit).
_LIST_STOCK = r"""
import json, os, mooncake
root = os.path.dirname(mooncake.__file__)
names = set()
for d, dirs, files in os.walk(root):
    dirs[:] = [x for x in dirs if x != "__pycache__" and x.isidentifier()]
    rel = os.path.relpath(d, os.path.dirname(root)).replace(os.sep, ".")
    names.add(rel)
    for f in files:
        base = f.split(".")[0]
        if f == "__init__.py" or not base.isidentifier() or f.startswith("lib"):
            continue
        if f.endswith(".py") or f.endswith(".so"):
            names.add(rel + "." + base)
print(json.dumps(sorted(names)))
"""

# Imports each name under the shim and reports how it went.
_IMPORT_ALL = r"""
import importlib, json, sys
out = {}
for n in json.loads(sys.argv[1]):
    try:
        m = importlib.import_module(n)
        out[n] = ["ok", getattr(m, "__kvferry_target__", None)]
    except BaseException as e:
        out[n] = [type(e).__name__, getattr(e, "name", None), str(e)]
print(json.dumps(out))
"""


def _py(python: str, code: str, *args: str, shim: bool = False, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    e = peer_env(shim)
    e.update(env or {})
    return subprocess.run([python, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=e)


@pytest.fixture(scope="module")
def stock314() -> str:
    return stock_python("0.3.14")


@pytest.fixture(scope="module")
def stock_modules(stock314) -> list:
    r = _py(stock314, _LIST_STOCK)
    assert r.returncode == 0, r.stderr
    names = json.loads(r.stdout)
    assert "mooncake.engine" in names and "mooncake.store" in names and len(names) > 50, names
    return names


def test_every_0_3_14_module_is_classified(stock_modules):
    """The table names each module of the stock wheel (no module left to Python's bare
    ModuleNotFoundError), and names nothing the wheel does not have (no stale entry)."""
    unclassified = [n for n in stock_modules if registry.status(n)[0] == "unknown"]
    assert unclassified == [], "modules of Mooncake 0.3.14 missing from kvferry/_mooncake_modules.py: %s" % unclassified
    listed = set(registry.SERVED) | set(registry.REFUSED) | set(registry.REFUSED_TREES)
    stale = sorted(listed - set(stock_modules))
    assert stale == [], "names in kvferry/_mooncake_modules.py that Mooncake 0.3.14's wheel does not have: %s" % stale


def test_every_0_3_14_module_imports_or_says_why(stock_modules):
    r = _py(sys.executable, _IMPORT_ALL, json.dumps(stock_modules), shim=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    for name in stock_modules:
        kind, target = registry.status(name)
        res = got[name]
        if kind == "served":
            assert res == ["ok", target], (name, res)
            continue
        assert res[0] == "MooncakeModuleUnavailable", (name, res)
        # The refused module itself, or the refused package above it, is named with the reason.
        refused_at = res[1]
        assert name == refused_at or name.startswith(refused_at + "."), (name, res)
        assert registry.refusal(refused_at) in res[2], (name, res)
        assert "No module named" not in res[2], (name, res)


def test_refusals_are_import_errors_that_find_spec_sees():
    r = _py(sys.executable, textwrap.dedent("""
        import importlib.util
        assert importlib.util.find_spec("mooncake.structured_object_store") is not None
        assert importlib.util.find_spec("mooncake.not_in_any_wheel") is None
        for n in ("mooncake.structured_object_store", "mooncake.mooncake_connector_v1"):
            try:
                __import__(n)
            except ModuleNotFoundError as e:   # also an ImportError
                print(n, "->", e.name, "|", e)
        try:
            import mooncake.not_in_any_wheel
        except ModuleNotFoundError as e:
            print("other ->", e)
        """), shim=True)
    assert r.returncode == 0, r.stderr
    assert "mooncake.structured_object_store -> mooncake.structured_object_store | mooncake.structured_object_store is not provided by kvferry" in r.stdout
    assert "vLLM's built-in MooncakeConnector" in r.stdout
    assert "other -> No module named 'mooncake.not_in_any_wheel'" in r.stdout


# -- mooncake_config: the same inputs through stock 0.3.14 and kvferry ------------------------

_CONFIG_CASES = r"""
import json, os, sys, tempfile, logging
logging.disable(logging.CRITICAL)
if sys.argv[1] == "stock":
    import mooncake.mooncake_config as mc
else:
    import kvferry.mooncake.mooncake_config as mc
base = {"local_hostname": "h", "metadata_server": "P2PHANDSHAKE", "master_server_address": "127.0.0.1:50051"}
files = {
    "minimal": base,
    "sizes": dict(base, global_segment_size="16MB", local_buffer_size="1.5 gb"),
    "sizes_k": dict(base, global_segment_size="4k", local_buffer_size=" 2 TB "),
    "bytes_str": dict(base, global_segment_size="123", local_buffer_size=7),
    "bad_size": dict(base, global_segment_size="MB"),
    "empty_size": dict(base, global_segment_size=""),
    "negative": dict(base, local_buffer_size=-1),
    "proto_upper": dict(base, protocol="  RDMA "),
    "proto_unknown": dict(base, protocol="carrier-pigeon"),
    "proto_empty": dict(base, protocol=" "),
    "bools": dict(base, enable_ssd_offload="yes", enable_client_http_server="off"),
    "bad_bool": dict(base, enable_ssd_offload="maybe"),
    "none_fields": dict(base, ssd_offload_path=None, tenant_id=None, device_name=None),
    "port_str": dict(base, client_http_port="19300", tenant_id=5),
    "missing_master": {"local_hostname": "h", "metadata_server": "m"},
    "blank_host": dict(base, local_hostname="  "),
}
envs = {
    "env_none": {},
    "env_master": {"MOONCAKE_MASTER": "10.0.0.1:50051"},
    "env_full": {"MOONCAKE_MASTER": "m:1", "MOONCAKE_LOCAL_HOSTNAME": "node", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1gb",
                 "MOONCAKE_LOCAL_BUFFER_SIZE": "512MB", "MOONCAKE_PROTOCOL": "Tcp", "MOONCAKE_DEVICE": "mlx5_0",
                 "MOONCAKE_OFFLOAD_ENABLED": "1", "MOONCAKE_TENANT_ID": "t", "MOONCAKE_CLIENT_HTTP_PORT": "1"},
    "env_bad_bool": {"MOONCAKE_MASTER": "m:1", "MOONCAKE_ENABLE_CLIENT_HTTP_SERVER": "sure"},
}
def res(f):
    try:
        c = f()
        return {k: getattr(c, k) for k in c.__dataclass_fields__}
    except Exception as e:
        return {"raises": type(e).__name__, "msg": str(e)}
out = {}
d = tempfile.mkdtemp()
for name, cfg in files.items():
    p = os.path.join(d, name + ".json")
    with open(p, "w") as f:
        json.dump(cfg, f)
    out[name] = res(lambda: mc.MooncakeConfig.from_file(p))
for k in [k for k in os.environ if k.startswith("MOONCAKE_")]:
    del os.environ[k]
for name, env in envs.items():
    os.environ.update(env)
    out[name] = res(mc.MooncakeConfig.load_from_env)
    for k in env:
        del os.environ[k]
os.environ["MOONCAKE_CONFIG_PATH"] = os.path.join(d, "sizes.json")
out["env_path"] = res(mc.MooncakeConfig.load_from_env)
out["direct_negative"] = res(lambda: mc.MooncakeConfig("h", "m", -5, 0, "tcp", "", "a"))
out["defaults"] = [mc.DEFAULT_GLOBAL_SEGMENT_SIZE, mc.DEFAULT_LOCAL_BUFFER_SIZE, list(mc.MooncakeConfig.__dataclass_fields__)]
out["parse"] = [mc._parse_segment_size(v) for v in (5, "10", "3.5k", "2Mb", "1T", "9b")]
print(json.dumps(out, sort_keys=True))
"""


def test_mooncake_config_parity_with_stock_0_3_14(stock314):
    stock = _py(stock314, _CONFIG_CASES, "stock")
    ours = _py(sys.executable, _CONFIG_CASES, "kvferry")
    assert stock.returncode == 0, stock.stderr
    assert ours.returncode == 0, ours.stderr
    s, k = json.loads(stock.stdout), json.loads(ours.stdout)
    assert sorted(s) == sorted(k)
    diff = {n: (s[n], k[n]) for n in s if s[n] != k[n]}
    assert diff == {}, diff
    # The cases reach both outcomes (a case list where everything raised would prove little).
    assert any("raises" in v for v in s.values() if isinstance(v, dict))
    assert s["sizes"]["local_buffer_size"] == 1610612736 and s["proto_upper"]["protocol"] == "rdma"


# -- async_store --------------------------------------------------------------------------

_ASYNC_CASES = r"""
import asyncio, json, sys, logging
logging.disable(logging.CRITICAL)
if sys.argv[1] == "stock":
    from mooncake.async_store import MooncakeDistributedStoreAsync as A
    from mooncake.store import MooncakeDistributedStore as S
else:
    from kvferry.mooncake.async_store import MooncakeDistributedStoreAsync as A
    from kvferry.mooncake.store import MooncakeDistributedStore as S
out = {"subclass": issubclass(A, S)}
s = A()
async def main():
    # (Calls that stock Mooncake answers before setup without crashing.)
    out["is_coroutine_fn"] = asyncio.iscoroutinefunction(s.async_health_check)
    out["health_before_setup"] = await asyncio.gather(s.async_health_check(), s.async_health_check())
    out["close_before_setup"] = await s.async_close()
    out["cached"] = s.async_health_check is s.async_health_check
    for name in ("async_no_such_method", "no_such_method"):
        try:
            getattr(s, name)
            out[name] = "no error"
        except AttributeError as e:
            out[name] = "AttributeError"
asyncio.run(main())
print(json.dumps(out, sort_keys=True))
"""


def test_async_store_parity_with_stock_0_3_14(stock314):
    stock = _py(stock314, _ASYNC_CASES, "stock")
    ours = _py(sys.executable, _ASYNC_CASES, "kvferry")
    assert stock.returncode == 0, stock.stderr
    assert ours.returncode == 0, ours.stderr
    assert json.loads(ours.stdout) == json.loads(stock.stdout)


def test_async_store_runs_calls_against_a_master(cluster):
    """The coroutines return what the sync calls return, several in flight at once."""
    import asyncio

    from kvferry.mooncake.async_store import MooncakeDistributedStoreAsync

    s = MooncakeDistributedStoreAsync()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", cluster) == 0
    try:
        async def main():
            keys = ["async-%d" % i for i in range(8)]
            puts = await asyncio.gather(*(s.async_put(k, value(k, 5000 + i)) for i, k in enumerate(keys)))
            gets = await asyncio.gather(*(s.async_get(k) for k in keys))
            return puts, gets, await s.async_is_exist("async-0"), await s.async_is_exist("absent"), await s.async_get("absent")

        puts, gets, yes, no, missing = asyncio.run(main())
        assert puts == [0] * 8
        assert gets == [value("async-%d" % i, 5000 + i) for i in range(8)]
        assert (yes, no, missing) == (1, 0, b"")
        assert s.get("async-3") == gets[3]
    finally:
        s.close()


def test_async_store_keeps_the_reason_of_names_not_provided():
    from kvferry.mooncake.async_store import MooncakeDistributedStoreAsync

    s = MooncakeDistributedStoreAsync()
    with pytest.raises(AttributeError, match="not provided by kvferry"):
        s.mount_segment  # noqa: B018
    with pytest.raises(AttributeError, match="async_mount_segment.*not provided by kvferry"):
        s.async_mount_segment  # noqa: B018


# -- cli (mooncake_master) ----------------------------------------------------------------

def test_cli_runs_kvferry_master(monkeypatch, tmp_path):
    from kvferry.mooncake import cli

    monkeypatch.delenv("KVFERRY_BIN", raising=False)
    assert cli.master_command(["--rpc_port=1"]) == [sys.executable, "-m", "kvferry", "master", "--rpc_port=1"]
    monkeypatch.setenv("KVFERRY_BIN", str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="KVFERRY_BIN"):
        cli.master_command([])
    # python -m mooncake.cli under the shim is kvferry master (exec'd: its output and exit status).
    monkeypatch.delenv("KVFERRY_BIN")
    r = subprocess.run([sys.executable, "-m", "mooncake.cli", "--help"], capture_output=True, text=True, timeout=60, env=peer_env(True))
    assert r.returncode == 0, r.stderr
    assert "rpc_port" in r.stdout + r.stderr


def test_docs_list_every_module_with_its_status():
    """docs/PYTHON.md's module table names each entry of the table the shim uses, with the
    same verdict (served / refused)."""
    from conftest import ROOT

    doc = (ROOT / "docs" / "PYTHON.md").read_text()
    section = doc[doc.index("## Mooncake 0.3.14's Python modules"):doc.index("## Mooncake-compatible store")]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            name = line.split("`")[1]
            rows[name] = line.split(" | ")[1].split(":")[0]
    want = {n: "served" for n in registry.SERVED}
    want.update({n: "refused" for n in list(registry.REFUSED) + list(registry.REFUSED_TREES)})
    assert rows == want
