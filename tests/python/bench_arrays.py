#!/usr/bin/env python3
"""Descriptors per second through Mooncake 0.3.14's ``*_arrays`` and ``*_pages`` calls on
kvferry (issue 46's goal: >= 5 M descriptors/s per core over shared memory).

    KVFERRY_TRANSPORT=shm .venv/py-test/bin/python tests/python/bench_arrays.py [--descriptors N] [--size B] [--rounds R]

One process, two engines (initiator and target); the request is N descriptors of B bytes
(default 81,920 x 4 KiB: a Llama-3-70B TP-8 rank at 8K tokens), its blocks scattered on both
sides by a seeded permutation (nothing coalesces), plus a contiguous run of the same shape
(everything coalesces). Reports, per call, wall time per request, descriptors per wall second
and per CPU second of this process (all its threads: "per core"), and GB/s. Not a test.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kvferry.mooncake.engine import TransferEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--descriptors", type=int, default=81920)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n, size = args.descriptors, args.size
    total = n * size
    a, b = TransferEngine(), TransferEngine()
    for e in (a, b):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src = a.allocate_managed_buffer(total)
    dst = b.allocate_managed_buffer(total)
    seg = "127.0.0.1:%d" % b.get_rpc_port()
    rng = np.random.default_rng(46)
    lp = rng.permutation(n).astype(np.uint64)
    rp = rng.permutation(n).astype(np.uint64)
    seq = np.arange(n, dtype=np.uint64)
    shapes = {
        "scattered": (src + lp * size, dst + rp * size, lp, rp),
        "contiguous": (src + seq * size, dst + seq * size, seq, seq),
    }
    lengths = np.full(n, size, dtype=np.uint64)
    print("transport: %s; %d descriptors x %d B per request, %d rounds (best shown)"
          % (os.environ.get("KVFERRY_TRANSPORT", "auto"), n, size, args.rounds))
    print("%-34s %-10s %10s %12s %12s %8s" % ("call", "shape", "ms/req", "Mdesc/s", "Mdesc/cpu-s", "GB/s"))
    for shape, (l, r, sp, dp) in shapes.items():
        fields = np.array([[src, size, dst, size, size]], dtype=np.uint64)
        calls = {
            "batch_transfer_sync_write_arrays": lambda: a.batch_transfer_sync_write_arrays(seg, l, r, lengths),
            "batch_transfer_sync_read_arrays": lambda: a.batch_transfer_sync_read_arrays(seg, l, r, lengths),
            "batch_transfer_sync_write_pages": lambda: a.batch_transfer_sync_write_pages(seg, sp, dp, fields),
            "batch_transfer_sync_read_pages": lambda: a.batch_transfer_sync_read_pages(seg, sp, dp, fields),
            "batch_transfer_sync_write (list)": lambda: a.batch_transfer_sync_write(seg, l.tolist(), r.tolist(), lengths.tolist()),
        }
        for name, call in calls.items():
            best = None
            for _ in range(args.rounds):
                w0, c0 = time.perf_counter(), time.process_time()
                assert call() == 0, name
                w, c = time.perf_counter() - w0, time.process_time() - c0
                if best is None or w < best[0]:
                    best = (w, c)
            w, c = best
            print("%-34s %-10s %10.2f %12.2f %12.2f %8.2f" % (name, shape, w * 1e3, n / w / 1e6, n / max(c, 1e-9) / 1e6, total / w / 1e9))


if __name__ == "__main__":
    main()
