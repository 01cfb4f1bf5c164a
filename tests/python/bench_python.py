#!/usr/bin/env python3
"""Python-level benchmark: kvferry vs the stock Mooncake wheel, same run, same machine.

    .venv/py-test/bin/python tests/python/bench_python.py [--seconds S] [--mooncake-python PY]

Measures, through Mooncake's Python API (``from mooncake.engine import TransferEngine``; on
kvferry via KVFERRY_MOONCAKE_SHIM=1, so the measuring code is identical):

- throughput of ``batch_transfer_sync_write`` with 128 blocks of 64 KiB (8 MiB per call),
  each call the next 8 MiB of a 64 MiB buffer (so data comes from memory, not a warm cache);
- latency of one 4 KiB ``transfer_sync_write`` (p50 / p99 / mean).

Each row is an initiator process writing into a target process (tests/interop/
mooncake_peer.py in target mode) on 127.0.0.1. Rows: kvferry -> kvferry on the default
transport (shared memory between kvferry processes on one host) with ordinary buffers
(``mmap``: reached by cross-memory attach) and with ``allocate_managed_buffer`` buffers
(kvferry's allocator: mapped by the peer), forced TCP, Mooncake -> Mooncake (TCP,
MC_FORCE_TCP=1), and the two interop directions. The same run also measures the Rust API
underneath (``kvferry bench``, one initiator thread, batch 128 x 64 KiB writes over the same
64 MiB walk and single 4 KiB writes, per transport and memory kind), so the Python overhead
is a ratio of this run. Not a test: numbers depend on the machine; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PEER = ROOT / "tests" / "interop" / "mooncake_peer.py"
BLOCK, BLOCKS, SMALL, TINY = 64 << 10, 128, 4096, 64
SLOTS = 8  # calls walk SLOTS x 8 MiB
SIZE = BLOCK * BLOCKS * SLOTS


def measure(segment: str, remote: int, seconds: float, managed: bool) -> dict:
    """Runs in the initiator process (either implementation)."""
    sys.path.insert(0, str(PEER.parent))
    import mooncake_peer  # noqa: E402

    os.environ.setdefault("MC_FORCE_TCP", "1")
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    if managed:
        buf = mooncake_peer.Buffer(SIZE, te.allocate_managed_buffer(SIZE))
        assert buf.addr
    else:
        buf = mooncake_peer.Buffer(SIZE)
        assert te.register_memory(buf.addr, buf.size) == 0
    mooncake_peer.pattern_fill(buf.mm, 0, buf.size, 5)
    slots = []
    for k in range(SLOTS):
        base = k * BLOCK * BLOCKS
        slots.append(([buf.addr + base + i * BLOCK for i in range(BLOCKS)], [remote + base + i * BLOCK for i in range(BLOCKS)]))
    lens = [BLOCK] * BLOCKS

    for k in range(SLOTS):
        assert te.batch_transfer_sync_write(segment, slots[k][0], slots[k][1], lens) == 0
    calls, t0 = 0, time.perf_counter()
    per_call = []
    while True:
        locs, rems = slots[calls % SLOTS]
        s = time.perf_counter()
        assert te.batch_transfer_sync_write(segment, locs, rems, lens) == 0
        per_call.append(time.perf_counter() - s)
        calls += 1
        if time.perf_counter() - t0 >= seconds and calls >= 5:
            break
    elapsed = time.perf_counter() - t0
    gbps = calls * BLOCK * BLOCKS / elapsed / 1e9

    for _ in range(200):
        assert te.transfer_sync_write(segment, buf.addr, remote, SMALL) == 0
    lat = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or len(lat) < 200:
        s = time.perf_counter()
        assert te.transfer_sync_write(segment, buf.addr, remote, SMALL) == 0
        lat.append(time.perf_counter() - s)
    lat.sort()
    # Fixed cost of one batch call: 128 requests of 64 bytes (the copy is negligible).
    tiny_l, tiny_r, tiny_n = [buf.addr + i * TINY for i in range(BLOCKS)], [remote + i * TINY for i in range(BLOCKS)], [TINY] * BLOCKS
    for _ in range(50):
        assert te.batch_transfer_sync_write(segment, tiny_l, tiny_r, tiny_n) == 0
    tiny = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds / 2 or len(tiny) < 200:
        s = time.perf_counter()
        assert te.batch_transfer_sync_write(segment, tiny_l, tiny_r, tiny_n) == 0
        tiny.append(time.perf_counter() - s)
    tiny.sort()
    digest = buf.sha256()
    if managed:
        buf.mm.release()
        te.free_managed_buffer(buf.addr, buf.size)
    else:
        te.unregister_memory(buf.addr)
    return {
        "gbps": gbps,
        "batch_ms_p50": statistics.median(per_call) * 1e3,
        "calls": calls,
        "lat_us_p50": lat[len(lat) // 2] * 1e6,
        "lat_us_p99": lat[int(len(lat) * 0.99)] * 1e6,
        "lat_us_mean": statistics.fmean(lat) * 1e6,
        "lat_n": len(lat),
        "tiny_batch_us_p50": tiny[len(tiny) // 2] * 1e6,
        "sha256": digest,
    }


def _env(kvferry: bool, extra: dict) -> dict:
    env = dict(os.environ, MC_FORCE_TCP="1", PYTHONUNBUFFERED="1")
    env.pop("KVFERRY_MOONCAKE_SHIM", None)
    if kvferry:
        env["KVFERRY_MOONCAKE_SHIM"] = "1"
    env.update(extra)
    return env


def run_row(target_py: str, target_kv: bool, init_py: str, init_kv: bool, seconds: float, extra: dict, managed: bool = False) -> dict:
    target = subprocess.Popen(
        [target_py, str(PEER), "target", "--size", str(SIZE)] + (["--managed"] if managed else []),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
        env=_env(target_kv, extra),
    )
    try:
        info = json.loads(target.stdout.readline())
        r = subprocess.run(
            [init_py, __file__, "measure", "--segment", info["segment"], "--addr", str(info["addr"]), "--seconds", str(seconds)]
            + (["--managed"] if managed else []),
            capture_output=True, text=True, timeout=300, env=_env(init_kv, extra),
        )
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode != 0 or not lines:
            return {"error": (r.stderr.strip().splitlines() or ["rc=%d" % r.returncode])[-1]}
        res = json.loads(lines[-1])
        target.stdin.write("checksum 0 %d\n" % SIZE)
        target.stdin.flush()
        res["verified"] = json.loads(target.stdout.readline())["sha256"] == res["sha256"]
        return res
    finally:
        try:
            target.stdin.write("quit\n")
            target.stdin.flush()
            target.wait(timeout=10)
        except Exception:
            target.kill()
            target.wait()


def find_mooncake(explicit: str | None) -> str | None:
    for c in [explicit, os.environ.get("KVFERRY_MOONCAKE_PYTHON"), str(ROOT / ".venv" / "mooncake" / "bin" / "python"), "/tmp/mcvenv/bin/python"]:
        if c and os.path.exists(c):
            r = subprocess.run([c, "-c", "import mooncake.engine"], capture_output=True, env=_env(False, {}))
            if r.returncode == 0:
                return c
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    m = sub.add_parser("measure")
    m.add_argument("--segment", required=True)
    m.add_argument("--addr", type=int, required=True)
    m.add_argument("--seconds", type=float, default=2.0)
    m.add_argument("--managed", action="store_true")
    ap.add_argument("--seconds", type=float, default=2.0, help="per measurement (default 2)")
    ap.add_argument("--mooncake-python", help="interpreter with the stock Mooncake wheel")
    ap.add_argument("--rounds", type=int, default=3, help="alternating Python/Rust rounds for the ratio (default 3)")
    args = ap.parse_args()
    if args.cmd == "measure":
        out = os.dup(1)
        os.dup2(2, 1)  # native chatter to stderr
        res = measure(args.segment, args.addr, args.seconds, args.managed)
        os.write(out, (json.dumps(res) + "\n").encode())
        os._exit(0)

    kv = sys.executable
    mc = find_mooncake(args.mooncake_python)
    rows = [
        ("kvferry -> kvferry (auto: shm, mmap buffers)", kv, True, kv, True, {}),
        ("kvferry -> kvferry (auto: shm, managed bufs)", kv, True, kv, True, {"managed": True}),
        ("kvferry -> kvferry (KVFERRY_TRANSPORT=tcp)", kv, True, kv, True, {"KVFERRY_TRANSPORT": "tcp"}),
    ]
    if mc:
        rows += [
            ("Mooncake -> Mooncake (TCP)", mc, False, mc, False, {}),
            ("kvferry -> Mooncake (TCP)", mc, False, kv, True, {}),
            ("Mooncake -> kvferry (TCP)", kv, True, mc, False, {}),
        ]
    else:
        print("!!! stock Mooncake not found: only kvferry rows (pass --mooncake-python)", file=sys.stderr)
    print("batch_transfer_sync_write: %d x %d KiB per call; transfer_sync_write: %d B; %.1f s each; 127.0.0.1\n"
          % (BLOCKS, BLOCK >> 10, SMALL, args.seconds))
    hdr = "%-44s %10s %12s %10s %10s %10s %6s" % ("initiator -> target", "GB/s", "batch p50ms", "4K p50us", "4K p99us", "4K mean", "bytes")
    print(hdr)
    print("-" * len(hdr))
    results = {}
    for name, tpy, tkv, ipy, ikv, extra in rows:
        extra = dict(extra)
        managed = bool(extra.pop("managed", False))
        r = run_row(tpy, tkv, ipy, ikv, args.seconds, extra, managed)
        results[name] = r
        if "error" in r:
            print("%-44s error: %s" % (name, r["error"]))
            continue
        print("%-44s %10.2f %12.2f %10.1f %10.1f %10.1f %6s" % (
            name, r["gbps"], r["batch_ms_p50"], r["lat_us_p50"], r["lat_us_p99"], r["lat_us_mean"], "ok" if r["verified"] else "BAD"))
        sys.stdout.flush()
    # The Rust API underneath, same machine, same run.
    # The Rust API underneath, same machine, same run. A 2-core VM moves single runs by
    # +-20%, so Python and Rust alternate `--rounds` times and the ratio is their medians'.
    print("\nRust API (kvferry bench: one initiator thread, 128 x 64 KiB writes; single 4 KiB writes),"
          " %d alternating rounds, medians (range of the per-round ratio):" % args.rounds)
    for (transport, memory, row), extra in zip(
            (("shm", "private", rows[0][0]), ("shm", "kvferry", rows[1][0]), ("tcp", "private", rows[2][0])),
            ({}, {"managed": True}, {"KVFERRY_TRANSPORT": "tcp"})):
        pys, rusts = [results.get(row, {})], []
        for k in range(args.rounds):
            if k > 0:
                e = dict(extra)
                pys.append(run_row(kv, True, kv, True, args.seconds, e, bool(e.pop("managed", False))))
            rusts.append(rust_bench(transport, memory, args.seconds))
        bad = [r["error"] for r in pys + rusts if "error" in r]
        if bad:
            print("  %s %s: %s" % (transport, memory, bad[0]))
            continue
        med = statistics.median
        py_g, ru_g = med(r["gbps"] for r in pys), med(r["gbps"] for r in rusts)
        py_l, ru_l = med(r["lat_us_p50"] for r in pys), med(r["single_p50_us"] for r in rusts)
        py_t, ru_t = med(r["tiny_batch_us_p50"] for r in pys), med(r["tiny_batch_us_p50"] for r in rusts)
        ratios = [p["gbps"] / r["gbps"] for p, r in zip(pys, rusts)]
        print("  %-4s %-7s Rust %6.2f GB/s, 4K p50 %6.1f us | Python %6.2f GB/s (%.0f%% of Rust; rounds %.0f-%.0f%%), 4K p50 %6.1f us (%+.1f us)" % (
            transport, memory, ru_g, ru_l, py_g, 100.0 * py_g / ru_g, 100 * min(ratios), 100 * max(ratios), py_l, py_l - ru_l))
        print("  %-12s batch of %d x %d B, p50: Rust %6.1f us, Python %6.1f us: fixed Python cost %+.1f us per call"
              " = %.1f%% of a %d x %d KiB call at the Rust rate" % (
                  "", BLOCKS, TINY, ru_t, py_t, py_t - ru_t, 100.0 * (py_t - ru_t) * 1e-6 * ru_g * 1e9 / (BLOCKS * BLOCK), BLOCKS, BLOCK >> 10))
    return 0


def kvferry_binary() -> str:
    for c in (os.environ.get("KVFERRY_BIN", ""), ROOT / "target" / "release" / "kvferry"):
        if c and Path(c).is_file():
            return str(c)
    subprocess.run(["cargo", "build", "--release", "-p", "kvferry-cli"], cwd=ROOT, check=True)
    return str(ROOT / "target" / "release" / "kvferry")


def rust_bench(transport: str, memory: str, seconds: float) -> dict:
    """`kvferry bench` with the Python rows' shape; returns the 64 KiB gbps and 4 KiB single p50."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "points.jsonl"
        cmd = [kvferry_binary(), "bench", "--buffer-size", "64M", "--blocks", "64,4K,64K", "--ops", "write", "--batch", str(BLOCKS),
               "--threads", "1", "--duration", str(seconds), "--no-ceilings", "--mooncake", "none", "--transport", transport,
               # Python's buffers here are ordinary 4 KiB pages: compare like with like.
               "--hugepages", "off", "--memory", memory, "--json", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            return {"error": "kvferry bench failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]}
        pts = [json.loads(line) for line in out.read_text().splitlines()]
    by = {p["block_bytes"]: p for p in pts}
    return {"gbps": by[BLOCK]["gbps"], "single_p50_us": by[SMALL]["single_p50_us"], "tiny_batch_us_p50": by[TINY]["batch_p50_us"]}


if __name__ == "__main__":
    sys.exit(main())
