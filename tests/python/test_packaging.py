"""Packaging: abi3 manylinux wheel, no RDMA/CUDA link-time dependencies, installs into a
fresh venv, ships the shim .pth and type information but no top-level `mooncake`, and the
`kvferry` command (console script and `python -m kvferry`, inside the one extension module)."""

from __future__ import annotations

import ast
import glob
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import List

import pytest

from conftest import ROOT

FORBIDDEN = ("libibverbs", "librdmacm", "libmlx5", "libcuda", "libcudart", "libnvidia", "libpython")


def elf_needed(data: bytes) -> List[str]:
    """DT_NEEDED entries of an ELF64 little-endian shared object (pure Python)."""
    assert data[:4] == b"\x7fELF", "not an ELF file"
    assert data[4] == 2 and data[5] == 1, "expected ELF64 little-endian"
    e_phoff, = struct.unpack_from("<Q", data, 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(e_phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz, _memsz, _align = struct.unpack_from("<IIQQQQQQ", data, e_phoff + i * e_phentsize)
        if p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:  # PT_DYNAMIC
            dynamic = (p_offset, p_filesz)
    assert dynamic is not None, "no PT_DYNAMIC segment"

    def file_offset(vaddr: int) -> int:
        for va, off, size in loads:
            if va <= vaddr < va + size:
                return vaddr - va + off
        raise AssertionError("address 0x%x is in no PT_LOAD segment" % vaddr)

    needed, strtab = [], None
    off, end = dynamic[0], dynamic[0] + dynamic[1]
    while off + 16 <= end:
        tag, val = struct.unpack_from("<qQ", data, off)
        off += 16
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED
            needed.append(val)
        elif tag == 5:  # DT_STRTAB
            strtab = file_offset(val)
    assert strtab is not None, "no DT_STRTAB"
    out = []
    for n in needed:
        s = strtab + n
        out.append(data[s:data.index(b"\0", s)].decode())
    return out


def _check_needed(needed: List[str]) -> None:
    assert "libc.so.6" in needed, needed  # the parser works
    bad = [n for n in needed if n.startswith(FORBIDDEN)]
    assert not bad, "extension links %s; it must load them at run time, if at all" % bad


def test_installed_extension_has_no_rdma_or_cuda_dt_needed():
    import kvferry._kvferry as ext

    _check_needed(elf_needed(Path(ext.__file__).read_bytes()))
    assert ext.__file__.endswith(".abi3.so")


def _wheel() -> str:
    w = os.environ.get("KVFERRY_WHEEL")
    if not w:
        found = sorted(glob.glob(str(ROOT / "target" / "wheels" / "kvferry-*.whl")), key=os.path.getmtime)
        if not found:
            # scripts/python-test always builds one; without it these checks cannot run.
            pytest.fail("no built wheel: set KVFERRY_WHEEL or run scripts/python-test")
        w = found[-1]
    return w


def test_wheel_contents_and_tags():
    w = _wheel()
    name = os.path.basename(w)
    assert "-cp39-abi3-" in name, name
    assert "manylinux" in name, name
    with zipfile.ZipFile(w) as z:
        names = z.namelist()
        wheel_meta = z.read([n for n in names if n.endswith(".dist-info/WHEEL")][0]).decode()
        so = [n for n in names if n.endswith(".so")]
        assert so == ["kvferry/_kvferry.abi3.so"], "one native library, the CLI inside it: %s" % so
        entry_points = z.read([n for n in names if n.endswith(".dist-info/entry_points.txt")][0]).decode()
        _check_needed(elf_needed(z.read(so[0])))
    assert "Tag: cp39-abi3-manylinux" in wheel_meta
    assert not [n for n in names if n.startswith("mooncake/") or n == "mooncake.py"], "the wheel must not ship a top-level mooncake"
    scripts = entry_points.split("[console_scripts]", 1)[-1].split("[")[0]
    assert "[console_scripts]" in entry_points and "kvferry=kvferry.__main__:main" in scripts.replace(" ", ""), entry_points
    for required in ("kvferry/__init__.py", "kvferry/__main__.py", "kvferry/py.typed", "kvferry/_kvferry.pyi", "kvferry/mooncake/engine.py", "kvferry/_shim.py"):
        assert required in names, required
    pth = [n for n in names if n.endswith(".pth")]
    assert len(pth) == 1 and "/purelib/" in pth[0], pth


def test_fresh_venv_install_and_import(tmp_path):
    w = _wheel()
    venv = tmp_path / "venv"
    # --without-pip: works without ensurepip (Debian's python3-venv) and is faster; this
    # interpreter's pip installs into it.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index", "--no-deps", "-q", w], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    code = (
        "import kvferry, kvferry.mooncake.engine as me\n"
        "e = kvferry.Engine('127.0.0.1'); print('segment', e.segment_name); e.close()\n"
        "te = me.TransferEngine(); print('init', te.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', ''))\n"
        "from mooncake.engine import TransferEngine; print('shim', TransferEngine is me.TransferEngine)\n"
    )
    env = dict(os.environ, KVFERRY_MOONCAKE_SHIM="1")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "segment 127.0.0.1:" in r.stdout and "init 0" in r.stdout and "shim True" in r.stdout
    env.pop("KVFERRY_MOONCAKE_SHIM")
    r = subprocess.run([py, "-c", "import mooncake"], capture_output=True, text=True, timeout=60, env=env, cwd=str(tmp_path))
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr


@pytest.fixture(scope="module")
def cli_venv(tmp_path_factory):
    """A fresh venv with only the wheel installed (no numpy, no network): its bin/ directory."""
    w = _wheel()
    venv = tmp_path_factory.mktemp("cli") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-index", "--no-deps", "-q", w], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return venv / "bin"


def _cli_env() -> dict:
    env = dict(os.environ, KVFERRY_LOG="error")
    for k in ("KVFERRY_BIN", "KVFERRY_TRANSPORT", "KVFERRY_MOONCAKE_SHIM", "PYTHONPATH"):
        env.pop(k, None)
    return env


def test_fresh_venv_kvferry_command(cli_venv, tmp_path):
    import kvferry

    exe = str(cli_venv / "kvferry")
    assert os.access(exe, os.X_OK), "pip put no kvferry script in the venv's bin/"
    run = lambda args, **kw: subprocess.run(args, capture_output=True, text=True, timeout=120, env=_cli_env(), cwd=str(tmp_path), **kw)
    r = run([exe, "--version"])
    assert r.returncode == 0 and r.stdout.strip() == "kvferry %s" % kvferry.__version__, (r.stdout, r.stderr)
    r = run([str(cli_venv / "python"), "-m", "kvferry", "--version"])
    assert r.returncode == 0 and r.stdout.strip() == "kvferry %s" % kvferry.__version__, (r.stdout, r.stderr)
    r = run([exe, "--help"])
    assert r.returncode == 0
    for sub in ("bench", "doctor", "master", "store-bench", "store-client", "metadata-server", "metadata-bench"):
        assert sub in r.stdout, r.stdout
    r = run([exe, "no-such-command"])
    assert r.returncode == 2 and "no-such-command" in r.stderr, r.stderr

    # doctor --json: parses, has the stable keys; its shm probe starts a child copy of the
    # command (`python -m kvferry bench --mode target`), which must work from the wheel too.
    r = run([exe, "doctor", "--json", "--local-hostname", "127.0.0.1", "--expect", "tcp"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for k in ("version", "host", "network", "memory", "metadata", "transports", "problems", "expect"):
        assert k in d, (k, d)
    assert d["version"] == kvferry.__version__
    t = d["transports"]
    assert set(t) >= {"tcp", "shm", "rdma", "gpu"} and t["tcp"]["available"] is True, t
    assert "could not be probed" not in (t["shm"]["reason"] or ""), t["shm"]
    assert all(p["fix"] for p in d["problems"]), d["problems"]
    # A transport that cannot work here: exit status 1, named on stderr and in the JSON.
    assert t["gpu"]["available"] is False, t["gpu"]
    r = run([exe, "doctor", "--json", "--local-hostname", "127.0.0.1", "--expect", "gpu"])
    assert r.returncode == 1 and "gpu" in r.stderr, (r.returncode, r.stderr)
    assert [u.split(" ")[0] for u in json.loads(r.stdout)["expect"]["unmet"]] == ["gpu"]


def _start_master(exe: str, cwd: str) -> "tuple[subprocess.Popen, int]":
    # SIGINT as an interactive shell leaves it (a background job of a script ignores it, and
    # an ignored SIGINT stays ignored, as for the binary).
    p = subprocess.Popen([exe, "master", "--port", "0", "--metrics-port", "-1", "--summary-interval", "0"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_cli_env(), cwd=cwd, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    ready, _, _ = select.select([p.stdout], [], [], 60)
    line = p.stdout.readline().decode() if ready else ""
    if "KVFERRY_MASTER" not in line:
        p.kill()
        p.wait(10)
        raise AssertionError("no ready line from kvferry master: %r / %s" % (line, p.stderr.read().decode()))
    rpc = next(w[4:] for w in line.split() if w.startswith("rpc="))
    return p, int(rpc.rsplit(":", 1)[1])


def test_fresh_venv_kvferry_master_starts_and_stops_on_signals(cli_venv, tmp_path):
    for sig in (signal.SIGTERM, signal.SIGINT):
        p, port = _start_master(str(cli_venv / "kvferry"), str(tmp_path))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # it listens
            # SIGINT too: the console script restores its default action (Ctrl-C ends it).
            os.kill(p.pid, sig)
            rc = p.wait(15)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        assert rc == -sig, (sig, rc, p.stderr.read().decode())
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_pyproject_maturin_settings():
    try:
        import tomllib
    except ImportError:  # Python < 3.11: the same parser, as vendored by pip
        from pip._vendor import tomli as tomllib
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    m = cfg["tool"]["maturin"]
    assert m["manifest-path"] == "crates/kvferry-python/Cargo.toml"
    assert m["python-source"] == "python"
    assert m["module-name"] == "kvferry._kvferry"
    assert "extension-module" in m["features"]
    cargo = (ROOT / "crates" / "kvferry-python" / "Cargo.toml").read_text()
    assert 'extension-module = ["pyo3/extension-module"]' in cargo
    assert '"extension-module"' not in cargo.split("[dependencies]")[1].split("pyo3")[1].split("\n")[0], "pyo3's extension-module must stay off for cargo test"


def test_stub_lists_every_core_method():
    import kvferry._kvferry as ext

    stub = ast.parse((ROOT / "python" / "kvferry" / "_kvferry.pyi").read_text())
    core = [n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "Core"][0]
    stubbed = {f.name for f in core.body if isinstance(f, ast.FunctionDef)}
    runtime = {n for n in dir(ext.Core) if not n.startswith("_")}
    assert runtime <= stubbed, runtime - stubbed
    funcs = {f.name for f in stub.body if isinstance(f, (ast.FunctionDef, ast.ClassDef))}
    assert {n for n in dir(ext) if callable(getattr(ext, n)) and not n.startswith("_") and n != "Core"} <= funcs
    store = [n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "StoreCore"][0]
    stubbed = {f.name for f in store.body if isinstance(f, ast.FunctionDef)}
    runtime = {n for n in dir(ext.StoreCore) if not n.startswith("_")}
    assert runtime <= stubbed, runtime - stubbed


def test_docstrings():
    import kvferry
    import kvferry.mooncake.engine as me

    for cls in (kvferry.Engine, kvferry.Batch, me.TransferEngine):
        missing = [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_") and not (v.__doc__ or "").strip()]
        assert not missing, (cls, missing)
