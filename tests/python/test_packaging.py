"""Packaging: abi3 manylinux wheel, no RDMA/CUDA link-time dependencies, installs into a
fresh venv, ships the shim .pth and type information but no top-level `mooncake`."""

from __future__ import annotations

import ast
import glob
import os
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
        assert so == ["kvferry/_kvferry.abi3.so"], so
        _check_needed(elf_needed(z.read(so[0])))
    assert "Tag: cp39-abi3-manylinux" in wheel_meta
    assert not [n for n in names if n.startswith("mooncake/") or n == "mooncake.py"], "the wheel must not ship a top-level mooncake"
    for required in ("kvferry/__init__.py", "kvferry/py.typed", "kvferry/_kvferry.pyi", "kvferry/mooncake/engine.py", "kvferry/_shim.py"):
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
