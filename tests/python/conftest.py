"""Shared fixtures of kvferry's Python tests.

The tests import the *installed* ``kvferry`` (scripts/python-test builds the wheel and
installs it into .venv/py-test). Stock Mooncake runs in a separate interpreter, one per
release the tests cover (the `mooncake_py` fixture is parametrised over RELEASES): 0.3.13 is
the first of ``$KVFERRY_MOONCAKE_PYTHON``, ``.venv/mooncake/bin/python``,
``/tmp/mcvenv/bin/python`` that imports ``mooncake.engine`` of that release; 0.3.14 the first
of ``$KVFERRY_MOONCAKE314_PYTHON``, ``.venv/mooncake314/bin/python``. A test needing a
release that none provides fails, naming what was tried and how to make it
(scripts/python-test makes both). ``KVFERRY_SKIP_MOONCAKE=1`` opts out
explicitly: those tests are then deselected (counted in pytest's summary), never reported as passed.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
INTEROP = ROOT / "tests" / "interop"
PEER_SCRIPT = INTEROP / "mooncake_peer.py"
HOST = "127.0.0.1"

sys.path.insert(0, str(INTEROP))
sys.path.insert(0, str(HERE))

import mooncake_peer  # noqa: E402  (pattern helpers only; imports no Mooncake)

pattern_bytes = mooncake_peer.pattern_bytes


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- stock Mooncake ------------------------------------------------------------------------

_MC: Dict[str, Any] = {}

# The stock releases the interop and parity tests run against, and where each is found: the
# first candidate that imports `mooncake.engine` from a wheel of that release. scripts/test
# (through scripts/python-test and scripts/mooncake-venv) makes both venvs.
RELEASES = ("0.3.13", "0.3.14")
_STOCK: Dict[str, Dict[str, Any]] = {
    "0.3.13": {
        "env": "KVFERRY_MOONCAKE_PYTHON",
        "candidates": [str(ROOT / ".venv" / "mooncake" / "bin" / "python"), "/tmp/mcvenv/bin/python"],
        "package": "mooncake-transfer-engine-non-cuda",
    },
    "0.3.14": {
        "env": "KVFERRY_MOONCAKE314_PYTHON",
        "candidates": [str(ROOT / ".venv" / "mooncake314" / "bin" / "python")],
        "package": "mooncake-transfer-engine-cuda13",
    },
}
# Prints the module's file and the version of the Mooncake distribution installed beside it.
_PROBE = (
    "import importlib.metadata as md, mooncake.engine as e\n"
    "def v(d):\n"
    "    try:\n"
    "        return md.version(d)\n"
    "    except md.PackageNotFoundError:\n"
    "        return None\n"
    "print(e.__file__, next(filter(None, map(v, %r)), '?'))\n"
) % (["mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13", "mooncake-transfer-engine"],)


def mooncake_python(release: str = "0.3.13") -> Optional[str]:
    """An interpreter that can import the stock Mooncake wheel of `release`, or None."""
    key = "python-" + release
    if key in _MC:
        return _MC[key]
    spec = _STOCK[release]
    candidates = [os.environ.get(spec["env"], "")] + spec["candidates"]
    found, tried = None, []
    for c in candidates:
        if not c or not (os.path.isfile(c) and os.access(c, os.X_OK)):
            continue
        env = dict(os.environ, MC_FORCE_TCP="1")
        env.pop("KVFERRY_MOONCAKE_SHIM", None)
        r = subprocess.run([c, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=60)
        words = r.stdout.split()
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or ["rc=%d" % r.returncode])[-1]
        elif "kvferry" in r.stdout:
            why = "imports kvferry's shim, not stock Mooncake"
        elif len(words) < 2 or not (words[-1] == release or words[-1].startswith(release + ".")):
            why = "has Mooncake %s, not %s" % (words[-1] if words else "?", release)
        else:
            found = c
            tried.append("%s: ok" % c)
            break
        tried.append("%s: %s" % (c, why))
    _MC[key] = found
    _MC["tried-" + release] = tried
    return found


_INSTALL = {
    "0.3.13": "scripts/mooncake-venv 0.3.13 (scripts/python-test does)",
    "0.3.14": "scripts/mooncake-venv 0.3.14 (scripts/python-test does; it builds stand-ins for CUDA 13's"
              " libraries, which the only 0.3.14 wheel, mooncake-transfer-engine-cuda13, links)",
}


def _opted_out() -> bool:
    return os.environ.get("KVFERRY_SKIP_MOONCAKE") == "1"


def stock_python(release: str) -> str:
    """The interpreter with stock Mooncake `release`; missing, the test fails naming what was
    tried and how to make it (scripts/python-test makes both releases' venvs).
    KVFERRY_SKIP_MOONCAKE=1 deselects these tests instead, counted in pytest's summary."""
    py = mooncake_python(release)
    if py is not None:
        return py
    spec = _STOCK[release]
    pytest.fail("stock Mooncake %s (%s) is not available (tried: %s); make it: %s, or set KVFERRY_SKIP_MOONCAKE=1 to leave these tests out" % (
        release, spec["package"], "; ".join(_MC.get("tried-" + release) or ["no candidate interpreter"]), _INSTALL[release]))


@pytest.fixture(scope="session", params=RELEASES, ids=["mc" + r for r in RELEASES])
def mooncake_release(request: Any) -> str:
    """Which stock Mooncake release a test that takes `mooncake_py` runs against."""
    return request.param


@pytest.fixture(scope="session")
def mooncake_py(mooncake_release: str) -> str:
    return stock_python(mooncake_release)


def _needs_mooncake(item: Any) -> bool:
    # The fixture, or a parametrisation that asks for it at run time ("mooncake-<release>").
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "mooncake_py" in getattr(item, "fixturenames", ()) or any(str(v).startswith("mooncake-") for v in params.values())


def pytest_collection_modifyitems(config: Any, items: List[Any]) -> None:
    """With KVFERRY_SKIP_MOONCAKE=1, tests that need stock Mooncake are deselected."""
    if not _opted_out():
        return
    keep, drop = [], []
    for item in items:
        (drop if _needs_mooncake(item) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
        _MC["deselected"] = len(drop)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    tr = terminalreporter
    if _MC.get("deselected"):
        tr.write_sep("!", "INTEROP WITH STOCK MOONCAKE NOT TESTED (KVFERRY_SKIP_MOONCAKE=1)", red=True, bold=True)
        tr.write_line("%d test(s) needing the stock Mooncake wheels were left out. Make them: %s" % (_MC["deselected"], "; ".join(_INSTALL.values())), red=True)


def peer_env(shim: bool) -> Dict[str, str]:
    env = dict(os.environ, MC_FORCE_TCP="1", PYTHONUNBUFFERED="1")
    if shim:
        env["KVFERRY_MOONCAKE_SHIM"] = "1"
    else:
        env.pop("KVFERRY_MOONCAKE_SHIM", None)
    return env


class Peer:
    """tests/interop/mooncake_peer.py in `target` mode, driven over stdin/stdout.

    ``python`` is the interpreter: stock Mooncake's, or ours with ``shim=True`` (then the
    unmodified script's ``from mooncake.engine import TransferEngine`` runs on kvferry).
    """

    def __init__(self, python: str, size: int, seed: int = 0, shim: bool = False) -> None:
        self.errlog = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [python, str(PEER_SCRIPT), "target", "--size", str(size), "--seed", str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errlog,
            text=True,
            bufsize=1,
            env=peer_env(shim),
        )
        info = self._line(60)
        self.segment: str = info["segment"]
        self.addr: int = info["addr"]
        self.size: int = info["size"]

    def _line(self, timeout: float) -> Dict[str, Any]:
        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if r else ""
        if not line:
            raise AssertionError("peer said nothing (rc=%r); stderr:\n%s" % (self.proc.poll(), self.stderr()[-3000:]))
        return json.loads(line)

    def stderr(self) -> str:
        self.errlog.seek(0)
        return self.errlog.read()

    def cmd(self, line: str, timeout: float = 30) -> Dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def checksum(self, off: int, length: int) -> str:
        return self.cmd("checksum %d %d" % (off, length))["sha256"]

    def notifies(self) -> List[List[str]]:
        return self.cmd("notifies")["notifies"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=0.3)
            except Exception:
                # Stock Mooncake takes about a second to tear down; the test is over anyway.
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.errlog.close()


def run_initiator(python: str, segment: str, remote_addr: int, size: int, op: str, block: int, batch: int = 8, seed: int = 0, shim: bool = False) -> Dict[str, Any]:
    """tests/interop/mooncake_peer.py in `initiator` mode; returns its JSON result."""
    r = subprocess.run(
        [python, str(PEER_SCRIPT), "initiator", "--segment", segment, "--remote-addr", str(remote_addr), "--size", str(size),
         "--op", op, "--block", str(block), "--batch", str(batch), "--seed", str(seed)],
        capture_output=True, text=True, timeout=120, env=peer_env(shim),
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, "initiator printed nothing (rc=%d); stderr:\n%s" % (r.returncode, r.stderr[-3000:])
    out = json.loads(lines[-1])
    out["rc"] = r.returncode
    out["stderr"] = r.stderr
    return out


# -- memory --------------------------------------------------------------------------------

class Buf:
    """An anonymous mapping with a stable address (like the peer script's)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.mm = mmap.mmap(-1, size)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)

    def fill(self, seed: int, off: int = 0, length: Optional[int] = None) -> None:
        length = self.size - off if length is None else length
        self.mm[off:off + length] = pattern_bytes(off, length, seed)

    def bytes(self, off: int = 0, length: Optional[int] = None) -> bytes:
        length = self.size - off if length is None else length
        return self.mm[off:off + length]

    def sha(self, off: int = 0, length: Optional[int] = None) -> str:
        return sha256(self.bytes(off, length))


def wait_for(fn: Any, timeout: float = 5.0, interval: float = 0.01) -> Any:
    end = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > end:
            return v
        time.sleep(interval)


# -- engines -------------------------------------------------------------------------------

@pytest.fixture
def kv():
    import kvferry

    return kvferry


@pytest.fixture
def pair():
    """Two native engines in this process: (initiator, target)."""
    import kvferry

    a, b = kvferry.Engine(HOST), kvferry.Engine(HOST)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def te_pair():
    """Two Mooncake-API engines in this process: (initiator, target)."""
    from kvferry.mooncake.engine import TransferEngine

    a, b = TransferEngine(), TransferEngine()
    assert a.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    yield a, b
    for e in (a, b):
        if e._core is not None:
            e._core.close()
