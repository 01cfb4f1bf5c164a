#!/usr/bin/env python3
"""Mooncake 0.3.14's tensor calls, run against one implementation per process.

    python tensor_cases.py kvferry OUTDIR        # kvferry.mooncake.store on `kvferry master`
    python tensor_cases.py stock OUTDIR          # the stock 0.3.14 wheel on its mooncake_master
    python tensor_cases.py kvferry OUTDIR read INDIR   # store the other side's raw objects, read them

Prints one JSON object {case: result} on stdout; writes each stored object's raw bytes (what
``get(key)`` returns) to OUTDIR/<n>.bin so the other implementation can be handed them
(``read`` mode: ``put(key, raw)`` then ``get_tensor``). test_tensor.py runs both and compares.
A tensor is described as [dtype, shape, sha256 of its bytes]."""

import ctypes
import hashlib
import json
import os
import sys

os.environ.setdefault("MC_FORCE_TCP", "1")
import torch  # noqa: E402

IMPL, OUT = sys.argv[1], sys.argv[2]
if IMPL == "stock":
    import mooncake.store as ms
else:
    import kvferry.mooncake.store as ms

HOST = "127.0.0.1"


def start_master():
    from compat_cases import start_master as start

    return start("kvferry" if IMPL == "kvferry" else "mooncake")


def sha(b):
    return hashlib.sha256(bytes(b)).hexdigest()[:16]


def raw_bytes(t):
    """A tensor's bytes (any dtype) without numpy."""
    t = t.contiguous()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def desc(t):
    if t is None or isinstance(t, int):
        return t
    return [str(t.dtype), list(t.shape), sha(raw_bytes(t))]


def tensors():
    a = torch.arange(24, dtype=torch.int64)
    out = {
        "f32_2d": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 3,
        "f64": torch.arange(5, dtype=torch.float64) * 1.5,
        "i8": (a[:7] - 3).to(torch.int8),
        "u8": a[:9].to(torch.uint8),
        "i16": (a[:6] * -300).to(torch.int16),
        "u16": (a[:6] * 3000).to(torch.uint16),
        "i32": (a * -70000).to(torch.int32).reshape(2, 3, 4),
        "u32": (a[:4] * 100000).to(torch.uint32),
        "i64": a.reshape(4, 6) * -(1 << 40),
        "u64": a[:3].to(torch.uint64),
        "bool": (a % 3 == 0).reshape(2, 12),
        "f16": (torch.arange(8, dtype=torch.float32) / 7).to(torch.float16),
        "bf16": (torch.arange(8, dtype=torch.float32) / 7).to(torch.bfloat16).reshape(2, 2, 2),
        "f8e4m3": (torch.arange(6, dtype=torch.float32) / 5).to(torch.float8_e4m3fn),
        "f8e5m2": (torch.arange(6, dtype=torch.float32) / 5).to(torch.float8_e5m2),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 5),
        "dims8": torch.arange(16, dtype=torch.float32).reshape(1, 2, 1, 2, 1, 2, 1, 2),
        "noncontig": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
    }
    return out


BAD = {"dims9": lambda: torch.zeros([1] * 9), "complex": lambda: torch.zeros(2, dtype=torch.complex64),
       "not_tensor": lambda: b"bytes", "none": lambda: None}

res = {}
files = 0


def keep(name, raw):
    """Writes a stored object's raw bytes for the other implementation's `read` run."""
    global files
    with open(os.path.join(OUT, "%s.bin" % name), "wb") as f:
        f.write(bytes(raw))
    files += 1


def stored(s, key):
    raw = s.get(key)
    return [len(raw), bytes(raw[:304]).hex(), sha(raw[304:])] if raw else raw.hex()


def run(name, f):
    try:
        res[name] = f()
    except Exception as e:  # noqa: BLE001 - the type is the result
        res[name] = {"raises": type(e).__name__}


# -- the serializer of mooncake.store (no master) ---------------------------------------------
for n, t in tensors().items():
    def ser(t=t):
        h, ptr, nbytes, owner = ms._serialize_tensor(t)
        obj = bytes(h) + raw_bytes(owner)
        back = ms._deserialize_tensor(obj)
        return [bytes(h).hex(), nbytes, owner.is_contiguous(), desc(back)]
    run("ser_" + n, ser)
for n, f in BAD.items():
    run("ser_" + n, lambda f=f: ms._serialize_tensor(f()))
run("meta_size", ms._tensor_metadata_size)
run("deser_short", lambda: ms._deserialize_tensor(b"x" * 10))
run("deser_bad_magic", lambda: ms._deserialize_tensor(b"\0" * 400))

proc, addr = start_master()
try:
    s = ms.MooncakeDistributedStore()
    assert s.setup(HOST, "P2PHANDSHAKE", 64 << 20, 64 << 20, "tcp", "", addr) == 0
    if len(sys.argv) > 3 and sys.argv[3] == "read":
        # The other implementation's objects, stored as raw bytes here and read as tensors.
        src = sys.argv[4]
        for f in sorted(os.listdir(src)):
            key = "x/" + f[:-4]
            with open(os.path.join(src, f), "rb") as fh:
                assert s.put(key, fh.read()) == 0
            res[f[:-4]] = desc(s.get_tensor(key))
        print(json.dumps(res, sort_keys=True))
        sys.exit(0)

    ts = tensors()
    for n, t in ts.items():
        run("put_" + n, lambda n=n, t=t: [s.put_tensor("t/" + n, t), stored(s, "t/" + n), desc(s.get_tensor("t/" + n))])
        keep("t_" + n, s.get("t/" + n))
    for n, f in BAD.items():
        run("put_bad_" + n, lambda f=f: s.put_tensor("bad", f()))
    run("batch_put", lambda: s.batch_put_tensor(["b/0", "b/1", "b/2"], [ts["f32_2d"], torch.zeros(2, dtype=torch.complex64), ts["i8"]]))
    run("batch_put_mismatch", lambda: s.batch_put_tensor(["b/x", "b/y"], [ts["f32_2d"]]))
    run("batch_put_empty", lambda: s.batch_put_tensor([], []))
    run("batch_get", lambda: [desc(x) for x in s.batch_get_tensor(["b/0", "b/1", "b/2", "missing"])])
    run("get_missing", lambda: desc(s.get_tensor("missing")))
    run("put_existing", lambda: [s.put_tensor("t/f64", ts["i8"]), desc(s.get_tensor("t/f64"))])
    run("upsert", lambda: [s.upsert_tensor("t/f64", ts["i8"]), desc(s.get_tensor("t/f64")), s.upsert_tensor("u/new", ts["u8"]), desc(s.get_tensor("u/new"))])
    run("batch_upsert", lambda: [s.batch_upsert_tensor(["t/u8", "u/b"], [ts["bool"], ts["f16"]]), desc(s.get_tensor("t/u8")), desc(s.get_tensor("u/b"))])
    rc1 = ms.ReplicateConfig()
    rc1.replica_num = 1
    bad_cfg = ms.ReplicateConfig()
    bad_cfg.replica_num = 1
    bad_cfg.preferred_segments = ["a", "b"]
    run("pub", lambda: [s.pub_tensor("p/0", ts["i16"], rc1), desc(s.get_tensor("p/0")), s.pub_tensor("p/1", ts["i16"], bad_cfg)])
    run("upsert_pub", lambda: [s.upsert_pub_tensor("p/0", ts["u16"], rc1), desc(s.get_tensor("p/0")), s.upsert_pub_tensor("p/2", ts["u16"], bad_cfg)])
    run("batch_pub", lambda: [s.batch_pub_tensor(["p/3", "p/4"], [ts["i32"], ts["u32"]], rc1), s.batch_pub_tensor(["p/5"], [ts["i32"]], bad_cfg)])
    run("batch_upsert_pub", lambda: [s.batch_upsert_pub_tensor(["p/3", "p/6"], [ts["u32"], ts["i64"]], rc1), desc(s.get_tensor("p/3"))])

    # tensor parallelism: shards key_tp_<rank>
    m = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    run("tp_put", lambda: [s.put_tensor_with_tp("tp", m, 0, 2, 1), stored(s, "tp_tp_0"), stored(s, "tp_tp_1"), s.is_exist("tp")])
    keep("tp_tp_0", s.get("tp_tp_0"))
    keep("tp_tp_1", s.get("tp_tp_1"))
    run("tp_put_rows", lambda: [s.put_tensor_with_tp("tpr", m, 1, 4, 0), [stored(s, "tpr_tp_%d" % r) for r in range(4)]])
    run("tp_get", lambda: [desc(s.get_tensor_with_tp("tp", 1, 2)), desc(s.get_tensor_with_tp("tp", 0, 1)), [desc(x) for x in s.batch_get_tensor_with_tp(["tp", "tpr"], 0, 2)]])
    run("tp_size1", lambda: [s.put_tensor_with_tp("tp1", m, 0, 1, 0), stored(s, "tp1"), s.is_exist("tp1_tp_0")])
    run("tp_uneven", lambda: s.put_tensor_with_tp("tpu", torch.zeros(3, 2), 0, 2, 0))
    run("tp_bad_dim", lambda: [s.put_tensor_with_tp("tpd", m, 0, 2, -1), s.put_tensor_with_tp("tpd", m, 0, 2, 2)])
    run("tp_batch", lambda: [s.batch_put_tensor_with_tp(["bt0", "bt1", "bt2"], [m, torch.zeros(3), m.t()], 0, 2, 0), stored(s, "bt2_tp_1")])
    run("tp_pub", lambda: [s.pub_tensor_with_tp("ptp", m, rc1, 0, 3, 1), stored(s, "ptp_tp_2"), s.batch_pub_tensor_with_tp(["ptp2"], [m], rc1, 0, 2, 0)])
    run("tp_non_tensor", lambda: s.put_tensor_with_tp("tpn", b"xy", 0, 2, 0))

    # zero-copy: registered buffers holding [header][bytes]
    SIZE = 1 << 16
    buf = (ctypes.c_ubyte * SIZE)()
    ptr = ctypes.addressof(buf)
    assert s.register_buffer(ptr, SIZE) == 0
    def into():
        t = s.get_tensor_into("t/f32_2d", ptr, SIZE)
        aliased = t is not None and t.data_ptr() == ptr + 304
        return [desc(t), aliased, bytes(buf[:304]).hex()]
    run("get_into", into)
    run("get_into_small", lambda: desc(s.get_tensor_into("t/f32_2d", ptr, 100)))
    run("get_into_missing", lambda: desc(s.get_tensor_into("missing", ptr, SIZE)))
    run("get_into_null", lambda: desc(s.get_tensor_into("t/f32_2d", 0, SIZE)))
    def frm():
        n = 304 + 48
        s.get_tensor_into("t/f32_2d", ptr, SIZE)
        r = [s.put_tensor_from("f/0", ptr, n), stored(s, "f/0"), s.upsert_tensor_from("f/0", ptr, n)]
        r += [s.put_tensor_from("f/1", ptr, 100), s.put_tensor_from("f/2", ptr, n + 4), s.put_tensor_from("f/3", 0, n)]
        r.append(s.batch_put_tensor_from(["f/4", "f/5"], [ptr, ptr], [n, n]))
        r.append(s.batch_put_tensor_from(["f/6", "f/7"], [ptr, ptr], [n, 20]))
        r.append(s.batch_put_tensor_from([], [], []))
        r.append(s.batch_upsert_tensor_from(["f/4"], [ptr], [n]))
        r.append(s.batch_put_tensor_from(["f/8"], [ptr, ptr], [n]))
        r.append([s.put_tensor_with_tp_from("ft", ptr, n, 0, 2, 0), stored(s, "ft_tp_1")])
        r.append([s.batch_put_tensor_with_tp_from(["fb0", "fb1"], [ptr, 0], [n, n], 0, 2, 1), stored(s, "fb0_tp_0")])
        return r
    run("from", frm)
    def batch_into():
        half = SIZE // 2
        ts2 = s.batch_get_tensor_into(["t/i32", "missing", "t/bf16"], [ptr, ptr + half, ptr + half], [half, half, half])
        return [desc(x) for x in ts2] + [s.batch_get_tensor_into(["t/i32"], [ptr, ptr], [half]), s.batch_get_tensor_into(["t/i32"], [0], [half])]
    run("batch_into", batch_into)
    run("tp_into", lambda: [desc(s.get_tensor_with_tp_into("tp", ptr, SIZE, 1, 2)), [desc(x) for x in s.batch_get_tensor_with_tp_into(["tp", "tpr"], [ptr, ptr + 4096], [4096, 4096], 1, 2)]])
    run("into_cuda", lambda: [s.get_tensor_into_cuda("t/f32_2d", torch.zeros(3, 4)), s.batch_get_tensor_into_cuda(["t/f32_2d", "x"], [torch.zeros(3, 4), torch.zeros(1)])])

    # safetensors
    def safet():
        path = os.path.join(OUT, "st.safetensors")
        r = [s.save_tensor_to_safetensor("t/bf16", path)]
        with open(path, "rb") as f:
            r.append(sha(f.read()))
        r.append(s.save_tensor_to_safetensor("missing", os.path.join(OUT, "none.safetensors")))
        r.append(desc(s.load_tensor_from_safetensor("l/0", path)))
        r.append(desc(s.get_tensor("l/0")))
        r.append(desc(s.load_tensor_from_safetensor("t/bf16", path)))
        r.append(desc(s.load_tensor_from_safetensor(None, os.path.join(OUT, "absent.safetensors"))))
        os.unlink(path)
        return r
    run("safetensors", safet)
    s.unregister_buffer(ptr)
    s.close()
finally:
    proc.kill()
    proc.wait(timeout=10)
print(json.dumps(res, sort_keys=True))
