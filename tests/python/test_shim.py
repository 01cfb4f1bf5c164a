"""The opt-in ``mooncake`` shim: KVFERRY_MOONCAKE_SHIM=1 (.pth) and install_mooncake_shim()."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap

import pytest

from conftest import peer_env


def _py(code: str, shim: bool, python: str = sys.executable, extra_env=None) -> subprocess.CompletedProcess:
    env = peer_env(shim)
    env.update(extra_env or {})
    return subprocess.run([python, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, env=env)


def test_env_var_aliases_mooncake_engine():
    r = _py(
        """
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode, Read, Write, SUPPORT_CUDA
        import mooncake, mooncake.engine, kvferry.mooncake.engine as k
        assert TransferEngine is k.TransferEngine and TransferOpcode is k.TransferOpcode
        assert mooncake.engine.TransferEngine is k.TransferEngine
        import kvferry.mooncake.buffer_pool as bp
        assert mooncake.BufferPool is bp.BufferPool
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        print("ok", TransferEngine.__module__, te.get_rpc_port() > 0)
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        import kvferry.mooncake.store as ks
        assert MooncakeDistributedStore is ks.MooncakeDistributedStore
        print("store ok")
        try:
            import mooncake.mooncake_store_service
        except ModuleNotFoundError as e:
            print("other:", e)
        """,
        shim=True,
    )
    assert r.returncode == 0, r.stderr
    assert "ok kvferry.mooncake.engine True" in r.stdout
    assert "store ok" in r.stdout
    # A module of Mooncake 0.3.14's wheel that kvferry does not provide fails at import with
    # the reason (a ModuleNotFoundError naming it), not Python's bare "No module named".
    assert "other: mooncake.mooncake_store_service is not provided by kvferry's mooncake shim: " in r.stdout


@pytest.mark.parametrize("value", ["", "0", "false"])
def test_shim_is_opt_in(value):
    r = _py(
        """
        import sys
        try:
            import mooncake.engine as m
            print("imported", m.__name__, getattr(m, "__kvferry_target__", "official"))
        except ImportError:
            print("absent")
        print("kvferry loaded:", "kvferry" in sys.modules)
        """,
        shim=False,
        extra_env={"KVFERRY_MOONCAKE_SHIM": value} if value else None,
    )
    assert r.returncode == 0, r.stderr
    assert "kvferry.mooncake" not in r.stdout  # never aliased without the opt-in
    assert "kvferry loaded: False" in r.stdout  # and the .pth imports nothing then


def test_install_in_process():
    import kvferry
    import kvferry.mooncake.engine as k

    saved = {n: m for n, m in sys.modules.items() if n == "mooncake" or n.startswith("mooncake.")}
    try:
        kvferry.install_mooncake_shim()
        kvferry.install_mooncake_shim()  # idempotent
        import mooncake.engine

        assert mooncake.engine.TransferEngine is k.TransferEngine
        assert mooncake.engine.__doc__ == k.__doc__
        with pytest.raises(AttributeError, match="not provided by kvferry"):
            mooncake.engine.RpcInterface
        kvferry.uninstall_mooncake_shim()
        assert "mooncake.engine" not in sys.modules
    finally:
        kvferry.uninstall_mooncake_shim()
        sys.modules.update(saved)


def test_shim_wins_over_official_mooncake(mooncake_py):
    """With both installed, the opt-in makes `mooncake.engine` kvferry's, even if the
    official one was imported first; without it the official one is untouched."""
    site = sysconfig.get_paths()["purelib"]
    code = """
        import site, sys
        import mooncake.engine as official
        print("before", official.TransferEngine.__module__)
        site.addsitedir(%r)   # kvferry's site-packages: its .pth runs (KVFERRY_MOONCAKE_SHIM)
        import kvferry
        kvferry.install_mooncake_shim()
        import mooncake.engine as m
        print("after", m.TransferEngine.__module__)
        import os; os._exit(0)
    """ % site
    r = _py(code, shim=True, python=mooncake_py)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "before mooncake.engine" in r.stdout and "after kvferry.mooncake.engine" in r.stdout
