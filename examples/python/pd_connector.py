#!/usr/bin/env python3
"""A prefill/decode KV connector in the shape of vLLM's MooncakeConnector, on Mooncake's API.

Two processes, as a disaggregated deployment runs them:

    python pd_connector.py prefill                       # prints {"listening": PORT}
    python pd_connector.py decode --prefill 127.0.0.1:PORT

It imports ``from mooncake.engine import TransferEngine`` and nothing else of Mooncake, so it
runs unchanged on stock Mooncake or on kvferry (``KVFERRY_MOONCAKE_SHIM=1``), and either side
can be either.

What each side does, as the connector does it:
- **both** register their KV caches once with ``batch_register_memory``: one region per layer
  and per K/V, each ``--blocks`` blocks of ``--block-bytes`` (memory the program allocated,
  as vLLM registers its tensors);
- **decode** takes blocks for a request from its free list (scattered, as an allocator hands
  them out) and sends the prefill side, over a side channel (newline-delimited JSON on TCP;
  vLLM uses ZMQ), the request id, its segment name, the regions' base addresses and the block
  ids;
- **prefill** "computes" the request's KV into blocks of its own (a pattern derived from the
  request, region and block), groups runs of blocks contiguous on both sides, and pushes with
  ``batch_transfer_sync_write``; it answers ``done`` or ``failed`` per request once the call
  returned, then frees its own blocks;
- **decode** checks every byte of a done request, and frees a request's blocks only once its
  answer came: an **aborted** request keeps its blocks until the prefill side's write into
  them is over, so no write lands in blocks another request was given. After release, decode
  writes a sentinel into the freed blocks and checks at the end that nothing overwrote it.

``--release-early`` does what a wrong connector does (frees an aborted request's blocks at
once); the sentinel check then catches the write landing after release, which shows the check
can fail. The decode side prints one JSON summary line and exits 0 only if every check held.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import socket
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Tuple

from mooncake.engine import TransferEngine

SENTINEL = b"\xa5"


def pattern(req: int, region: int, block: int, length: int) -> bytes:
    """The KV "computed" for a request: 16 bytes naming (request, region, block), repeated."""
    unit = struct.pack("<QQ", req, (region << 32) | block)
    return (unit * (length // 16 + 1))[:length]


class KvCaches:
    """One region per layer and K/V, each ``blocks`` blocks, registered in one call."""

    def __init__(self, engine: Any, regions: int, blocks: int, block_bytes: int) -> None:
        self.blocks, self.block_bytes = blocks, block_bytes
        self.bufs = [(ctypes.c_char * (blocks * block_bytes))() for _ in range(regions)]
        self.bases = [ctypes.addressof(b) for b in self.bufs]
        rc = engine.batch_register_memory(self.bases, [blocks * block_bytes] * regions)
        if rc != 0:
            raise RuntimeError("batch_register_memory returned %d" % rc)
        self.free = list(range(blocks))
        random.Random(blocks).shuffle(self.free)
        self.lock = threading.Lock()

    def take(self, n: int) -> List[int]:
        with self.lock:
            if n > len(self.free):
                raise RuntimeError("out of KV blocks: %d asked, %d free" % (n, len(self.free)))
            got, self.free = self.free[:n], self.free[n:]
            return got

    def give_back(self, ids: List[int]) -> None:
        with self.lock:
            self.free.extend(ids)

    def addr(self, region: int, block: int) -> int:
        return self.bases[region] + block * self.block_bytes

    def fill(self, region: int, block: int, data: bytes) -> None:
        ctypes.memmove(self.addr(region, block), data, len(data))

    def read(self, region: int, block: int) -> bytes:
        return ctypes.string_at(self.addr(region, block), self.block_bytes)


def start_engine() -> Tuple[Any, str]:
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("initialize failed")
    return engine, "127.0.0.1:%d" % engine.get_rpc_port()


def group_contiguous(src: List[int], dst: List[int]) -> List[Tuple[int, int, int]]:
    """Runs of blocks contiguous on both sides: (first src, first dst, count)."""
    runs: List[Tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


# -- prefill -------------------------------------------------------------------------------

def prefill(args: argparse.Namespace) -> int:
    engine, _ = start_engine()
    kv = KvCaches(engine, args.regions, args.blocks, args.block_bytes)
    lsock = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"listening": lsock.getsockname()[1]}), flush=True)
    pool = ThreadPoolExecutor(max_workers=4)

    def push(msg: Dict[str, Any]) -> Dict[str, Any]:
        req, dst_blocks, bases = msg["req"], msg["blocks"], msg["bases"]
        src_blocks = kv.take(len(dst_blocks))
        try:
            for r in range(args.regions):
                for j, b in enumerate(src_blocks):
                    kv.fill(r, b, pattern(req, r, j, args.block_bytes))
            src, dst, lengths = [], [], []
            for s, d, n in group_contiguous(src_blocks, dst_blocks):
                for r in range(args.regions):
                    src.append(kv.addr(r, s))
                    dst.append(bases[r] + d * args.block_bytes)
                    lengths.append(n * args.block_bytes)
            rc = engine.batch_transfer_sync_write(msg["segment"], src, dst, lengths)
            return {"req": req, "status": "done" if rc == 0 else "failed", "rc": rc}
        finally:
            kv.give_back(src_blocks)

    def serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rw") as f:
            for line in f:
                msg = json.loads(line)
                if msg["op"] == "quit":
                    return
                f.write(json.dumps({"req": msg["req"], "status": "started"}) + "\n")
                f.flush()
                f.write(json.dumps(pool.submit(push, msg).result()) + "\n")
                f.flush()

    threads = []
    lsock.settimeout(args.idle_s)
    try:
        while True:
            try:
                conn, _ = lsock.accept()
            except socket.timeout:
                break
            if args.connections and len(threads) >= args.connections:
                conn.close()
                continue
            t = threading.Thread(target=serve, args=(conn,), daemon=True)
            t.start()
            threads.append(t)
            if args.connections and len(threads) == args.connections:
                break
    finally:
        lsock.close()
    for t in threads:
        t.join()
    pool.shutdown()
    return 0


# -- decode --------------------------------------------------------------------------------

class Decode:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine, self.segment = start_engine()
        self.kv = KvCaches(self.engine, args.regions, args.blocks, args.block_bytes)
        self.lock = threading.Lock()
        self.released: Dict[int, int] = {}  # block -> the request that released it (sentinel in it)
        self.results: Dict[int, str] = {}
        self.errors: List[str] = []

    def release(self, req: int, blocks: List[int]) -> None:
        """Frees blocks and marks them, so a write landing in them later is seen."""
        sentinel = SENTINEL * self.args.block_bytes
        for b in blocks:
            for r in range(self.args.regions):
                self.kv.fill(r, b, sentinel)
        with self.lock:
            self.released.update((b, req) for b in blocks)
        self.kv.give_back(blocks)

    def take(self, n: int) -> List[int]:
        blocks = self.kv.take(n)
        with self.lock:
            for b in blocks:
                self.released.pop(b, None)
        return blocks

    def request(self, req: int, nblocks: int, abort: bool = False, bad: bool = False) -> None:
        blocks = self.take(nblocks)
        bases = list(self.kv.bases)
        if bad:  # a request naming memory the decode side never registered
            bases[0] += self.args.blocks * self.args.block_bytes * 4
        host, port = self.args.prefill.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=self.args.timeout_s) as s, s.makefile("rw") as f:
            msg = {"op": "pull", "req": req, "segment": self.segment, "bases": bases, "blocks": blocks}
            f.write(json.dumps(msg) + "\n")
            f.flush()
            started = json.loads(f.readline())
            assert started == {"req": req, "status": "started"}, started
            if abort and self.args.release_early:
                self.release(req, blocks)  # wrong: the prefill side is still writing into them
            answer = json.loads(f.readline())
            f.write(json.dumps({"op": "quit"}) + "\n")
            f.flush()
        status = "aborted" if abort else answer["status"]
        if not abort and answer["status"] == "done":
            for r in range(self.args.regions):
                for j, b in enumerate(blocks):
                    if self.kv.read(r, b) != pattern(req, r, j, self.args.block_bytes):
                        self.errors.append("request %d: region %d block %d has the wrong bytes" % (req, r, j))
                        break
        with self.lock:
            self.results[req] = status if status != "failed" else "failed(rc=%s)" % answer.get("rc")
        if not (abort and self.args.release_early):
            self.release(req, blocks)

    def check_released(self) -> None:
        sentinel = SENTINEL * self.args.block_bytes
        with self.lock:
            released = dict(self.released)
        for b, req in sorted(released.items()):
            for r in range(self.args.regions):
                if self.kv.read(r, b) != sentinel:
                    self.errors.append("block %d region %d was written after request %d released it" % (b, r, req))
                    return


def decode(args: argparse.Namespace) -> int:
    d = Decode(args)
    n = args.requests
    jobs = [(i, args.request_blocks, False, False) for i in range(n)]
    jobs.append((n, args.abort_blocks, True, False))  # aborted while its push runs
    jobs.append((n + 1, args.request_blocks, False, True))  # names memory decode never registered
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        for f in [pool.submit(d.request, *j) for j in jobs]:
            f.result()
    d.check_released()
    done = sum(1 for s in d.results.values() if s == "done")
    failed = sorted(r for r, s in d.results.items() if s.startswith("failed"))
    ok = not d.errors and done == n and failed == [n + 1] and d.results.get(n) == "aborted"
    print(json.dumps({"ok": ok, "done": done, "failed": failed, "aborted": [n], "errors": d.errors}), flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--prefill", help="decode: the prefill side's channel, host:port")
    ap.add_argument("--regions", type=int, default=8, help="layers x 2 (K and V)")
    ap.add_argument("--blocks", type=int, default=512, help="blocks per region")
    ap.add_argument("--block-bytes", type=int, default=16384)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--request-blocks", type=int, default=32)
    ap.add_argument("--abort-blocks", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--release-early", action="store_true", help="decode: free an aborted request's blocks at once (wrong)")
    ap.add_argument("--connections", type=int, default=0, help="prefill: exit after serving this many requests (0: until idle)")
    ap.add_argument("--idle-s", type=float, default=60.0, help="prefill: exit when no request came for this long")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()
    if args.role == "decode" and not args.prefill:
        ap.error("decode needs --prefill host:port")
    return prefill(args) if args.role == "prefill" else decode(args)


if __name__ == "__main__":
    sys.exit(main())
