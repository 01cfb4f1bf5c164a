#!/usr/bin/env python3
"""Stock-Mooncake peer for kvferry's interop tests.

Run with the interpreter of a venv that has the PyPI Mooncake wheel installed
(``mooncake-transfer-engine-non-cuda``), e.g. ``/tmp/mcvenv/bin/python``.

Subcommands (all on 127.0.0.1, P2PHANDSHAKE metadata, TCP transport):

  target --size BYTES [--seed N] [--managed]
      Register a BYTES-long buffer filled with pattern(seed) (with --managed: one from
      allocate_managed_buffer, i.e. the engine's own allocator), print
      {"segment":"127.0.0.1:<rpc_port>","addr":<addr>,"size":BYTES}
      then answer stdin commands, one JSON line each:
        checksum OFF LEN      -> {"sha256": "<hex of buffer[OFF:OFF+LEN]>"}
        fill OFF LEN SEED     -> {"ok": true}   (pattern index counted from buffer offset 0)
        notifies              -> {"notifies": [[name, msg], ...]}   (drains get_notifies())
        initiate SEGMENT ADDR SIZE write|read BLOCK BATCH SEED
                              -> what ``initiator`` prints, moved by this same engine from a
                                 buffer of its own (one process serves both roles, so a test
                                 starts Mooncake once: slow under emulation)
        quit                  -> exit 0
      Bad commands answer {"error": "..."}. Exits 0 when stdin closes.

  initiator --segment NAME --remote-addr A --size BYTES --op write|read --block B
            [--batch K] [--seed N] [--stop-on-error]
      write: fill a local buffer with pattern(seed) and write [0,BYTES) in blocks of B
             with batch_transfer_sync_write, K requests per call (local off == remote off).
      read:  zero the local buffer, read [0,BYTES) in blocks of B with batch_transfer_sync_read.
      Prints {"ok": bool, "ret": <last nonzero return code or 0>, "sha256": "<local buffer>",
              "calls": <number of batch calls>, "secs": <seconds spent in the transfer calls>}
      Exit 0 if every call returned 0, else 1.

  probe --segment NAME
      Prints {"ret": send_probe(NAME)}; exit 0 if ret == 0, else 1.

Pattern: byte i = (i*131 + seed*7 + (i >> 12)) & 0xff.

Central metadata mode (every subcommand): ``--metadata URL --name NAME`` initializes with
that metadata server (``http://host:port/metadata``, ``etcd://host:port``, ...) and NAME as
local_hostname, which is then the segment name (target prints it as "segment");
MC_TCP_BIND_ADDRESS defaults to 127.0.0.1 so the published address is loopback. Without
``--metadata`` the peer uses P2PHANDSHAKE as before.

Environment: MC_FORCE_TCP defaults to 1 here (set before Mooncake is imported), unless
KVFERRY_PEER_PROTOCOL=rdma, which initializes Mooncake with protocol "rdma" (its RDMA transport,
every NIC it finds) for the RDMA interop check; KVFERRY_PEER_HOST replaces 127.0.0.1 as the
address it advertises. Every other variable (MC_TCP_PROTO, MC_TCP_ENABLE_CONNECTION_POOL, ...) is passed through as is.
stdout carries only the JSON lines: native code that prints to fd 1 is redirected to stderr,
where Mooncake's glog output also goes.
"""

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import sys
import time

HOST = os.environ.get("KVFERRY_PEER_HOST", "127.0.0.1")
PROTOCOL = os.environ.get("KVFERRY_PEER_PROTOCOL", "tcp")
# Mooncake's NIC filter (initialize's device_name), as a deployment passes the same one to
# every engine (SGLang's --disaggregation-ib-device): empty for every NIC.
DEVICE_NAME = os.environ.get("KVFERRY_PEER_DEVICE_NAME", "")
_BLOCK = 4096  # the pattern's (i >> 12) term changes every 4096 bytes; 4096 % 256 == 0

# ---------------------------------------------------------------------------------------
# pattern

_BASE_BLOCK = bytes((j * 131) & 0xFF for j in range(_BLOCK))
_SHIFTED = {}  # c -> _BASE_BLOCK with c added to every byte (mod 256)


def _shifted_block(c):
    blk = _SHIFTED.get(c)
    if blk is None:
        table = bytes((v + c) & 0xFF for v in range(256))
        blk = _BASE_BLOCK.translate(table)
        _SHIFTED[c] = blk
    return blk


def pattern_bytes(start, length, seed):
    """Bytes of the pattern for absolute indices [start, start + length)."""
    if length <= 0:
        return b""
    parts = []
    i = start
    end = start + length
    s7 = seed * 7
    while i < end:
        k = i >> 12
        lo = i - (k << 12)
        hi = min(_BLOCK, end - (k << 12))
        blk = _shifted_block((s7 + k) & 0xFF)
        parts.append(blk if (lo == 0 and hi == _BLOCK) else blk[lo:hi])
        i = (k << 12) + hi
    return b"".join(parts)


def pattern_fill(mm, off, length, seed, chunk=4 << 20):
    """Write pattern(seed) (absolute index = buffer offset) into mm[off:off+length]."""
    pos = off
    end = off + length
    while pos < end:
        n = min(chunk, end - pos)
        mm[pos:pos + n] = pattern_bytes(pos, n, seed)
        pos += n


# ---------------------------------------------------------------------------------------
# plumbing

def _claim_stdout():
    """Return a text stream on the real stdout; point fd 1 at stderr for native code."""
    sys.stdout.flush()
    out_fd = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(out_fd, "w", buffering=1)
    sys.stdout = sys.stderr
    return out


def _emit(out, obj):
    out.write(json.dumps(obj, separators=(",", ":")) + "\n")
    out.flush()


_META = {"server": "P2PHANDSHAKE", "name": HOST}


def _new_engine():
    if PROTOCOL == "tcp":
        os.environ.setdefault("MC_FORCE_TCP", "1")
    if _META["server"] != "P2PHANDSHAKE":
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)
    from mooncake.engine import TransferEngine  # import after the env is set

    te = TransferEngine()
    ret = te.initialize(_META["name"], _META["server"], PROTOCOL, DEVICE_NAME)
    if ret != 0:
        raise SystemExit("mooncake_peer: TransferEngine.initialize failed: %r" % (ret,))
    return te


def _segment_name(te):
    if _META["server"] != "P2PHANDSHAKE":
        return _META["name"]
    return "%s:%d" % (HOST, te.get_rpc_port())


class Buffer:
    """Page-aligned anonymous mapping with a stable address; or, given ``addr``, a view of
    memory someone else owns (e.g. from ``allocate_managed_buffer``)."""

    def __init__(self, size, addr=None):
        if size <= 0:
            raise SystemExit("mooncake_peer: --size must be > 0")
        self.size = size
        if addr is None:
            self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._anchor = ctypes.c_char.from_buffer(self.mm)
            self.addr = ctypes.addressof(self._anchor)
        else:
            self.mm = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
            self.addr = addr

    def sha256(self, off=0, length=None):
        if length is None:
            length = self.size - off
        h = hashlib.sha256()
        view = memoryview(self.mm)
        try:
            pos, end = off, off + length
            while pos < end:
                n = min(16 << 20, end - pos)
                h.update(view[pos:pos + n])
                pos += n
        finally:
            view.release()
        return h.hexdigest()

    def zero(self):
        ctypes.memset(self.addr, 0, self.size)


def _register(te, buf):
    ret = te.register_memory(buf.addr, buf.size)
    if ret != 0:
        raise SystemExit("mooncake_peer: register_memory failed: %r" % (ret,))


# ---------------------------------------------------------------------------------------
# subcommands

def cmd_target(args):
    out = _claim_stdout()
    te = _new_engine()
    if args.managed:
        addr = te.allocate_managed_buffer(args.size)
        if not addr:
            raise SystemExit("mooncake_peer: allocate_managed_buffer(%d) failed" % args.size)
        buf = Buffer(args.size, addr)
    else:
        buf = Buffer(args.size)
    pattern_fill(buf.mm, 0, buf.size, args.seed)
    if not args.managed:
        _register(te, buf)
    _emit(out, {"segment": _segment_name(te), "addr": buf.addr, "size": buf.size})

    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            op = words[0]
            if op == "quit":
                break
            elif op == "checksum":
                off, length = int(words[1]), int(words[2])
                _check_range(buf, off, length)
                _emit(out, {"sha256": buf.sha256(off, length)})
            elif op == "fill":
                off, length, seed = int(words[1]), int(words[2]), int(words[3])
                _check_range(buf, off, length)
                pattern_fill(buf.mm, off, length, seed)
                _emit(out, {"ok": True})
            elif op == "notifies":
                _emit(out, {"notifies": [[n.name, n.msg] for n in te.get_notifies()]})
            elif op == "initiate":
                if words[4] not in ("write", "read"):
                    raise ValueError("op must be write or read")
                res = _initiate(te, words[1], int(words[2], 0), int(words[3]), words[4],
                                int(words[5]), int(words[6]), int(words[7]), False)
                _emit(out, res)
            else:
                _emit(out, {"error": "unknown command %r" % op})
        except (IndexError, ValueError) as e:
            _emit(out, {"error": "bad command %r: %s" % (line.strip(), e)})
    if args.managed:
        buf.mm.release()
        te.free_managed_buffer(buf.addr, buf.size)
    else:
        te.unregister_memory(buf.addr)
    return 0


def _check_range(buf, off, length):
    if off < 0 or length < 0 or off + length > buf.size:
        raise ValueError("range [%d, %d) outside buffer of %d bytes" % (off, off + length, buf.size))


def cmd_initiator(args):
    out = _claim_stdout()
    te = _new_engine()
    res = _initiate(te, args.segment, args.remote_addr, args.size, args.op, args.block,
                    args.batch, args.seed, args.stop_on_error)
    _emit(out, res)
    return 0 if res["ok"] else 1


def _initiate(te, segment, remote_addr, size, op, block, batch, seed, stop_on_error):
    """write: pattern(seed) from a local buffer into [remote_addr, +size) in blocks of
    ``block``, ``batch`` requests per call; read: the same range into a zeroed buffer."""
    if block <= 0 or batch <= 0:
        raise SystemExit("mooncake_peer: --block and --batch must be > 0")
    buf = Buffer(size)
    if op == "write":
        pattern_fill(buf.mm, 0, buf.size, seed)
    else:
        buf.zero()
    _register(te, buf)

    fn = te.batch_transfer_sync_write if op == "write" else te.batch_transfer_sync_read
    offs = list(range(0, buf.size, block))
    last_bad = 0
    calls = 0
    error = None
    t0 = time.perf_counter()
    for i in range(0, len(offs), batch):
        group = offs[i:i + batch]
        lens = [min(block, buf.size - o) for o in group]
        try:
            ret = fn(segment, [buf.addr + o for o in group],
                     [remote_addr + o for o in group], lens)
        except Exception as e:  # e.g. RuntimeError on a malformed peer descriptor
            ret, error = -1, "%s: %s" % (type(e).__name__, e)
        calls += 1
        if ret != 0:
            last_bad = ret
            if stop_on_error or error is not None:
                break
    secs = time.perf_counter() - t0
    res = {"ok": last_bad == 0, "ret": last_bad, "sha256": buf.sha256(),
           "calls": calls, "secs": round(secs, 6)}
    if error is not None:
        res["error"] = error
    te.unregister_memory(buf.addr)
    return res


def cmd_probe(args):
    out = _claim_stdout()
    te = _new_engine()
    ret = te.send_probe(args.segment)
    _emit(out, {"ret": ret})
    return 0 if ret == 0 else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description="stock-Mooncake peer for kvferry interop tests")
    sub = ap.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("target")
    t.add_argument("--size", type=int, required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--managed", action="store_true", help="buffer from allocate_managed_buffer")

    i = sub.add_parser("initiator")
    i.add_argument("--segment", required=True)
    i.add_argument("--remote-addr", type=lambda s: int(s, 0), required=True)
    i.add_argument("--size", type=int, required=True)
    i.add_argument("--op", choices=["write", "read"], required=True)
    i.add_argument("--block", type=int, required=True)
    i.add_argument("--batch", type=int, default=1)
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--stop-on-error", action="store_true")

    p = sub.add_parser("probe")
    p.add_argument("--segment", required=True)

    for sp in (t, i, p):
        sp.add_argument("--metadata", default="P2PHANDSHAKE",
                        help="metadata server (default P2PHANDSHAKE)")
        sp.add_argument("--name", default=None,
                        help="local_hostname = segment name in central metadata mode")

    args = ap.parse_args(argv)
    _META["server"] = args.metadata
    if args.metadata != "P2PHANDSHAKE":
        if not args.name:
            ap.error("--metadata needs --name (the segment name in central mode)")
        _META["name"] = args.name
    try:
        if args.cmd == "target":
            return cmd_target(args)
        if args.cmd == "initiator":
            return cmd_initiator(args)
        return cmd_probe(args)
    except BrokenPipeError:  # whoever reads our stdout went away
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
