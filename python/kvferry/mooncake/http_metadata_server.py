"""Mooncake's ``mooncake.http_metadata_server`` on kvferry: the transfer engines' HTTP
metadata service (``GET/PUT/DELETE /metadata?key=K``, ``GET /health``).

The server is kvferry's own (``kvferry metadata-server``, the contract of the metadata server
embedded in ``mooncake_master``), run as a child process: ``$KVFERRY_BIN`` when set (a
``kvferry`` binary built from source), else this installation's own ``kvferry`` command
(``python -m kvferry``: the wheel carries the whole CLI in its extension module). Only an
extension without the CLI falls back to a binary next to this package, in this environment's
scripts directory or on ``PATH``; when none is found, starting the server raises
``FileNotFoundError`` saying where it looked and how to get one.

Command line, as Mooncake's ``mooncake_http_metadata_server``::

    python -m kvferry.mooncake.http_metadata_server --port 8080 [--host 0.0.0.0] [--log-level INFO]
    python -m mooncake.http_metadata_server ...        # with KVFERRY_MOONCAKE_SHIM=1

In Python, ``KVBootstrapServer(port, host="0.0.0.0")`` with ``run()``, ``poll()`` and
``close()`` as in Mooncake. Differences: ``run()`` returns once the server listens (port 0
picks a free port; ``server.port`` is then the chosen one) and raises ``RuntimeError`` if it
cannot start (Mooncake logs the error and ``poll()`` answers ``KVPoll.Failed``).

As Mooncake 0.3.14's: keys are stripped, and a missing, empty or blank key is 400 ``metadata
key is required``; ``MC_METADATA_HTTP_TOKEN`` makes every request carry ``Authorization:
Bearer <token>``; ``run()`` refuses a non-loopback host without a token unless
``MC_METADATA_HTTP_ALLOW_INSECURE=1``; ``MC_METADATA_MAX_BODY_BYTES`` (1 MiB, 413 beyond),
``MC_METADATA_MAX_KEYS`` (65536) and ``MC_METADATA_MAX_TOTAL_BYTES`` (1 GiB, keys and values;
507 beyond) bound what it holds. tests/python/test_http_metadata_server.py compares it with the
stock 0.3.14 server request by request.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import weakref
from enum import Enum
from typing import List, Optional

__all__ = ["KVPoll", "KVBootstrapServer", "main", "parse_args", "find_kvferry_binary", "kvferry_command"]

_log = logging.getLogger("kvferry")

_START_TIMEOUT_S = 15.0


class KVPoll(Enum):
    """Status of the server (Mooncake's ``KVPoll``)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def _candidates() -> List[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    out = [
        os.path.join(os.path.dirname(here), "bin", "kvferry"),  # kvferry/bin/kvferry
        os.path.join(sysconfig.get_path("scripts") or "", "kvferry"),
        os.path.join(os.path.dirname(sys.executable), "kvferry"),
    ]
    found = shutil.which("kvferry")
    if found:
        out.append(found)
    return out


def find_kvferry_binary() -> str:
    """The path of the ``kvferry`` binary that serves the metadata (see the module doc)."""
    env = os.environ.get("KVFERRY_BIN", "")
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise FileNotFoundError("KVFERRY_BIN=%s is not an executable file: point it at the kvferry binary (cargo build --release -p kvferry-cli -> target/release/kvferry)" % env)
    tried = []
    for c in _candidates():
        if c in tried:
            continue
        tried.append(c)
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(
        "the HTTP metadata server is kvferry's `kvferry metadata-server`, and no kvferry binary was found (looked at $KVFERRY_BIN, %s, and PATH):"
        " build it (cargo build --release -p kvferry-cli, or cargo install --path crates/kvferry-cli) and set KVFERRY_BIN to it or put it on PATH"
        % ", ".join(tried)
    )


def kvferry_command() -> List[str]:
    """The command line that runs ``kvferry`` (see the module doc): ``[$KVFERRY_BIN]`` when
    set, else ``[sys.executable, "-m", "kvferry"]`` (this wheel's own entry point), else the
    binary :func:`find_kvferry_binary` finds."""
    if os.environ.get("KVFERRY_BIN", ""):
        return [find_kvferry_binary()]
    try:
        from kvferry import _kvferry

        if hasattr(_kvferry, "cli_main"):
            return [sys.executable, "-m", "kvferry"]
    except ImportError:
        pass
    return [find_kvferry_binary()]


def _int_env(name: str, default: int) -> int:
    """A positive integer from the environment (Mooncake 0.3.14's rule: unset or empty is the
    default, anything else must be an integer >= 1, else ValueError naming the variable)."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("%s must be a positive integer, got %r" % (name, raw)) from None
    if value < 1:
        raise ValueError("%s must be a positive integer, got %r" % (name, raw))
    return value


def _budget_args() -> List[str]:
    """Mooncake 0.3.14's limits, from its variables and with its defaults, as the server's flags:
    MC_METADATA_MAX_BODY_BYTES (1 MiB: 413 beyond), MC_METADATA_MAX_KEYS (65536) and
    MC_METADATA_MAX_TOTAL_BYTES (1 GiB, keys and values: 507 beyond)."""
    return [
        "--max-body-bytes", str(_int_env("MC_METADATA_MAX_BODY_BYTES", 1 << 20)),
        "--max-keys", str(_int_env("MC_METADATA_MAX_KEYS", 65536)),
        "--max-total-bytes", str(_int_env("MC_METADATA_MAX_TOTAL_BYTES", 1 << 30)),
    ]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_open_bind(host: str, port: int) -> None:
    """Mooncake 0.3.14's rule: no serving a non-loopback address without a token (anyone who
    can reach it could read and rewrite the cluster's metadata) unless
    MC_METADATA_HTTP_ALLOW_INSECURE says so. RuntimeError naming the three ways out."""
    token = os.environ.get("MC_METADATA_HTTP_TOKEN") or os.environ.get("KVFERRY_METADATA_HTTP_TOKEN")
    insecure = os.environ.get("MC_METADATA_HTTP_ALLOW_INSECURE", "").lower() in ("1", "true", "yes")
    if not token and not _is_loopback(host) and not insecure:
        raise RuntimeError(
            "HTTP Metadata Server refuses to bind %s:%d without an authentication token: anyone who can reach this "
            "port could read and rewrite cluster metadata. Set MC_METADATA_HTTP_TOKEN here and on every engine, bind a "
            "loopback address, or export MC_METADATA_HTTP_ALLOW_INSECURE=1 to keep the legacy open behavior." % (host, port)
        )
    if not token and not _is_loopback(host):
        _log.warning("HTTP Metadata Server is bound to %s with no authentication token (MC_METADATA_HTTP_ALLOW_INSECURE opt-in): "
                     "anyone who can reach this port can read and rewrite cluster metadata. Set MC_METADATA_HTTP_TOKEN here and on every engine.", host)


# Servers started here, stopped at interpreter exit if their owner did not close them.
_live: "weakref.WeakSet[KVBootstrapServer]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for srv in list(_live):
        try:
            srv.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class KVBootstrapServer:
    """HTTP server for storing and retrieving metadata (Mooncake's class of the same name):
    ``KVBootstrapServer(port, host="0.0.0.0")``; ``run()`` starts it in the background and
    returns a thread that lives as long as the server; ``poll()`` is ``KVPoll.Success`` while
    it serves, else ``KVPoll.Failed``; ``close()`` stops it."""

    def __init__(self, port: int, host: str = "0.0.0.0") -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise TypeError("KVBootstrapServer: port must be an int in [0, 65536), not %r" % (port,))
        self.port = port
        self.host = str(host)
        self.thread: Optional[threading.Thread] = None
        # Read here, as Mooncake reads them in __init__ (ValueError for a bad value).
        self._budget = _budget_args()
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        """``http://host:port/metadata``: what transfer engines take as ``metadata_server``."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("[%s]" % self.host if ":" in self.host else self.host)
        return "http://%s:%d/metadata" % (host, self.port)

    @property
    def pid(self) -> Optional[int]:
        """The server process's id (None before ``run()``)."""
        return self._proc.pid if self._proc is not None else None

    def run(self) -> threading.Thread:
        """Starts the server; returns when it listens. Raises FileNotFoundError without a
        kvferry binary and RuntimeError if the server cannot start (e.g. the port is taken)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self.thread  # type: ignore[return-value]
            _check_open_bind(self.host, self.port)
            cmd = kvferry_command() + ["metadata-server", "--host", self.host, "--port", str(self.port)] + self._budget
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            line = self._first_line(proc)
            if line is None:
                err = self._stop(proc)
                raise RuntimeError("the HTTP metadata server did not start on %s:%d (%s): %s" % (self.host, self.port, " ".join(cmd), err or "no output"))
            for word in line.split():
                if word.startswith("port="):
                    self.port = int(word[5:])
            self._proc = proc
            _live.add(self)
            # Drains the server's stderr into the log, and ends when the server does.
            self.thread = threading.Thread(target=self._watch, args=(proc,), name="kvferry-metadata-server", daemon=True)
            self.thread.start()
            _log.info("HTTP Metadata Server started on %s:%d (kvferry metadata-server, pid %d)", self.host, self.port, proc.pid)
            return self.thread

    @staticmethod
    def _first_line(proc: subprocess.Popen) -> Optional[str]:
        """The server's "listening ... port=N" line, or None if it exits or stays silent."""
        box: List[str] = []
        out = proc.stdout
        if out is None:
            return None
        t = threading.Thread(target=lambda: box.append(out.readline().decode("utf-8", "replace")), daemon=True)
        t.start()
        t.join(_START_TIMEOUT_S)
        if not box or "port=" not in box[0]:
            return None
        return box[0]

    @staticmethod
    def _terminate(proc: subprocess.Popen) -> None:
        """SIGTERM, then SIGKILL after 5 s; waits for the process."""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    @staticmethod
    def _stop(proc: subprocess.Popen) -> str:
        KVBootstrapServer._terminate(proc)
        err = proc.stderr.read().decode("utf-8", "replace").strip() if proc.stderr is not None else ""
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
        return err

    @staticmethod
    def _watch(proc: subprocess.Popen) -> None:
        out = proc.stdout
        if out is not None:
            # Keeps the stdout pipe drained so the server never blocks on it.
            threading.Thread(target=lambda: [None for _ in out], name="kvferry-metadata-server-out", daemon=True).start()
        if proc.stderr is not None:
            for raw in proc.stderr:
                _log.warning("kvferry metadata-server: %s", raw.decode("utf-8", "replace").rstrip())
        proc.wait()

    def close(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL after 5 s) and waits for it."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is None:
                return
            self._terminate(proc)
            if self.thread is not None:
                self.thread.join(timeout=2)
            for f in (proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
            _log.info("HTTP Metadata Server on %s:%d stopped", self.host, self.port)

    def poll(self) -> KVPoll:
        """``KVPoll.Success`` while the server runs, ``KVPoll.Failed`` otherwise."""
        if self.thread is None or not self.thread.is_alive() or self._proc is None or self._proc.poll() is not None:
            return KVPoll.Failed
        return KVPoll.Success

    def __enter__(self) -> "KVBootstrapServer":
        self.run()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            p = self._proc
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(5)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# --log-level to KVFERRY_LOG (an explicit KVFERRY_LOG wins).
_LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warn", "ERROR": "error", "CRITICAL": "error"}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Mooncake's ``mooncake_http_metadata_server`` arguments."""
    p = argparse.ArgumentParser(description="HTTP Metadata Server for Mooncake (kvferry)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--port", type=int, default=8080, help="Port to listen on")
    p.add_argument("--host", type=str, default="0.0.0.0", help="Host to bind to")
    p.add_argument("--log-level", type=str, choices=sorted(_LEVELS), default="INFO", help="Logging level")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the server in the foreground: this process becomes ``kvferry metadata-server``
    (exec; with the wheel's own command, a fresh ``python -m kvferry``), so signals and the
    exit status are the server's."""
    args = parse_args(argv)
    try:
        cmd = kvferry_command()
    except FileNotFoundError as e:
        print("mooncake_http_metadata_server (kvferry): %s" % e, file=sys.stderr)
        return 1
    try:
        budget = _budget_args()
        _check_open_bind(args.host, args.port)
    except (RuntimeError, ValueError) as e:
        print("mooncake_http_metadata_server (kvferry): %s" % e, file=sys.stderr)
        return 1
    os.environ.setdefault("KVFERRY_LOG", _LEVELS[args.log_level])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd + ["metadata-server", "--host", args.host, "--port", str(args.port)] + budget)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
