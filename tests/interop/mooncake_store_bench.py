#!/usr/bin/env python3
"""Stock Mooncake Store measured in the shape of ``kvferry store-bench``.

Run with the interpreter of a venv that has the PyPI Mooncake wheel installed
(``mooncake-transfer-engine-non-cuda``; ``mooncake_master`` is taken from the same bin/):

  /tmp/mcvenv/bin/python tests/interop/mooncake_store_bench.py \
      [--values 4096,65536,1048576,16777216] [--batch 32] [--duration 1.0] \
      [--segment-size 2147483648] [--lease-ms 500] \
      [--cycle-values 65536,1048576] [--cycle-segment-size 67108864] \
      [--multi-layers 8] [--multi-part 65536]

Topology (everything on 127.0.0.1, TCP transport, P2PHANDSHAKE metadata):

* ``mooncake_master`` on free ports (RPC + metrics/admin HTTP, both bound to 127.0.0.1),
  ``--default_kv_lease_ttl=<lease-ms>``, eviction settings left at their defaults;
* a serving client (this script with ``--serve``, a separate process) that mounts the only
  global segment (``--segment-size`` bytes, 16 MiB local buffer) and stays up until its stdin
  closes;
* the bench process itself, a pure client (``global_segment_size=0``, which Mooncake accepts:
  "Global segment size is 0, skip mounting segment") with a local buffer of
  batch x largest value + 64 MiB.  Every put/get therefore moves the bytes between the two
  clients through the transfer engine; after each get phase the bench checks (get_replica_desc
  on the first and last key of the phase) that the replicas live in the serving client's
  segment: the replica's transport endpoint equals the one the server found for its own segment
  with a probe object at start-up.  No preferred_segment / ReplicateConfig is needed: the
  serving client's segment is the only one mounted.

For every value size and for batch in (1, --batch):

* ``put_from``  put_from / batch_put_from from a registered, page-aligned mmap buffer;
* ``get_into``  get_into / batch_get_into into a second registered buffer, every byte checked;
* ``put``       put / put_batch (bytes API; copies through the client's local buffer);
* ``get``       get / get_batch (bytes API), every byte checked.

Puts run until --duration seconds spent inside the calls (at least one call), keeping the
resident data under segment/8; gets read every written key at least once and go on cycling
over them until --duration seconds of calls.  ``remove_all(force=True)`` empties the store
between the put_from/get_into pair and the put/get pair and after each point (a plain
``remove_all()`` skips objects whose read lease is still running).

With --cycle-values, a second master and serving client (segment of --cycle-segment-size
bytes) then run the put/get/remove cycle of ``kvferry store-bench``: per value size, one key
at a time put_from + get_into (checked) + remove(key, force=True), at least 4x the segment's
size put, until --duration seconds of cycles; op "cycle" points (gbps: bytes put).

stdout: exactly one JSON line per point
  {"engine":"mooncake","op":...,"value_bytes":N,"batch":B,"gbps":X,"keys_per_s":Y,
   "p50_us":P,"p99_us":Q,"verified":bool}
(gbps = keys*value/seconds inside the calls/1e9; p50/p99 per call), then one line
  {"engine":"mooncake","op":"get_into_single_4k_p50_us","value":...}.
On failure: {"engine":"mooncake","error":"..."} and a non-zero exit (130 when interrupted).
Progress, diagnostics and the bench client's Mooncake logging go to stderr (GLOG_minloglevel
defaults to 1 here, but the ~16 setup lines Mooncake logs before InitGoogleLogging still show);
the master's and the server's logs go to a temporary directory and are quoted on failure.
If a point's batch x value exceeds segment/8 (16 MiB x 32 with the defaults), it still makes
its one call (as kvferry store-bench does).  Mooncake refuses global_segment_size below 16 MiB
for the serving client (setup returns -600).
The master and the server are always stopped (also on exceptions, SIGTERM and Ctrl-C).

Value pattern: the first min(64, size) bytes of value(key) are blake2b-512(key); the rest is a
slice of a fixed pseudo-random block (shake-256) starting at an offset derived from the key,
so a value read back under the wrong key or with misplaced bytes is caught.
"""

import argparse
import ctypes
import hashlib
import json
import math
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

HOST = "127.0.0.1"
ENGINE = "mooncake"
_HDR = 64           # bytes of per-key header at the start of each value
_OFF_SPAN = 1 << 16  # key-derived offsets into the random block
_PR_SET_PDEATHSIG = 1

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("GLOG_minloglevel", "1")


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mooncake_peer import _claim_stdout, _emit  # noqa: E402  (plumbing only; imports no Mooncake)


class BenchError(Exception):
    pass


# ---------------------------------------------------------------------------------------
# plumbing

def _log(msg):
    sys.stderr.write("mooncake_store_bench: %s\n" % msg)
    sys.stderr.flush()


def _free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((HOST, 0))
        return s.getsockname()[1]
    finally:
        s.close()


def _die_with_parent(sig):
    """preexec_fn: the child gets `sig` when the bench process dies (Linux prctl)."""
    def f():
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except Exception:
            pass
    return f


class Child:
    """A process started in its own process group; stopped by pid / pgid only."""

    def __init__(self, name, argv, log_path, stdin=None, stdout=None, death_sig=signal.SIGKILL):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.p = subprocess.Popen(argv, stdin=stdin, stdout=stdout if stdout is not None else self._log,
                                  stderr=self._log, start_new_session=True,
                                  preexec_fn=_die_with_parent(death_sig), close_fds=True)
        self.pid = self.p.pid

    def alive(self):
        return self.p.poll() is None

    def log_tail(self, n=15):
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
            return "\n".join(lines[-n:])
        except OSError:
            return ""

    def _signal_group(self, sig):
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace=10.0):
        if self.p.stdin is not None:
            try:
                self.p.stdin.close()
            except OSError:
                pass
        if self.alive():
            try:
                self.p.wait(timeout=grace if self.p.stdin is not None else 0.01)
            except subprocess.TimeoutExpired:
                pass
        if self.alive():
            self._signal_group(signal.SIGTERM)
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.alive():
            self._signal_group(signal.SIGKILL)
            self.p.wait()
        # Anything else left in the group (there should be nothing).
        self._signal_group(signal.SIGKILL)
        if self.p.stdout is not None:
            try:
                self.p.stdout.close()
            except OSError:
                pass
        self._log.close()
        return self.p.returncode


# ---------------------------------------------------------------------------------------
# values

class Pattern:
    def __init__(self, max_value):
        self.block = hashlib.shake_256(b"kvferry mooncake store bench").digest(max_value + _OFF_SPAN)
        self.view = memoryview(self.block)

    @staticmethod
    def _parts(key):
        h = hashlib.blake2b(key.encode(), digest_size=64).digest()
        return h, int.from_bytes(h[:8], "little") % _OFF_SPAN

    def fill(self, mm, pos, size, key):
        """Write value(key) of `size` bytes into mm[pos:pos+size]."""
        h, off = self._parts(key)
        n = min(_HDR, size)
        mm[pos:pos + n] = h[:n]
        if size > n:
            mm[pos + n:pos + size] = self.view[off:off + size - n]

    def value(self, key, size):
        h, off = self._parts(key)
        n = min(_HDR, size)
        return h[:n] + self.block[off:off + size - n]

    def check(self, buf, key, size):
        """buf: bytes-like of exactly the value's length (memoryview or bytes)."""
        if len(buf) != size:
            return False
        h, off = self._parts(key)
        n = min(_HDR, size)
        mv = memoryview(buf)
        try:
            if mv[:n] != h[:n]:
                return False
            return size == n or mv[n:size] == self.view[off:off + size - n]
        finally:
            mv.release()


class Buffer:
    """Page-aligned anonymous mapping with a stable address."""

    def __init__(self, size):
        self.size = size
        self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)
        self.view = memoryview(self.mm)


def register(store, buffers):
    """Registers each Buffer with the store; their addresses (raises on a refusal)."""
    out = []
    for b in buffers:
        r = store.register_buffer(b.addr, b.size)
        if r != 0:
            raise BenchError("register_buffer(%d bytes) returned %r" % (b.size, r))
        out.append(b.addr)
    return out


def pct(v, p):
    if not v:
        return 0.0
    s = sorted(v)
    return s[int(math.floor((len(s) - 1) * p + 0.5))]


# ---------------------------------------------------------------------------------------
# the serving client (separate process)

def serve(master, segment_size):
    out = _claim_stdout()
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    ret = s.setup(HOST, "P2PHANDSHAKE", segment_size, 16 << 20, "tcp", "", master)
    if ret != 0:
        _emit(out, {"error": "serving client setup returned %r" % (ret,)})
        return 1
    # Find the transport endpoint of this client's segment: a probe object can only land
    # in it (the bench client has not started yet and contributes no segment anyway).
    endpoint = None
    try:
        key = "__mooncake_store_bench_probe_%d" % os.getpid()
        r = s.put(key, b"\x5a" * 4096)
        if r == 0:
            for d in s.get_replica_desc(key):
                if d.is_memory_replica():
                    endpoint = d.get_memory_descriptor().buffer_descriptor.transport_endpoint
            s.remove(key, True)
        else:
            _log("server probe put returned %r" % (r,))
    except Exception as e:  # diagnostics only
        _log("server probe failed: %r" % (e,))
    _emit(out, {"ready": True, "hostname": s.get_hostname(), "endpoint": endpoint})
    try:
        while sys.stdin.buffer.read(65536):
            pass
    except (OSError, KeyboardInterrupt):
        pass
    s.close()
    return 0


# ---------------------------------------------------------------------------------------
# the bench

def start_master(args, tmpdir, tag="master"):
    exe = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if not os.path.exists(exe):
        raise BenchError("mooncake_master not found next to %s" % sys.executable)
    last = ""
    for attempt in range(3):
        rpc_port, metrics_port = _free_port(), _free_port()
        argv = [exe,
                "--rpc_address=%s" % HOST, "--rpc_port=%d" % rpc_port,
                "--metrics_host=%s" % HOST, "--metrics_port=%d" % metrics_port,
                "--enable_metric_reporting=false",
                "--enable_http_metadata_server=false", "--enable_ha=false",
                "--default_kv_lease_ttl=%d" % args.lease_ms,
                ]
        m = Child(tag, argv, os.path.join(tmpdir, "%s.%d.log" % (tag, attempt)))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and m.alive():
            try:
                socket.create_connection((HOST, rpc_port), timeout=0.5).close()
                _log("master pid %d on %s:%d (metrics %d)" % (m.pid, HOST, rpc_port, metrics_port))
                return m, "%s:%d" % (HOST, rpc_port)
            except OSError:
                time.sleep(0.05)
        last = m.log_tail()
        m.stop()
    raise BenchError("mooncake_master did not start: %s" % last[-800:])


def start_server(args, master_addr, tmpdir, segment_size=None, tag="server"):
    argv = [sys.executable, os.path.abspath(__file__), "--serve", master_addr,
            "--segment-size", str(segment_size or args.segment_size)]
    srv = Child(tag, argv, os.path.join(tmpdir, "%s.log" % tag), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, death_sig=signal.SIGTERM)
    line = srv.p.stdout.readline().decode("utf-8", "replace").strip()
    try:
        info = json.loads(line) if line else {}
    except ValueError:
        info = {}
    if not info.get("ready"):
        tail = srv.log_tail()
        srv.stop(grace=2)
        raise BenchError("serving client did not start (printed %r; log: %s)"
                         % (info.get("error", line), tail[-800:]))
    _log("serving client pid %d: hostname %s, segment endpoint %s"
         % (srv.pid, info.get("hostname"), info.get("endpoint")))
    return srv, info


class Bench:
    def __init__(self, args, out, master_addr, server_endpoint):
        from mooncake.store import MooncakeDistributedStore

        self.a = args
        self.out = out
        self.server_endpoint = server_endpoint
        self.maxv = max(args.values)
        self.slots = max(args.batch, 1)
        self.pat = Pattern(self.maxv)
        self.store = MooncakeDistributedStore()
        lbs = self.maxv * self.slots + (64 << 20)
        ret = self.store.setup(HOST, "P2PHANDSHAKE", 0, lbs, "tcp", "", master_addr)
        if ret != 0:
            raise BenchError("bench client setup(global_segment_size=0) returned %r" % (ret,))
        self.closed = False
        self.src = Buffer(self.maxv * self.slots)
        self.dst = Buffer(self.maxv * self.slots)
        self.registered = register(self.store, (self.src, self.dst))
        self.placement_checked = 0
        self.points = []

    def close(self):
        if self.closed:
            return
        self.closed = True
        for addr in self.registered:
            try:
                self.store.unregister_buffer(addr)
            except Exception:
                pass
        self.store.close()

    # -- helpers ------------------------------------------------------------------------

    def emit_point(self, op, v, batch, nkeys, busy, lat, verified):
        secs = max(busy, 1e-9)
        p = {"engine": ENGINE, "op": op, "value_bytes": v, "batch": batch,
             "gbps": round(nkeys * v / secs / 1e9, 6), "keys_per_s": round(nkeys / secs, 3),
             "p50_us": round(pct(lat, 0.5), 3), "p99_us": round(pct(lat, 0.99), 3),
             "verified": bool(verified)}
        self.points.append(p)
        _emit(self.out, p)
        _log("  %-8s %9d x %-3d %8.3f GB/s %11.0f keys/s p50 %9.1f us p99 %9.1f us calls %d %s"
             % (op, v, batch, p["gbps"], p["keys_per_s"], p["p50_us"], p["p99_us"], len(lat),
                "verified" if verified else "NOT VERIFIED"))
        return p

    def clear(self, expected):
        n = self.store.remove_all(True)
        if n < 0:
            raise BenchError("remove_all(force=True) returned %r" % (n,))
        if n != expected:
            _log("remove_all(force=True) removed %d objects, expected %d" % (n, expected))
            deadline = time.monotonic() + self.a.lease_ms / 1000.0 + 2
            while time.monotonic() < deadline:
                m = self.store.remove_all(True)
                if m <= 0:
                    break
                time.sleep(0.05)

    def check_placement(self, key):
        descs = self.store.get_replica_desc(key)
        eps = [d.get_memory_descriptor().buffer_descriptor.transport_endpoint
               for d in descs if d.is_memory_replica()]
        if not eps:
            raise BenchError("no memory replica for %s" % key)
        if self.server_endpoint and any(e != self.server_endpoint for e in eps):
            raise BenchError("replica of %s at %s, not in the serving client's segment %s"
                             % (key, eps, self.server_endpoint))
        self.placement_checked += 1

    def _stop(self, calls, busy, t_start, rounds_done_min=True):
        if calls == 0 or not rounds_done_min:
            return False
        if busy >= self.a.duration:
            return True
        # Guard against per-call Python overhead dwarfing tiny calls.
        return time.monotonic() - t_start >= max(3 * self.a.duration, self.a.duration + 5)

    # -- one point: the four ops ---------------------------------------------------------

    def run_point(self, v, batch):
        a = self.a
        st = self.store
        src, dst, pat = self.src, self.dst, self.pat
        max_keys = (a.segment_size // 8) // v
        rounds_cap = max(max_keys // batch, 1)
        addrs_src = [src.addr + i * v for i in range(batch)]
        addrs_dst = [dst.addr + i * v for i in range(batch)]
        sizes = [v] * batch
        pc = time.perf_counter

        def keys_of(tag, r):
            return ["mc-%s-%d-%d-%d-%d" % (tag, v, batch, r, i) for i in range(batch)]

        # put_from --------------------------------------------------------------------
        rounds, lat, busy, t0w = [], [], 0.0, time.monotonic()
        while len(rounds) < rounds_cap and not self._stop(len(rounds), busy, t0w):
            ks = keys_of("z", len(rounds))
            for i, k in enumerate(ks):
                pat.fill(src.mm, i * v, v, k)
            t = pc()
            if batch == 1:
                res = [st.put_from(ks[0], addrs_src[0], v)]
            else:
                res = st.batch_put_from(ks, addrs_src, sizes)
            dt = pc() - t
            busy += dt
            lat.append(dt * 1e6)
            for k, r in zip(ks, res):
                if r != 0:
                    raise BenchError("put_from %s (%d bytes) returned %r" % (k, v, r))
            rounds.append(ks)
        nkeys = len(rounds) * batch
        self.emit_point("put_from", v, batch, nkeys, busy, lat, True)

        # get_into: every key at least once, then cycle until --duration of calls ------
        lat, busy, verified, t0w, n, keys_read = [], 0.0, True, time.monotonic(), 0, 0
        while not self._stop(n, busy, t0w, n >= len(rounds)):
            ks = rounds[n % len(rounds)]
            ctypes.memset(dst.addr, 0, batch * v)
            t = pc()
            if batch == 1:
                res = [st.get_into(ks[0], addrs_dst[0], v)]
            else:
                res = st.batch_get_into(ks, addrs_dst, sizes)
            dt = pc() - t
            busy += dt
            lat.append(dt * 1e6)
            for i, (k, r) in enumerate(zip(ks, res)):
                if r < 0:
                    raise BenchError("get_into %s returned %r" % (k, r))
                if r != v or not pat.check(dst.view[i * v:(i + 1) * v], k, v):
                    if verified:
                        _log("get_into %s: returned %r, bytes differ from the value written" % (k, r))
                    verified = False
            n += 1
            keys_read += batch
        self.check_placement(rounds[0][0])
        self.check_placement(rounds[-1][-1])
        self.emit_point("get_into", v, batch, keys_read, busy, lat, verified)
        single_4k = lat if (v == 4096 and batch == 1) else None
        self.clear(nkeys)

        # put (bytes API) -----------------------------------------------------------------
        rounds, lat, busy, t0w = [], [], 0.0, time.monotonic()
        while len(rounds) < rounds_cap and not self._stop(len(rounds), busy, t0w):
            ks = keys_of("b", len(rounds))
            vals = [pat.value(k, v) for k in ks]
            t = pc()
            if batch == 1:
                res = [st.put(ks[0], vals[0])]
            else:
                r = st.put_batch(ks, vals)
                res = r if isinstance(r, list) else [r] * batch
            dt = pc() - t
            busy += dt
            lat.append(dt * 1e6)
            for k, r in zip(ks, res):
                if r != 0:
                    raise BenchError("put %s (%d bytes) returned %r" % (k, v, r))
            rounds.append(ks)
            del vals
        nkeys = len(rounds) * batch
        self.emit_point("put", v, batch, nkeys, busy, lat, True)

        # get (bytes API) -----------------------------------------------------------------
        lat, busy, verified, t0w, n, keys_read = [], 0.0, True, time.monotonic(), 0, 0
        while not self._stop(n, busy, t0w, n >= len(rounds)):
            ks = rounds[n % len(rounds)]
            t = pc()
            if batch == 1:
                res = [st.get(ks[0])]
            else:
                res = st.get_batch(ks)
            dt = pc() - t
            busy += dt
            lat.append(dt * 1e6)
            if len(res) != len(ks):
                raise BenchError("get_batch returned %d values for %d keys" % (len(res), len(ks)))
            for k, val in zip(ks, res):
                if len(val) == 0:
                    raise BenchError("get %s returned no bytes (missing or failed)" % k)
                if not pat.check(val, k, v):
                    if verified:
                        _log("get %s: %d bytes, differ from the value written" % (k, len(val)))
                    verified = False
            del res
            n += 1
            keys_read += batch
        self.check_placement(rounds[0][0])
        self.emit_point("get", v, batch, keys_read, busy, lat, verified)
        self.clear(nkeys)
        return single_4k

    def single_4k(self):
        """4 KiB get_into latency when 4096 is not among --values."""
        st, v = self.store, 4096
        keys = ["mc-lat4k-%d" % i for i in range(64)]
        for i, k in enumerate(keys):
            self.pat.fill(self.src.mm, 0, v, k)
            r = st.put_from(k, self.src.addr, v)
            if r != 0:
                raise BenchError("put_from %s returned %r" % (k, r))
        lat, busy, n, t0w = [], 0.0, 0, time.monotonic()
        while not self._stop(n, busy, t0w, n >= len(keys)):
            k = keys[n % len(keys)]
            t = time.perf_counter()
            r = st.get_into(k, self.dst.addr, v)
            dt = time.perf_counter() - t
            busy += dt
            lat.append(dt * 1e6)
            if r != v or not self.pat.check(self.dst.view[:v], k, v):
                raise BenchError("get_into %s returned %r or wrong bytes" % (k, r))
            n += 1
        self.clear(len(keys))
        return lat

    def run_multi(self):
        """put_multi / get_multi: --batch keys per call, each --multi-layers regions of
        --multi-part bytes interleaved in one registered KV cache (block b's layer l at
        (l * batch + b) * part), with batch_put_from_multi_buffers and
        batch_get_into_multi_buffers, every byte checked (as kvferry store-bench)."""
        a, st = self.a, self.store
        layers, part, batch = a.multi_layers, a.multi_part, max(a.batch, 1)
        v = layers * part
        _log("[multi] %d keys x %d layers x %d bytes" % (batch, layers, part))
        pat = Pattern(v)
        src, dst, tmp = Buffer(batch * v), Buffer(batch * v), Buffer(v)
        self.registered += register(st, (src, dst))

        def at(b, l):
            return (l * batch + b) * part

        src_ptrs = [[src.addr + at(b, l) for l in range(layers)] for b in range(batch)]
        dst_ptrs = [[dst.addr + at(b, l) for l in range(layers)] for b in range(batch)]
        sizes = [[part] * layers for _ in range(batch)]
        rounds_cap = max((a.segment_size // 8) // v // batch, 1)
        rounds, lat, busy, t0w = [], [], 0.0, time.monotonic()
        while len(rounds) < rounds_cap and not self._stop(len(rounds), busy, t0w):
            r = len(rounds)
            ks = ["mc-multi-%d-%d" % (r, b) for b in range(batch)]
            for b, k in enumerate(ks):
                pat.fill(tmp.mm, 0, v, k)
                for l in range(layers):
                    o = at(b, l)
                    src.view[o:o + part] = tmp.view[l * part:(l + 1) * part]
            t = time.perf_counter()
            res = st.batch_put_from_multi_buffers(ks, src_ptrs, sizes)
            dt = time.perf_counter() - t
            busy += dt
            lat.append(dt * 1e6)
            if list(res) != [0] * batch:
                raise BenchError("batch_put_from_multi_buffers returned %r" % (res,))
            rounds.append(ks)
        nkeys = sum(len(r) for r in rounds)
        self.emit_point("put_multi", v, batch, nkeys, busy, lat, True)
        lat, busy, n, read, verified, t0w = [], 0.0, 0, 0, True, time.monotonic()
        while not self._stop(n, busy, t0w, n >= len(rounds)):
            ks = rounds[n % len(rounds)]
            t = time.perf_counter()
            res = st.batch_get_into_multi_buffers(ks, dst_ptrs, sizes)
            dt = time.perf_counter() - t
            busy += dt
            lat.append(dt * 1e6)
            if list(res) != [v] * batch:
                raise BenchError("batch_get_into_multi_buffers returned %r" % (res,))
            for b, k in enumerate(ks):
                for l in range(layers):
                    o = at(b, l)
                    tmp.view[l * part:(l + 1) * part] = dst.view[o:o + part]
                verified = verified and pat.check(tmp.view[:v], k, v)
            n += 1
            read += len(ks)
        self.emit_point("get_multi", v, batch, read, busy, lat, verified)
        self.clear(nkeys)

    def run(self):
        a = self.a
        batches = [1] if a.batch == 1 else [1, a.batch]
        total = len(a.values) * len(batches)
        n = 0
        lat4k = None
        for v in a.values:
            for b in batches:
                n += 1
                _log("[%d/%d] values of %d bytes x %d" % (n, total, v, b))
                l4 = self.run_point(v, b)
                if l4 is not None:
                    lat4k = l4
        if a.multi_layers > 0 and a.multi_part > 0:
            self.run_multi()
        if lat4k is None:
            lat4k = self.single_4k()
        _emit(self.out, {"engine": ENGINE, "op": "get_into_single_4k_p50_us",
                         "value": round(pct(lat4k, 0.5), 3)})
        _log("replica placement checked on %d keys: all in the serving client's segment %s"
             % (self.placement_checked, self.server_endpoint))
        bad = [p for p in self.points if not p["verified"]]
        if bad:
            raise BenchError("%d point(s) did not read back exactly: %s"
                             % (len(bad), ", ".join("%s/%d/%d" % (p["op"], p["value_bytes"], p["batch"])
                                                    for p in bad)))


class Cycler:
    """The put/get/remove cycle of ``kvferry store-bench``: one key at a time, put_from,
    get_into (every byte checked) and remove(key, force=True), on a pool of its own whose
    serving segment is --cycle-segment-size bytes, for at least one round of 4x that size and
    until --duration seconds of cycles. Emits op "cycle" points (gbps: bytes put; p50/p99 per
    cycle)."""

    def __init__(self, args, out, master_addr):
        from mooncake.store import MooncakeDistributedStore

        self.a, self.out = args, out
        maxv = max(args.cycle_values)
        self.pat = Pattern(maxv)
        self.store = MooncakeDistributedStore()
        ret = self.store.setup(HOST, "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master_addr)
        if ret != 0:
            raise BenchError("cycle client setup returned %r" % (ret,))
        self.src, self.dst = Buffer(maxv), Buffer(maxv)
        self.registered = register(self.store, (self.src, self.dst))

    def close(self):
        for addr in self.registered:
            try:
                self.store.unregister_buffer(addr)
            except Exception:
                pass
        self.registered = []
        self.store.close()

    def run(self):
        a, st = self.a, self.store
        for v in a.cycle_values:
            _log("[cycle] values of %d bytes over a %d-byte segment" % (v, a.cycle_segment_size))
            rnd = 4 * a.cycle_segment_size // v
            lat, busy, n, verified, t0w = [], 0.0, 0, True, time.monotonic()
            cap = max(3 * a.duration, a.duration + 5)
            while n < rnd or (busy < a.duration and time.monotonic() - t0w < cap):
                k = "mc-cycle-%d-%d" % (v, n)
                self.pat.fill(self.src.mm, 0, v, k)
                t = time.perf_counter()
                r = st.put_from(k, self.src.addr, v)
                if r != 0:
                    raise BenchError("cycle %d (%d bytes put so far): put_from %s returned %r" % (n, n * v, k, r))
                g = st.get_into(k, self.dst.addr, v)
                if g != v:
                    raise BenchError("cycle %d: get_into %s returned %r" % (n, k, g))
                r = st.remove(k, True)
                if r != 0:
                    raise BenchError("cycle %d: remove %s returned %r" % (n, k, r))
                dt = time.perf_counter() - t
                busy += dt
                lat.append(dt * 1e6)
                verified = verified and self.pat.check(self.dst.view[:v], k, v)
                n += 1
            secs = max(busy, 1e-9)
            p = {"engine": ENGINE, "op": "cycle", "value_bytes": v, "batch": 1,
                 "gbps": round(n * v / secs / 1e9, 6), "keys_per_s": round(n / secs, 3),
                 "p50_us": round(pct(lat, 0.5), 3), "p99_us": round(pct(lat, 0.99), 3),
                 "verified": bool(verified)}
            _emit(self.out, p)
            _log("  cycle    %9d       %11.0f cycles/s p50 %9.1f us p99 %9.1f us cycles %d %s"
                 % (v, p["keys_per_s"], p["p50_us"], p["p99_us"], n,
                    "verified" if verified else "NOT VERIFIED"))
            if not verified:
                raise BenchError("cycle %d: values did not read back exactly" % v)


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt("signal %d" % signum)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--values", default="4096,65536,1048576,16777216",
                   help="comma-separated value sizes in bytes")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--duration", type=float, default=1.0)
    p.add_argument("--segment-size", type=int, default=2147483648)
    p.add_argument("--lease-ms", type=int, default=500)
    p.add_argument("--cycle-values", default="",
                   help="comma-separated value sizes of the put/get/remove cycle points (none by default)")
    p.add_argument("--cycle-segment-size", type=int, default=64 << 20)
    p.add_argument("--multi-layers", type=int, default=0,
                   help="layers of the put_multi/get_multi points (0: none, the default)")
    p.add_argument("--multi-part", type=int, default=65536)
    p.add_argument("--serve", metavar="MASTER", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve is None:
        try:
            a.values = [int(x) for x in a.values.split(",") if x.strip()]
        except ValueError:
            p.error("--values: comma-separated integers expected")
        if not a.values or min(a.values) <= 0:
            p.error("--values must be positive")
        if a.batch < 1:
            p.error("--batch must be at least 1")
        if a.duration < 0:
            p.error("--duration must be >= 0")
        try:
            a.cycle_values = [int(x) for x in a.cycle_values.split(",") if x.strip()]
        except ValueError:
            p.error("--cycle-values: comma-separated integers expected")
        if any(v <= 0 or 4 * v > a.cycle_segment_size for v in a.cycle_values):
            p.error("--cycle-values must be positive and fit 4 times in --cycle-segment-size")
        if a.segment_size <= 0 or a.lease_ms <= 0:
            p.error("--segment-size and --lease-ms must be positive")
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.serve is not None:
        signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            return serve(a.serve, a.segment_size)
        except KeyboardInterrupt:
            return 1

    out = _claim_stdout()
    signal.signal(signal.SIGTERM, _on_sigterm)
    children = []
    bench = None
    rc = 0
    tmp = tempfile.TemporaryDirectory(prefix="mc_store_bench_")
    t_all = time.monotonic()
    try:
        master, master_addr = start_master(a, tmp.name)
        children.append(master)
        srv, info = start_server(a, master_addr, tmp.name)
        children.append(srv)
        bench = Bench(a, out, master_addr, info.get("endpoint"))
        bench.run()
        if a.cycle_values:
            m2, m2_addr = start_master(a, tmp.name, tag="cycle-master")
            children.append(m2)
            s2, _ = start_server(a, m2_addr, tmp.name, segment_size=a.cycle_segment_size, tag="cycle-server")
            children.append(s2)
            cycler = Cycler(a, out, m2_addr)
            try:
                cycler.run()
            finally:
                cycler.close()
        _log("done in %.1f s" % (time.monotonic() - t_all))
    except KeyboardInterrupt as e:
        _emit(out, {"engine": ENGINE, "error": "interrupted (%s)" % (str(e) or "Ctrl-C")})
        rc = 130
    except BenchError as e:
        _emit(out, {"engine": ENGINE, "error": str(e)})
        rc = 1
    except Exception as e:  # anything unexpected still reports as JSON
        _emit(out, {"engine": ENGINE, "error": "%s: %s" % (type(e).__name__, e)})
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if bench is not None:
            try:
                bench.close()
            except Exception as e:
                _log("bench client close failed: %r" % (e,))
        for c in reversed(children):
            alive_before = c.alive()
            code = c.stop()
            if not alive_before and rc == 0:
                _log("%s had exited early with %r:\n%s" % (c.name, code, c.log_tail()))
        tmp.cleanup()
    return rc


if __name__ == "__main__":
    sys.exit(main())
