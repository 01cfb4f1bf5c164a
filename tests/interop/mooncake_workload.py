#!/usr/bin/env python3
"""Stock Mooncake moving the requests of ``kvferry bench --workload``, as its users call it.

Run with the interpreter of a venv that has the PyPI Mooncake wheel
(``mooncake-transfer-engine-non-cuda``); ``kvferry bench --workload --mooncake-python PY``
writes the plan and runs this:

  PY tests/interop/mooncake_workload.py --plan PLAN.json

PLAN.json: ``{"pool_bytes": N, "duration": S, "chunk": 8192, "workers": 8, "points": [
{"preset", "tokens", "concurrency", "direction", "descs": PATH, "per_slot": N}, ...]}``.
A point's descriptor file holds ``concurrency`` request slots one after the other, each
``per_slot`` little-endian u64 triples (offset in the initiator's pool, offset in the target's
pool, length): the same descriptors kvferry moved for that point.

Topology: both on 127.0.0.1 over TCP (MC_FORCE_TCP=1; pooled lanes with the largest queues
Mooncake accepts, without which its calls of 8192 descriptors fail: see ``_engine``),
P2PHANDSHAKE metadata. A target (this
script with ``--serve BYTES``, a second process) registers a pool filled with a pattern and
answers ``hash`` lines on stdin (the BLAKE2b of its side of one request slot); the initiator
(this process) registers its own pool and, per point, runs ``concurrency`` threads, each moving
its slot's request back to back for ``duration`` seconds (at least once). A request is what the
CollectiveX suite's Mooncake adapter does: Python lists of addresses, cut into calls of
``chunk`` descriptors (``batch_transfer_sync_write`` or ``_read``) run on a thread pool of
``workers``, the request done when every call returned 0. After the point, each slot's
destination is hashed and compared with its source.

stdout: one JSON line per point ``{"engine":"mooncake","preset",...,"gbps","p50_ms","p99_ms",
"requests","verified"}``; on failure ``{"engine":"mooncake","error":...}`` and exit 1.
"""

import argparse
import array
import ctypes
import hashlib
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HOST = "127.0.0.1"
# The pattern's period: not a power of two, so a descriptor landing a whole number of
# blocks away from where it belongs does not hash the same.
PERIOD = (1 << 20) + 7


def _engine():
    os.environ.setdefault("MC_FORCE_TCP", "1")
    # Mooncake's TCP defaults cannot move these requests here: one connection per descriptor
    # overflows the target's listen backlog past about 3000 descriptors in a call (the call
    # returns -1), and pooled lanes refuse more than 1024 queued per peer. Pooled lanes with
    # the largest queues it accepts are what a user moving KV caches over TCP sets.
    os.environ.setdefault("MC_TCP_ENABLE_CONNECTION_POOL", "1")
    os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "65535")
    os.environ.setdefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "65535")
    os.environ.setdefault("GLOG_minloglevel", "1")
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    return te


class Pool:
    def __init__(self, size):
        self.size = size
        self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)

    def fill_pattern(self, seed):
        block = hashlib.shake_256(b"%d" % seed).digest(PERIOD)
        pos = 0
        while pos < self.size:
            n = min(PERIOD, self.size - pos)
            self.mm[pos:pos + n] = block[:n]
            pos += n

    def hash(self, triples, which):
        h = hashlib.blake2b()
        view = memoryview(self.mm)
        try:
            for i in range(0, len(triples), 3):
                off, n = triples[i + which], triples[i + 2]
                h.update(view[off:off + n])
        finally:
            view.release()
        return h.hexdigest()


def _slot(path, per_slot, slot):
    a = array.array("Q")
    with open(path, "rb") as f:
        f.seek(slot * per_slot * 24)
        a.fromfile(f, per_slot * 3)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def serve(size):
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    te = _engine()
    pool = Pool(size)
    pool.fill_pattern(7)
    if te.register_memory(pool.addr, size) != 0:
        raise RuntimeError("register_memory failed")
    out.write("READY %s:%d %d\n" % (HOST, te.get_rpc_port(), pool.addr))
    for line in sys.stdin:
        f = line.split()
        if len(f) == 4 and f[0] == "hash":
            out.write(pool.hash(_slot(f[1], int(f[2]), int(f[3])), 1) + "\n")
    te.unregister_memory(pool.addr)


def pct(v, p):
    v = sorted(v)
    return v[round((len(v) - 1) * p)] if v else 0.0


def run(plan, out):
    target = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(plan["pool_bytes"])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = target.stdout.readline().split()
        if len(ready) != 3 or ready[0] != "READY":
            raise RuntimeError("the Mooncake target did not start: %r" % (ready,))
        seg, remote = ready[1], int(ready[2])
        te = _engine()
        pool = Pool(plan["pool_bytes"])
        if te.register_memory(pool.addr, pool.size) != 0:
            raise RuntimeError("register_memory failed")
        workers = ThreadPoolExecutor(max_workers=plan["workers"])
        chunk = plan["chunk"]
        for n, pt in enumerate(plan["points"]):
            c, per = pt["concurrency"], pt["per_slot"]
            push = pt["direction"] == "push"
            call = te.batch_transfer_sync_write if push else te.batch_transfer_sync_read
            slots = [_slot(pt["descs"], per, s) for s in range(c)]
            # The lists a connector builds: addresses, not offsets.
            lists = [([pool.addr + t[i] for i in range(0, len(t), 3)],
                      [remote + t[i + 1] for i in range(0, len(t), 3)],
                      [t[i + 2] for i in range(0, len(t), 3)]) for t in slots]
            if push:
                pool.fill_pattern(100 + n)
            else:
                ctypes.memset(pool.addr, 0, pool.size)

            def request(l):
                src, dst, ln = l
                futs = [workers.submit(call, seg, src[i:i + chunk], dst[i:i + chunk],
                                       ln[i:i + chunk]) for i in range(0, len(src), chunk)]
                for f in futs:
                    if f.result() != 0:
                        raise RuntimeError("batch_transfer_sync_%s returned %r"
                                           % ("write" if push else "read", f.result()))

            lat, errors = [], []
            start = time.perf_counter()

            def driver(l):
                mine = []
                try:
                    while not mine or time.perf_counter() - start < plan["duration"]:
                        t0 = time.perf_counter()
                        request(l)
                        mine.append((time.perf_counter() - t0) * 1e3)
                except Exception as e:  # reported as the point's error
                    errors.append(str(e))
                lat.extend(mine)

            threads = [threading.Thread(target=driver, args=(l,)) for l in lists]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - start
            if errors:
                if target.poll() is not None:
                    errors[0] += " (the Mooncake target exited with status %r)" % target.poll()
                raise RuntimeError(errors[0])
            verified = True
            for s, t in enumerate(slots):
                target.stdin.write("hash %s %d %d\n" % (pt["descs"], per, s))
                target.stdin.flush()
                theirs = target.stdout.readline().strip()
                verified &= theirs == pool.hash(t, 0)
            per_bytes = sum(slots[0][2::3])
            out.write(json.dumps({
                "engine": "mooncake", "preset": pt["preset"], "tokens": pt["tokens"],
                "concurrency": c, "direction": pt["direction"], "transport": "tcp",
                "descriptors": per, "request_bytes": per_bytes, "requests": len(lat),
                "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99),
                "gbps": len(lat) * per_bytes / elapsed / 1e9, "verified": verified,
            }) + "\n")
            out.flush()
        workers.shutdown()
        te.unregister_memory(pool.addr)
    finally:
        target.stdin.close()
        try:
            target.wait(timeout=30)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan")
    ap.add_argument("--serve", type=int)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve)
        return 0
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        with open(a.plan) as f:
            run(json.load(f), out)
    except Exception as e:
        out.write(json.dumps({"engine": "mooncake", "error": str(e)}) + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
