"""Packaging: abi3 manylinux wheel, no RDMA/CUDA link-time dependencies, installs into a
fresh venv, ships the shim .pth and type information but no top-level `mooncake`, and the
`kvferry` command (console script and `python -m kvferry`, inside the one extension module)."""

from __future__ import annotations

import ast
import glob
import json
import os
import select
import shutil
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

import wheel_audit
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


def test_wheel_elf_dependencies():
    """Every file of the built wheel, every ELF among them (by magic, whatever its name) and
    its DT_NEEDED as binutils' readelf reads them: no CUDA, no verbs, only manylinux
    libraries, and auditwheel agrees with the platform tag in the file name."""
    w = _wheel()
    report, problems = wheel_audit.audit(w)
    print(json.dumps(report, indent=1))
    assert not problems, "\n".join(problems)
    assert list(report["elf_needed"]) == ["kvferry/_kvferry.abi3.so"], report["elf_needed"]
    needed = report["elf_needed"]["kvferry/_kvferry.abi3.so"]
    assert "libc.so.6" in needed, needed
    # readelf and this file's own parser (used on the installed extension) agree.
    with zipfile.ZipFile(w) as z:
        assert elf_needed(z.read("kvferry/_kvferry.abi3.so")) == needed
    assert report["auditwheel"]["external_libs"] == {}, report["auditwheel"]


def _cc(tmp: Path, name: str, code: str, libs=(), soname=None) -> Path:
    """A shared object built from `code` with cc, linked (not as-needed) to `libs` in tmp."""
    src = tmp / (name + ".c")
    src.write_text(code)
    out = tmp / name
    cmd = [os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(out), str(src), "-L" + str(tmp), "-Wl,--no-as-needed"]
    if soname:
        cmd.append("-Wl,-soname," + soname)
    cmd += ["-l" + l for l in libs]
    subprocess.run(cmd, check=True, timeout=120)
    return out


def _fake_lib(tmp: Path, soname: str, symbol: str) -> None:
    """lib<x>.so.N with `symbol`, and the lib<x>.so link the linker looks for."""
    _cc(tmp, soname, "int %s(void) { return 0; }\n" % symbol, soname=soname)
    os.symlink(soname, str(tmp / (soname.split(".so")[0] + ".so")))


def _make_wheel(path: Path, files: dict) -> str:
    """A minimal wheel at `path` (its name carries the tags) with `files` {member: local path}."""
    dist = "kvferry-0.1.0.dist-info/"
    tag = path.name[: -len(".whl")].split("-", 2)[2]
    meta = {dist + "WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: %s\n" % tag,
            dist + "METADATA": "Metadata-Version: 2.1\nName: kvferry\nVersion: 0.1.0\n"}
    with zipfile.ZipFile(str(path), "w") as z:
        for member, local in files.items():
            z.write(str(local), member)
        for member, text in meta.items():
            z.writestr(member, text)
        # auditwheel walks the files RECORD lists
        z.writestr(dist + "RECORD", "".join("%s,,\n" % m for m in list(files) + list(meta) + [dist + "RECORD"]))
    return str(path)


def test_wheel_audit_fails_on_cuda_verbs_and_non_manylinux_libraries(tmp_path):
    """The check above can fail: a wheel whose extension links libcudart and libssl, with a
    helper ELF (named like data) that links libibverbs, is refused, naming each."""
    for soname, sym in (("libcudart.so.12", "cudaMalloc"), ("libibverbs.so.1", "ibv_get_device_list"), ("libssl.so.3", "SSL_new")):
        _fake_lib(tmp_path, soname, sym)
    ext = _cc(tmp_path, "ext.so", "int cudaMalloc(void); int SSL_new(void); int f(void) { return cudaMalloc() + SSL_new(); }\n", libs=("cudart", "ssl"))
    helper = _cc(tmp_path, "helper", "int ibv_get_device_list(void); int g(void) { return ibv_get_device_list(); }\n", libs=("ibverbs",))
    w = _make_wheel(tmp_path / "kvferry-0.1.0-cp39-abi3-manylinux_2_34_x86_64.whl",
                    {"kvferry/_kvferry.abi3.so": ext, "kvferry/data/helper.bin": helper})
    report, problems = wheel_audit.audit(w)
    text = "\n".join(problems)
    assert "libibverbs.so.1" in report["elf_needed"]["kvferry/data/helper.bin"], report
    assert "kvferry/_kvferry.abi3.so needs libcudart.so.12: a CUDA library" in text, text
    assert "kvferry/data/helper.bin needs libibverbs.so.1: a verbs/RDMA library" in text, text
    assert "needs libssl.so.3, which is not on the manylinux_2_34_x86_64 allow-list" in text, text
    assert "consistent with no manylinux tag" in text, text
    # The command-line form exits 1 and names them too.
    r = subprocess.run([sys.executable, str(Path(wheel_audit.__file__)), w], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "libcudart.so.12" in r.stderr and "libibverbs.so.1" in r.stderr, r.stderr


def test_wheel_audit_passes_a_clean_wheel_and_checks_its_glibc_claim(tmp_path):
    """A libc-only extension passes under an honest tag; the same file under a tag claiming an
    older glibc than its symbol versions (memfd_create is GLIBC_2.27) is refused."""
    ext = _cc(tmp_path, "ext.so", "#define _GNU_SOURCE\n#include <sys/mman.h>\nint f(void) { return memfd_create(\"x\", 0); }\n")
    ok = _make_wheel(tmp_path / "kvferry-0.1.0-cp39-abi3-manylinux_2_34_x86_64.whl", {"kvferry/_kvferry.abi3.so": ext})
    report, problems = wheel_audit.audit(ok)
    assert not problems, problems
    assert report["elf_needed"] == {"kvferry/_kvferry.abi3.so": ["libc.so.6"]}, report
    old = _make_wheel(tmp_path / "kvferry-0.1.0-cp39-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", {"kvferry/_kvferry.abi3.so": ext})
    _, problems = wheel_audit.audit(old)
    assert any("manylinux_2_17_x86_64 claims glibc 2.17" in p for p in problems), problems
    assert any("manylinux2014_x86_64 claims glibc 2.17" in p for p in problems), problems


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


CHECK_IMAGE = ROOT / "scripts" / "check-image"


def test_check_image_script_passes_in_the_fresh_venv(cli_venv, tmp_path):
    """scripts/check-image, the image's content check (docker/Dockerfile's last step), against
    the venv that holds only the wheel: so the script is run by CI and cannot rot."""
    import kvferry

    venv = str(cli_venv.parent)
    r = subprocess.run(["bash", str(CHECK_IMAGE), "--venv", venv, "--expect", "tcp,shm", "--version", kvferry.__version__],
                       capture_output=True, text=True, timeout=300, env=_cli_env(), cwd=str(tmp_path))
    assert r.returncode == 0, (r.stdout, r.stderr)
    out = r.stdout
    assert "ok    kvferry --version: kvferry %s" % kvferry.__version__ in out, out
    assert "ok    kvferry doctor --json --expect tcp,shm" in out, out
    assert "ok    KVFERRY_MOONCAKE_SHIM=1 import mooncake.engine, mooncake.store" in out, out
    assert "ok    _kvferry.abi3.so links only: " in out and "libc.so.6" in out, out
    assert out.rstrip().endswith("check-image: all checks passed"), out
    # On PATH, as in the image (no --venv).
    env = dict(_cli_env(), PATH="%s:%s" % (cli_venv, os.environ.get("PATH", "")))
    env.pop("PYTHON", None)
    r = subprocess.run(["bash", str(CHECK_IMAGE)], capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert r.returncode == 0 and "all checks passed" in r.stdout, (r.stdout, r.stderr)


def test_check_image_script_fails_naming_each_problem(cli_venv, tmp_path):
    """It can fail: an unmet transport, a wrong version, a linked verbs library, a missing
    command; each named, every check still run, exit status 1."""
    _fake_lib(tmp_path, "libibverbs.so.1", "ibv_get_device_list")
    bad = _cc(tmp_path, "bad.so", "int ibv_get_device_list(void); int g(void) { return ibv_get_device_list(); }\n", libs=("ibverbs",))
    env = dict(_cli_env(), KVFERRY_CHECK_EXTRA_ELF=str(bad))
    r = subprocess.run(["bash", str(CHECK_IMAGE), "--venv", str(cli_venv.parent), "--expect", "tcp,gpu", "--version", "0.0.0-not-this"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert r.returncode == 1, (r.stdout, r.stderr)
    err = r.stderr
    assert "FAIL: kvferry --version printed 'kvferry " in err and "expected kvferry 0.0.0-not-this" in err, err
    assert "FAIL: kvferry doctor --json --expect tcp,gpu (exit 1): gpu: libcuda.so.1 cannot be loaded" in err, err
    assert "FAIL: %s links libibverbs.so.1" % bad in err, err
    assert "check-image: 3 check(s) failed" in err, err
    assert "ok    KVFERRY_MOONCAKE_SHIM=1" in r.stdout and "ok    _kvferry.abi3.so links only" in r.stdout, r.stdout
    # A venv whose console script is gone (the package imports, the command does not exist).
    fake = tmp_path / "no-script"
    (fake / "bin").mkdir(parents=True)
    os.symlink(str(cli_venv / "python"), str(fake / "bin" / "python"))
    os.symlink(str(cli_venv.parent / "lib"), str(fake / "lib"))
    (fake / "pyvenv.cfg").write_text((cli_venv.parent / "pyvenv.cfg").read_text())
    r = subprocess.run(["bash", str(CHECK_IMAGE), "--venv", str(fake)], capture_output=True, text=True, timeout=300, env=_cli_env(), cwd=str(tmp_path))
    assert r.returncode == 1 and "FAIL: no kvferry command" in r.stderr, (r.stdout, r.stderr)


def test_dockerfile_is_strict_and_has_no_cuda_variant_switch():
    """docker/Dockerfile: bash -euxo pipefail for every RUN, the wheel installed from the
    build context only, no CUDA_VERSION branch, and the content check as its last step.
    (scripts/lint-shell runs shellcheck on its RUN bodies.)"""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    instrs = [l for l in text.split("\n") if l.strip() and not l.lstrip().startswith("#") and l[:1] not in (" ", "\t")]
    keywords = [l.split()[0] for l in instrs]
    assert 'SHELL ["/bin/bash", "-euxo", "pipefail", "-c"]' in instrs, instrs
    assert keywords.index("SHELL") < keywords.index("RUN"), keywords
    runs = [l for l in instrs if l.startswith("RUN ")]
    assert "--no-index --find-links /tmp/kvferry-wheels kvferry" in runs[0], runs
    assert instrs[-1] == "RUN kvferry-check-image --expect tcp,shm", instrs[-1]
    assert "COPY scripts/check-image /usr/local/bin/kvferry-check-image" in instrs
    code = "\n".join(instrs)
    for variant in ("CUDA_VERSION", "cuda13", "mooncake-transfer-engine"):
        assert variant not in code, variant
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split("\n")
    assert ignore[[i for i, l in enumerate(ignore) if l and not l.startswith("#")][0]] == "*", "the build context must exclude target/"


def _dockerfile_steps(text: str) -> "tuple[list, list]":
    """(COPY [src, dst] pairs, RUN bodies) of a Dockerfile, continuation lines joined."""
    copies, runs, cur = [], [], None
    for line in text.split("\n"):
        if cur is None:
            if line.startswith("COPY "):
                copies.append(line.split()[1:3])
            if not line.startswith("RUN "):
                continue
            cur = [line[4:]]
        else:
            cur.append(line)
        if cur[-1].rstrip().endswith("\\"):
            continue
        runs.append("\n".join(cur))
        cur = None
    return copies, runs


def test_dockerfile_steps_run_in_a_fresh_venv(tmp_path):
    """No docker here: docker/Dockerfile's COPY and RUN steps are replayed against a fresh
    venv (its python first on PATH, the COPY destinations under a scratch root), each RUN
    body under the Dockerfile's SHELL (bash -euxo pipefail). So its pip line and its content
    check are run by CI, as the image build would run them."""
    w = _wheel()
    copies, runs = _dockerfile_steps((ROOT / "docker" / "Dockerfile").read_text())
    root = tmp_path / "root"
    build_args = {"${WHEELS}": str(Path(w).parent)}
    rewrite = []
    for src, dst in copies:
        src = build_args.get(src.rstrip("/"), str(ROOT / src.rstrip("/")))
        target = root / dst.lstrip("/")
        if dst.endswith("/"):
            target.mkdir(parents=True)
            shutil.copy(w, str(target))  # the one wheel under test, as `COPY target/wheels/`
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, str(target))
        rewrite.append((dst.rstrip("/"), str(target)))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # `python -m pip` in the venv: this interpreter's pip package alone (not its site-packages,
    # which hold an installed kvferry), through a .pth; pip installs into the venv running it.
    import pip

    pipdir = tmp_path / "pip-only"
    pipdir.mkdir()
    os.symlink(os.path.dirname(pip.__file__), str(pipdir / "pip"))
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "pip-only.pth").write_text(str(pipdir) + "\n")
    env = dict(_cli_env(), PATH="%s:%s:%s" % (venv / "bin", root / "usr" / "local" / "bin", os.environ.get("PATH", "")))
    for k in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PYTHON", "VIRTUAL_ENV"):
        env.pop(k, None)
    env["PIP_CONFIG_FILE"] = os.devnull
    assert len(runs) == 2, runs
    for body in runs:
        for dst, target in rewrite:
            body = body.replace(dst, target)
        r = subprocess.run(["/bin/bash", "-euxo", "pipefail", "-c", body], capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
        assert r.returncode == 0, (body, r.stdout, r.stderr)
    assert "check-image: all checks passed" in r.stdout, r.stdout
    assert not (root / "tmp" / "kvferry-wheels").exists(), "the RUN removes the copied wheels"
    assert os.path.exists(str(venv / "bin" / "kvferry"))


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
