#!/usr/bin/env python3
"""What the cluster key (KVFERRY_AUTH_KEY_FILE) costs the engine, with and without it in one run.

    .venv/py-test/bin/python tests/python/bench_auth.py [--pairs N] [--writes N] [--rounds N]

Two kvferry.Engine in this process over TCP (KVFERRY_TRANSPORT=tcp), rounds alternating no key
and a key. Per round, medians over N fresh pairs of engines: the first ``segment_buffers``
(one handshake), the first 4 KiB write (a new data connection), and then p50 / p99 of N
4 KiB writes on the proved connections. Not a test: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def one_round(kv, pairs: int, writes: int) -> tuple[float, float, float, float]:
    opens, firsts = [], []
    for _ in range(pairs):
        a, b = kv.Engine("127.0.0.1"), kv.Engine("127.0.0.1")
        try:
            src, dst = bytearray(4096), bytearray(4096)
            a.register_memory(src)
            b.register_memory(dst)
            t0 = time.perf_counter()
            remote = a.segment_buffers(b.segment_name)[0].addr
            t1 = time.perf_counter()
            a.write(b.segment_name, src, remote)
            t2 = time.perf_counter()
            opens.append((t1 - t0) * 1e6)
            firsts.append((t2 - t1) * 1e6)
        finally:
            a.close()
            b.close()
    a, b = kv.Engine("127.0.0.1"), kv.Engine("127.0.0.1")
    try:
        src, dst = bytearray(4096), bytearray(4096)
        a.register_memory(src)
        b.register_memory(dst)
        remote = a.segment_buffers(b.segment_name)[0].addr
        for _ in range(50):
            a.write(b.segment_name, src, remote)
        lat = []
        for _ in range(writes):
            t = time.perf_counter()
            a.write(b.segment_name, src, remote)
            lat.append((time.perf_counter() - t) * 1e6)
    finally:
        a.close()
        b.close()
    lat.sort()
    return statistics.median(opens), statistics.median(firsts), lat[len(lat) // 2], lat[int(len(lat) * 0.99)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--writes", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    os.environ["KVFERRY_TRANSPORT"] = "tcp"
    import kvferry as kv

    with tempfile.NamedTemporaryFile("w", suffix=".key") as key:
        key.write(os.urandom(32).hex() + "\n")
        key.flush()
        print(f"{'key':<5} {'handshake us':>13} {'first write us':>15} {'4K write p50 us':>16} {'p99 us':>8}")
        for _ in range(args.rounds):
            for keyed in (False, True):
                if keyed:
                    os.environ["KVFERRY_AUTH_KEY_FILE"] = key.name
                else:
                    os.environ.pop("KVFERRY_AUTH_KEY_FILE", None)
                o, f, p50, p99 = one_round(kv, args.pairs, args.writes)
                print(f"{'yes' if keyed else 'no':<5} {o:>13.0f} {f:>15.0f} {p50:>16.1f} {p99:>8.1f}")
        os.environ.pop("KVFERRY_AUTH_KEY_FILE", None)


if __name__ == "__main__":
    main()
