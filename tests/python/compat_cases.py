#!/usr/bin/env python3
"""Mooncake-API behaviour cases, run against one implementation per process.

    python compat_cases.py --impl kvferry     # kvferry.mooncake.engine
    python compat_cases.py --impl mooncake    # the stock mooncake.engine (PyPI wheel)

Prints one JSON object {case: result} on stdout. A result is the call's return value
(made JSON-able) or {"raises": "<ExceptionType>"}. test_compat_parity.py runs both and
compares each against CASES' expectations; DIVERGENT lists the few places where kvferry
deliberately differs (documented in docs/PYTHON.md).

Every case here is safe for stock Mooncake (no call before initialize, no bad raw address
given to a memcpy helper: those crash Mooncake and are tested for kvferry alone).
"""

import argparse
import ctypes
import json
import mmap
import os
import sys
import time

os.environ.setdefault("MC_FORCE_TCP", "1")

HOST = "127.0.0.1"
SIZE = 1 << 20


class Env:
    """Two engines in this process: `t` (target) and `te` (initiator); `store` is the
    implementation's store module and `impl` its name (set by main())."""

    impl = "kvferry"
    store = None

    def __init__(self, mod):
        self.mod = mod
        self.t = self.new_engine()
        self.te = self.new_engine()
        self.seg = "%s:%d" % (HOST, self.t.get_rpc_port())
        self.own = "%s:%d" % (HOST, self.te.get_rpc_port())
        self.a, self.amm = self.buffer(SIZE)  # initiator's registered buffer
        self.b, self.bmm = self.buffer(SIZE)  # target's registered buffer
        assert self.te.register_memory(self.a, SIZE) == 0
        assert self.t.register_memory(self.b, SIZE) == 0

    def new_engine(self):
        te = self.mod.TransferEngine()
        ret = te.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
        assert ret == 0, ret
        return te

    @staticmethod
    def buffer(size):
        """An anonymous mapping of `size` bytes, kept alive for the whole run: (addr, mmap)."""
        mm = mmap.mmap(-1, size)
        anchor = ctypes.c_char.from_buffer(mm)
        _KEEP.append((mm, anchor))
        return ctypes.addressof(anchor), mm

    def fresh(self, size=1 << 16):
        """An unregistered buffer."""
        return self.buffer(size)


_KEEP = []


def poll(fn, until_true, timeout=3.0):
    end = time.monotonic() + timeout
    while True:
        v = fn()
        if until_true(v) or time.monotonic() > end:
            return v
        time.sleep(0.01)


def notifies_of(t):
    got = []

    def step():
        got.extend((n.name, n.msg) for n in t.get_notifies())
        return got

    return poll(step, lambda v: len(v) > 0)


# Each case: name -> (function(env) -> result, expected result for both implementations).
CASES = {}
# name -> (function, expected for kvferry, observed for stock Mooncake)
DIVERGENT = {}
# cases whose requests the target refuses (see order())
POISONS = set()
# name -> {stock release: what that release's wheel gives}, where it differs from the shared
# expectation because of how that wheel is built (not a behaviour kvferry should copy)
STOCK = {}


def case(expected, poisons=False, stock=None):
    def deco(fn):
        CASES[fn.__name__] = (fn, expected)
        if poisons:
            POISONS.add(fn.__name__)
        if stock:
            STOCK[fn.__name__] = stock
        return fn

    return deco


def expected(name, impl):
    """What case `name` must give on `impl` ("kvferry" or "mooncake-<release>")."""
    release = impl.split("-", 1)[1] if impl.startswith("mooncake-") else None
    if name in CASES:
        return STOCK.get(name, {}).get(release, CASES[name][1])
    _, kv_expected, mc_observed = DIVERGENT[name]
    return kv_expected if impl == "kvferry" else mc_observed


def divergent(kvferry_expected, mooncake_observed):
    def deco(fn):
        DIVERGENT[fn.__name__] = (fn, kvferry_expected, mooncake_observed)
        return fn

    return deco


# -- module surface ----------------------------------------------------------------------

@case([0, 1, True, True, True, "<TransferOpcode.Read: 0>", "TransferOpcode.Write"])
def opcode_enum(env):
    m = env.mod
    return [int(m.TransferOpcode.Read), int(m.Write), m.TransferEngine.TransferOpcode is m.TransferOpcode,
            m.Read is m.TransferOpcode.Read, m.Write is m.TransferOpcode.Write, repr(m.Read), str(m.Write)]


@case(["a", "b", "", ""])
def transfer_notify(env):
    n = env.mod.TransferNotify("a", "b")
    e = env.mod.TransferNotify()
    return [n.name, n.msg, e.name, e.msg]


# 0.3.14 is published only as the CUDA 13 build (mooncake-transfer-engine-cuda13), compiled with
# CUDA, EFA and intra-node NVLink; 0.3.13's non-cuda wheel, and kvferry here, claim none.
@case([False, False, False, False, False, False], stock={"0.3.14": [True, True, False, True, False, False]})
def support_flags(env):
    m = env.mod
    return [m.SUPPORT_CUDA, m.SUPPORT_EFA, m.SUPPORT_HIP, m.SUPPORT_INTRA_NVLINK, m.SUPPORT_MNNVL, m.SUPPORT_MUSA]


@case(True)
def engine_names(env):
    names = ["initialize", "initialize_ext", "get_rpc_port", "register_memory", "unregister_memory",
             "batch_register_memory", "batch_unregister_memory", "allocate_managed_buffer", "free_managed_buffer",
             "write_bytes_to_buffer", "read_bytes_from_buffer", "transfer_sync_write", "transfer_sync_read",
             "transfer_sync", "batch_transfer_sync_write", "batch_transfer_sync_read", "batch_transfer_sync",
             "batch_transfer_async_write", "batch_transfer_async_read", "batch_transfer_async",
             "get_batch_transfer_status", "transfer_submit_write", "transfer_check_status",
             "get_first_buffer_address", "get_local_topology", "get_notifies", "send_probe", "get_engine",
             "get_engine_ptr", "warmup_efa_segment"]
    missing = [n for n in names if not callable(getattr(env.mod.TransferEngine, n, None))]
    return missing or True


# The TransferEngine calls Mooncake 0.3.14 added (its engine.pyi), but the *_on_cuda ones
# (present only where SUPPORT_CUDA is). Stock 0.3.13 has none of them.
ENGINE_0_3_14 = ["batch_transfer_async_read_arrays", "batch_transfer_async_write_arrays",
                 "batch_transfer_sync_read_arrays", "batch_transfer_sync_read_pages",
                 "batch_transfer_sync_write_arrays", "batch_transfer_sync_write_pages",
                 "scatter_transfer_sync_read_with_ticket", "scatter_transfer_sync_write_with_ticket",
                 "submit_scatter_read", "submit_scatter_write"]
# cases kvferry does not pass yet, by design of the work plan (see each case); none today
PENDING_KVFERRY: set = set()


@case(True, stock={"0.3.13": ENGINE_0_3_14})
def engine_names_0_3_14(env):
    missing = [n for n in ENGINE_0_3_14 if not callable(getattr(env.mod.TransferEngine, n, None))]
    return missing or True


# -- initialize ----------------------------------------------------------------------------

@case([0, True])
def initialize_again(env):
    t = env.new_engine()
    p = t.get_rpc_port()
    r = t.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    return [r, t.get_rpc_port() > 0 and isinstance(p, int)]


@case(0)
def initialize_host_port(env):
    return env.mod.TransferEngine().initialize(HOST + ":16999", "P2PHANDSHAKE", "tcp", "")


@case(0)
def initialize_ext_p2p(env):
    return env.mod.TransferEngine().initialize_ext(HOST, "P2PHANDSHAKE", "tcp", "", "p2p")


@case(-1)
def initialize_etcd(env):
    return env.mod.TransferEngine().initialize(HOST, "etcd://127.0.0.1:1", "tcp", "")


@case({"raises": "TypeError"})
def initialize_bad_type(env):
    return env.mod.TransferEngine().initialize(HOST, "P2PHANDSHAKE", 5, "")


@case("{}\n")
def local_topology(env):
    return env.te.get_local_topology()


@case(True)
def rpc_port(env):
    p = env.te.get_rpc_port()
    return isinstance(p, int) and 0 < p < 65536


# -- registration --------------------------------------------------------------------------

@case(-1)
def register_zero_length(env):
    a, _ = env.fresh()
    return env.te.register_memory(a, 0)


@case({"raises": "TypeError"})
def register_negative_length(env):
    return env.te.register_memory(env.fresh()[0], -1)


@case({"raises": "TypeError"})
def register_length_2_64(env):
    return env.te.register_memory(env.fresh()[0], 2 ** 64)


@case({"raises": "TypeError"})
def register_str_address(env):
    return env.te.register_memory("x", 4096)


@case({"raises": "TypeError"})
def register_none_location(env):
    return env.te.register_memory(env.fresh()[0], 4096, None)


@case([0, -7])
def register_twice(env):
    a, _ = env.fresh()
    return [env.te.register_memory(a, 4096), env.te.register_memory(a, 4096)]


@case([0, -7, 0])
def register_overlap(env):
    a, _ = env.fresh()
    return [env.te.register_memory(a, 8192), env.te.register_memory(a + 4096, 8192), env.te.unregister_memory(a)]


@case([0, 0])
def register_cpu_location(env):
    a, _ = env.fresh()
    return [env.te.register_memory(a, 4096, "cpu:0"), env.te.unregister_memory(a)]


@case(-3)
def unregister_unknown(env):
    return env.te.unregister_memory(env.fresh()[0])


@case(-3)
def unregister_inside(env):
    a, _ = env.fresh()
    env.te.register_memory(a, 4096)
    r = env.te.unregister_memory(a + 8)
    env.te.unregister_memory(a)
    return r


@case(-1)
def batch_register_fewer_capacities(env):
    a, _ = env.fresh()
    return env.te.batch_register_memory([a, a + 8192], [4096])


@case([0, 0])
def batch_register_more_capacities(env):
    a, _ = env.fresh()
    return [env.te.batch_register_memory([a], [4096, 4096]), env.te.batch_unregister_memory([a])]


@case([0, 0])
def batch_register_tuple(env):
    a, _ = env.fresh()
    return [env.te.batch_register_memory((a, a + 8192), (4096, 4096)), env.te.batch_unregister_memory([a, a + 8192])]


@case(0)
def batch_register_empty(env):
    return env.te.batch_register_memory([], [])


@case(-1)
def batch_register_zero_length(env):
    a, _ = env.fresh()
    return env.te.batch_register_memory([a, a + 8192], [4096, 0])


@case(-3)
def batch_unregister_unknown(env):
    a, _ = env.fresh()
    env.te.register_memory(a, 4096)
    r = env.te.batch_unregister_memory([a + 8, a])
    env.te.unregister_memory(a)
    return r


@case({"raises": "TypeError"})
def batch_register_str_elem(env):
    return env.te.batch_register_memory(["x"], [4096])


# -- managed buffers and byte helpers -----------------------------------------------------------

@case(True)
def allocate_managed_zero(env):
    return env.te.allocate_managed_buffer(0) != 0


@case({"raises": "TypeError"})
def allocate_managed_negative(env):
    return env.te.allocate_managed_buffer(-1)


@case([True, 0, b"hello".hex(), 0, 0])
def managed_roundtrip(env):
    te = env.te
    m = te.allocate_managed_buffer(1 << 16)
    w = te.write_bytes_to_buffer(m, b"hello", 5)
    r = te.read_bytes_from_buffer(m, 5).hex()
    x = te.transfer_sync_write(env.seg, m, env.b, 5)
    return [m != 0, w, r, x, te.free_managed_buffer(m, 1 << 16)]


@case(0)
def free_managed_unknown(env):
    return env.te.free_managed_buffer(env.fresh()[0], 4096)


@case(b"hel\x00\x00".hex())
def write_bytes_shorter(env):
    a, _ = env.fresh()
    env.te.write_bytes_to_buffer(a, b"hello", 3)
    return env.te.read_bytes_from_buffer(a, 5).hex()


@case([0, b"abc".hex()])
def write_bytes_bytearray(env):
    a, _ = env.fresh()
    return [env.te.write_bytes_to_buffer(a, bytearray(b"abc"), 3), env.te.read_bytes_from_buffer(a, 3).hex()]


@case([0, b"hey".hex()])
def write_bytes_str(env):
    a, _ = env.fresh()
    return [env.te.write_bytes_to_buffer(a, "hey", 3), env.te.read_bytes_from_buffer(a, 3).hex()]


@case("")
def read_bytes_zero(env):
    return env.te.read_bytes_from_buffer(env.fresh()[0], 0).hex()


@case({"raises": "TypeError"})
def read_bytes_negative(env):
    return env.te.read_bytes_from_buffer(env.fresh()[0], -1)


# -- synchronous transfers -----------------------------------------------------------------------

def _fill(mm, off, data):
    mm[off:off + len(data)] = data


@case([0, b"hello".hex()])
def sync_write(env):
    _fill(env.amm, 0, b"hello")
    r = env.te.transfer_sync_write(env.seg, env.a, env.b, 5)
    return [r, env.bmm[0:5].hex()]


@case([0, b"world".hex()])
def sync_read(env):
    _fill(env.bmm, 100, b"world")
    r = env.te.transfer_sync_read(env.seg, env.a + 100, env.b + 100, 5)
    return [r, env.amm[100:105].hex()]


@case([0, b"ABCD".hex()])
def transfer_sync_read_opcode(env):
    _fill(env.bmm, 200, b"ABCD")
    r = env.te.transfer_sync(env.seg, env.a + 200, env.b + 200, 4, env.mod.TransferOpcode.Read)
    return [r, env.amm[200:204].hex()]


@case([0, [["x", "y"]]])
def transfer_sync_notify(env):
    env.t.get_notifies()
    r = env.te.transfer_sync(env.seg, env.a, env.b, 16, env.mod.Write, env.mod.TransferNotify("x", "y"))
    return [r, [list(n) for n in notifies_of(env.t)]]


@case([0, [["n", "m"]]])
def batch_transfer_sync_notify(env):
    env.t.get_notifies()
    r = env.te.batch_transfer_sync(env.seg, [env.a], [env.b], [16], env.mod.Write, env.mod.TransferNotify("n", "m"))
    return [r, [list(n) for n in notifies_of(env.t)]]


@case([0, b"0123456789abcdef".hex()])
def batch_sync_write(env):
    _fill(env.amm, 1000, b"0123456789abcdef")
    r = env.te.batch_transfer_sync_write(env.seg, [env.a + 1000, env.a + 1008], [env.b + 1000, env.b + 1008], [8, 8])
    return [r, env.bmm[1000:1016].hex()]


@case([0, b"fedcba9876543210".hex()])
def batch_sync_read(env):
    _fill(env.bmm, 2000, b"fedcba9876543210")
    r = env.te.batch_transfer_sync_read(env.seg, [env.a + 2000, env.a + 2008], [env.b + 2000, env.b + 2008], [8, 8])
    return [r, env.amm[2000:2016].hex()]


@case(0)
def batch_sync_opcode(env):
    return env.te.batch_transfer_sync(env.seg, [env.a], [env.b], [16], env.mod.TransferOpcode.Write)


@case(0)
def sync_zero_length(env):
    return env.te.transfer_sync_write(env.seg, env.a, env.b, 0)


@case(-1, poisons=True)
def sync_remote_outside(env):
    return env.te.transfer_sync_write(env.seg, env.a, env.b + SIZE, 16)


@case(-1, poisons=True)
def sync_remote_too_long(env):
    return env.te.transfer_sync_write(env.seg, env.a, env.b, SIZE + 1)




@case(-1, poisons=True)
def sync_length_u64_max(env):
    return env.te.transfer_sync_write(env.seg, env.a, env.b, 2 ** 64 - 1)


@case(-1)
def sync_dead_segment(env):
    return env.te.transfer_sync_write("127.0.0.1:1", env.a, env.b, 16)


@case(-1)
def sync_malformed_segment(env):
    return env.te.transfer_sync_write("nonsense", env.a, env.b, 16)


@case(-1)
def sync_empty_segment(env):
    return env.te.transfer_sync_write("", env.a, env.b, 16)


@case(0)
def sync_to_self(env):
    return env.te.transfer_sync_write(env.own, env.a, env.a + 4096, 16)


@case({"raises": "TypeError"})
def sync_float_address(env):
    return env.te.transfer_sync_write(env.seg, 1.5, env.b, 16)


@case({"raises": "TypeError"})
def sync_negative_length(env):
    return env.te.transfer_sync_write(env.seg, env.a, env.b, -1)


@case({"raises": "TypeError"})
def sync_bad_hint_type(env):
    return env.te.transfer_sync_write(env.seg, env.a, env.b, 16, 5)


@case(-1)
def batch_sync_mismatched(env):
    return env.te.batch_transfer_sync_write(env.seg, [env.a, env.a + 16], [env.b], [16, 16])


@case(0)
def batch_sync_empty(env):
    return env.te.batch_transfer_sync_write(env.seg, [], [], [])


@case(-1, poisons=True)
def batch_sync_one_bad(env):
    return env.te.batch_transfer_sync_write(env.seg, [env.a, env.a], [env.b, env.b + 2 * SIZE], [16, 16])


@case({"raises": "TypeError"})
def batch_sync_negative_length(env):
    return env.te.batch_transfer_sync_write(env.seg, [env.a], [env.b], [-1])


@case({"raises": "TypeError"})
def batch_sync_str_length(env):
    return env.te.batch_transfer_sync_write(env.seg, [env.a], [env.b], ["x"])


@case({"raises": "TypeError"})
def batch_sync_read_huge_address(env):
    return env.te.batch_transfer_sync_read(env.seg, [env.a], [1 << 64], [16])


@case({"raises": "TypeError"})
def batch_async_negative_length(env):
    return env.te.batch_transfer_async_write(env.seg, [env.a], [env.b], [-1])


@case({"raises": "TypeError"})
def batch_async_float_address(env):
    return env.te.batch_transfer_async_read(env.seg, [1.5], [env.b], [16])


# -- asynchronous transfers -------------------------------------------------------------------

@case([True, 0])
def async_write_then_status(env):
    x = env.te.batch_transfer_async_write(env.seg, [env.a], [env.b], [16])
    return [x != 0, env.te.get_batch_transfer_status([x])]


@case([True, 0, b"async".hex()])
def async_read_then_status(env):
    _fill(env.bmm, 3000, b"async")
    x = env.te.batch_transfer_async_read(env.seg, [env.a + 3000], [env.b + 3000], [5])
    return [x != 0, env.te.get_batch_transfer_status([x]), env.amm[3000:3005].hex()]


@case([True, 0])
def async_opcode_then_status(env):
    x = env.te.batch_transfer_async(env.seg, [env.a], [env.b], [16], env.mod.Read)
    return [x != 0, env.te.get_batch_transfer_status([x])]


@case(True)
def async_empty(env):
    return env.te.batch_transfer_async_write(env.seg, [], [], []) != 0


@case(0)
def async_mismatched(env):
    return env.te.batch_transfer_async_write(env.seg, [env.a, env.a + 16], [env.b], [16, 16])


@case(0)
def async_dead_segment(env):
    return env.te.batch_transfer_async_write("127.0.0.1:1", [env.a], [env.b], [16])




@case(-1, poisons=True)
def async_remote_outside(env):
    x = env.te.batch_transfer_async_write(env.seg, [env.a], [env.b + 2 * SIZE], [16])
    return env.te.get_batch_transfer_status([x])


@case(-1, poisons=True)
def async_two_batches_one_bad(env):
    x = env.te.batch_transfer_async_write(env.seg, [env.a], [env.b], [16])
    y = env.te.batch_transfer_async_write(env.seg, [env.a], [env.b + 2 * SIZE], [16])
    return env.te.get_batch_transfer_status([x, y])


@case(0)
def batch_status_empty(env):
    return env.te.get_batch_transfer_status([])


@case(1)
def submit_then_check(env):
    x = env.te.transfer_submit_write(env.seg, env.a, env.b, 16)
    return poll(lambda: env.te.transfer_check_status(x), lambda v: v != 0)


@case(1)
def submit_zero_length_then_check(env):
    x = env.te.transfer_submit_write(env.seg, env.a, env.b, 0)
    return poll(lambda: env.te.transfer_check_status(x), lambda v: v != 0)


@case(-1, poisons=True)
def submit_remote_outside_then_check(env):
    x = env.te.transfer_submit_write(env.seg, env.a, env.b + 2 * SIZE, 16)
    return poll(lambda: env.te.transfer_check_status(x), lambda v: v != 0)


@case(0)
def submit_dead_segment(env):
    return env.te.transfer_submit_write("127.0.0.1:1", env.a, env.b, 16)


@case(1)
def async_then_check(env):
    x = env.te.batch_transfer_async_read(env.seg, [env.a], [env.b], [16])
    return poll(lambda: env.te.transfer_check_status(x), lambda v: v != 0)


# -- segments, notifies, probes ------------------------------------------------------------------

@case(True)
def first_buffer_address(env):
    return env.te.get_first_buffer_address(env.seg) == env.b


@case(True)
def first_buffer_address_is_the_first_registered(env):
    """Not the lowest address: the buffer registered first (the descriptor lists buffers in
    registration order)."""
    t2 = env.new_engine()
    x, _ = env.buffer(1 << 16)
    y, _ = env.buffer(1 << 16)
    lo, hi = sorted((x, y))
    assert t2.register_memory(hi, 1 << 16) == 0
    assert t2.register_memory(lo, 1 << 16) == 0
    return env.te.get_first_buffer_address("%s:%d" % (HOST, t2.get_rpc_port())) == hi


@case(0)
def first_buffer_address_dead(env):
    return env.te.get_first_buffer_address("127.0.0.1:1")


@case(0)
def first_buffer_address_malformed(env):
    return env.te.get_first_buffer_address("bogus")


@case([])
def notifies_empty(env):
    return env.te.get_notifies()


@case(0)
def probe_alive(env):
    return env.te.send_probe(env.seg)


@case(-102)
def probe_dead(env):
    return env.te.send_probe("127.0.0.1:1")


@case(-102)
def probe_no_port(env):
    return env.te.send_probe("127.0.0.1")


@case(-101)
def probe_unresolvable(env):
    return env.te.send_probe("bogus")


@case(-101)
def probe_empty(env):
    return env.te.send_probe("")


@case(0)
def warmup_efa(env):
    return env.te.warmup_efa_segment(env.seg)


# -- mooncake.store (no master needed: these run on stock Mooncake without RDMA) ------------------

def _dict_setup(env, **over):
    d = {"local_hostname": HOST, "metadata_server": "P2PHANDSHAKE", "master_server_addr": "127.0.0.1:1",
         "global_segment_size": "16MB", "local_buffer_size": "16MB"}
    d.update(over)
    return env.store.MooncakeDistributedStore().setup(d)


@case(None)
def shim_find_spec_unprovided(env):
    """A meta-path finder answers None for modules it does not serve (kvferry under its shim)."""
    import importlib.util

    if env.impl == "kvferry":
        import kvferry

        kvferry.install_mooncake_shim()
    try:
        return importlib.util.find_spec("mooncake.kvferry_parity_absent")
    finally:
        if env.impl == "kvferry":
            kvferry.uninstall_mooncake_shim()


@case(["PRESERVE", None, 1, "", [], None, False])
def store_replicate_config_defaults(env):
    c = env.store.ReplicateConfig()
    return [c.soft_pin_action.name, c.soft_pin_ttl_ms, c.replica_num, c.preferred_segment, list(c.preferred_segments), c.group_ids, c.with_hard_pin]


@case([0, 1, 2])
def store_soft_pin_action_values(env):
    a = env.store.SoftPinAction
    return [int(a.PRESERVE), int(a.ENABLE), int(a.DISABLE)]


@case({"raises": "TypeError"})
def store_ttl_negative(env):
    env.store.ReplicateConfig().soft_pin_ttl_ms = -1


@case({"raises": "TypeError"})
def store_ttl_2_64(env):
    env.store.ReplicateConfig().soft_pin_ttl_ms = 2 ** 64


@case([5, None])
def store_ttl_set_and_cleared(env):
    c = env.store.ReplicateConfig()
    c.soft_pin_ttl_ms = 5
    got = c.soft_pin_ttl_ms
    c.soft_pin_ttl_ms = None
    return [got, c.soft_pin_ttl_ms]


@case(-600)
def store_setup_dict_percent_size(env):
    return _dict_setup(env, global_segment_size="50%")


@case(-600)
def store_setup_dict_size_below_minimum(env):
    return _dict_setup(env, global_segment_size="512")


@case(-600)
def store_setup_dict_no_hostname(env):
    return _dict_setup(env, local_hostname="")


@case({"raises": "TypeError"})
def store_setup_unknown_keyword(env):
    return env.store.MooncakeDistributedStore().setup(HOST, "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", "127.0.0.1:1", bogus_option=1)


@case(1)
def store_health_check_before_setup(env):
    return env.store.MooncakeDistributedStore().health_check()


@case(None)
def store_bind_to_numa_node(env):
    return env.store.bind_to_numa_node(0)


# -- mooncake.store against a master (kvferry master / the wheel's mooncake_master) -------------

_MASTER = {}


def _free_port():
    import socket

    with socket.socket() as so:
        so.bind((HOST, 0))
        return so.getsockname()[1]


def start_master(impl):
    """Starts a master: `kvferry master` (impl "kvferry") or the stock wheel's
    `mooncake_master` (anything else); (process, "host:port"). Also used by tensor_cases.py."""
    import socket
    import subprocess

    if impl == "kvferry":
        here = os.path.dirname(os.path.abspath(__file__))
        root = os.path.dirname(os.path.dirname(here))
        # $KVFERRY_BIN, else the installed wheel's `kvferry` command, else a source build.
        wheel_cli = os.path.join(os.path.dirname(sys.executable), "kvferry")
        cands = [os.environ.get("KVFERRY_BIN", ""), wheel_cli] + [os.path.join(root, "target", p, "kvferry") for p in ("ci", "release", "debug")]
        exe = next(c for c in cands if c and os.path.isfile(c))
        p = subprocess.Popen([exe, "master", "--port", "0", "--metrics-port", "-1", "--summary-interval", "0"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = p.stdout.readline()
        return p, next(w[4:] for w in line.split() if w.startswith("rpc="))
    import mooncake  # the programs sit in the package (mooncake.store is a package in 0.3.14)

    exe = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    port = _free_port()
    # Its own metrics port too: runs for 0.3.13 and 0.3.14 go side by side, and the default
    # (9003) would make the second master fail to start.
    p = subprocess.Popen([exe, "--rpc_port=%d" % port, "--rpc_address=%s" % HOST, "--enable_http_metadata_server=false",
                          "--metrics_port=%d" % _free_port()],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # mooncake_master announces nothing a test can read: its listening port is the event.
    end = time.monotonic() + 20
    while True:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return p, "%s:%d" % (HOST, port)
        except OSError:
            if time.monotonic() > end or p.poll() is not None:
                raise RuntimeError("mooncake_master did not start")
            time.sleep(0.05)


def _master(env):
    """Starts this implementation's master once per run; its address."""
    if "addr" not in _MASTER:
        p, addr = start_master(env.impl)
        _MASTER.update(addr=addr, proc=p)
    return _MASTER["addr"]


def stop_master():
    p = _MASTER.pop("proc", None)
    if p is not None:
        p.kill()
        p.wait(timeout=10)


class _Store:
    """A set-up MooncakeDistributedStore for one case, closed on exit."""

    def __init__(self, env):
        self.env = env

    def __enter__(self):
        self.s = self.env.store.MooncakeDistributedStore()
        rc = self.s.setup(HOST, "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", _master(self.env))
        assert rc == 0, rc
        return self.s

    def __exit__(self, *exc):
        self.s.close()


def _cbuf(n, seed=0):
    b = (ctypes.c_ubyte * n)(*[(i * 7 + seed) % 251 for i in range(n)])
    _KEEP.append(b)
    return ctypes.addressof(b), b


@case([0, "abcd", "abcd", None, ["abcd", None], [1, 0]])
def store_put_parts_get_buffer(env):
    with _Store(env) as s:
        r = [s.put_parts("pp", b"ab", bytearray(b"cd")), s.get("pp").decode()]
        h = s.get_buffer("pp")
        r += [bytes(memoryview(h)).decode(), s.get_buffer("pp-missing")]
        r.append([None if x is None else bytes(memoryview(x)).decode() for x in s.batch_get_buffer(["pp", "pp-missing"])])
        r.append(s.batch_is_exist(["pp", "pp-missing"]))
        s.remove_all(True)
        return r


@case([[-706, -704], [0], 0])
def store_batch_remove(env):
    with _Store(env) as s:
        s.put("br", b"v")
        s.get("br")  # leased now
        r = [s.batch_remove(["br", "br-missing"]), s.batch_remove(["br"], True), s.is_exist("br")]
        return r


@case([[0, 0], [300, 50, -704], True, [-600], [-600, -600], [-600], []])
def store_multi_buffers(env):
    with _Store(env) as s:
        src, sb = _cbuf(8192, 3)
        dst, db = _cbuf(8192, 0)
        assert s.register_buffer(src, 8192) == 0 and s.register_buffer(dst, 8192) == 0
        r = [s.batch_put_from_multi_buffers(["m1", "m2"], [[src, src + 4096], [src + 100]], [[100, 200], [50]])]
        r.append(s.batch_get_into_multi_buffers(["m1", "m2", "m-missing"], [[dst, dst + 1000], [dst + 3000], [dst + 5000]], [[150, 150], [50], [10]]))
        r.append(bytes(db[:100]) == bytes(sb[:100]) and bytes(db[100:150]) == bytes(sb[4096:4146])
                 and bytes(db[1000:1150]) == bytes(sb[4146:4296]) and bytes(db[3000:3050]) == bytes(sb[100:150]))
        r.append(s.batch_get_into_multi_buffers(["m1"], [[dst]], [[10]]))
        r.append(s.batch_put_from_multi_buffers(["mx", "my"], [[src]], [[10]]))
        r.append(s.batch_put_from_multi_buffers(["mx"], [[src]], [[10, 20]]))
        r.append(s.batch_put_from_multi_buffers([], [], []))
        s.remove_all(True)
        return r


@case([0, "z", [0], 7])
def store_upsert_batch_and_from(env):
    with _Store(env) as s:
        src, _ = _cbuf(64)
        assert s.register_buffer(src, 64) == 0
        r = [s.upsert_batch(["ub1"], [b"z"]), s.get("ub1").decode()]
        s.put_from("ub2", src, 20)
        r += [s.batch_upsert_from(["ub2"], [src], [7]), s.get_size("ub2")]
        s.remove_all(True)
        return r


@case([-600, -600, 0, 0])
def store_soft_pin_ttl_needs_enable(env):
    with _Store(env) as s:
        cfg = env.store.ReplicateConfig()
        cfg.soft_pin_ttl_ms = 1000
        r = [s.put("ttl1", b"x", cfg)]
        cfg.soft_pin_action = env.store.SoftPinAction.DISABLE
        r.append(s.put("ttl2", b"x", cfg))
        cfg.soft_pin_action = env.store.SoftPinAction.ENABLE
        r.append(s.put("ttl3", b"x", cfg))
        r.append(s.is_exist("ttl1"))
        s.remove_all(True)
        return r


@case([0, 0, 1])
def store_health_check_lifecycle(env):
    s = env.store.MooncakeDistributedStore()
    assert s.setup(HOST, "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", _master(env)) == 0
    return [s.health_check(), s.close(), s.health_check()]


@case([0, 0, "one", [0, 0], 0, "one"])
def store_put_existing_key(env):
    """A put of an existing key succeeds and keeps the stored value (Mooncake's Put semantics)."""
    with _Store(env) as s:
        src, _ = _cbuf(64)
        assert s.register_buffer(src, 64) == 0
        r = [s.put("pe", b"one"), s.put("pe", b"two")]
        r.append(s.get("pe").decode())
        r.append(s.batch_put_from(["pe", "pe2"], [src, src], [8, 8]))
        r.append(s.put_batch(["pe", "pe3"], [b"x", b"y"]))
        r.append(s.get("pe").decode())
        s.remove_all(True)
        return r


# -- deliberate differences ----------------------------------------------------------------------

@divergent(-1, 0)
def transfer_after_unregister(env):
    """kvferry refuses local ranges that are not registered; Mooncake's TCP path does not check."""
    a, mm = env.fresh()
    env.te.register_memory(a, 4096)
    env.te.unregister_memory(a)
    return env.te.transfer_sync_write(env.seg, a, env.b, 16)


@divergent([True, -1], [True, 0])
def async_from_unregistered(env):
    """Same for async batches."""
    a, _ = env.fresh()
    x = env.te.batch_transfer_async_write(env.seg, [a], [env.b], [16])
    return [x != 0, env.te.get_batch_transfer_status([x])]


@divergent(-1, 0)
def register_length_u64_max(env):
    """A range past the end of the address space is refused."""
    return env.te.register_memory(env.fresh()[0], 2 ** 64 - 1)


@divergent(-1, 0)
def register_unknown_location(env):
    """Location strings are validated ("*", "cpu:N", "cuda:N", ...)."""
    a, _ = env.fresh()
    r = env.te.register_memory(a, 4096, "bogus")
    env.te.unregister_memory(a)
    return r


@divergent(-1, 0)
def register_null(env):
    """Address 0 is refused."""
    r = env.te.register_memory(0, 4096)
    env.te.unregister_memory(0)
    return r


@divergent(0, {"raises": "TypeError"})
def transfer_sync_int_opcode(env):
    """kvferry also accepts 0/1 where a TransferOpcode is expected."""
    return env.te.transfer_sync(env.seg, env.a, env.b, 16, 1)


@divergent(0, {"raises": "TypeError"})
def write_bytes_memoryview(env):
    """kvferry also accepts a memoryview as src_bytes."""
    a, _ = env.fresh()
    return env.te.write_bytes_to_buffer(a, memoryview(b"ab"), 2)


def _jsonable(v):
    if isinstance(v, bytes):
        return {"bytes": v.hex()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


def order(names):
    """Cases that make the target refuse a request run last: stock Mooncake's TCP transport
    sometimes fails a later, valid request on the same connection after a refusal (they
    only expect failures themselves, so they are unaffected)."""
    return [n for n in names if n not in POISONS] + [n for n in names if n in POISONS]


def run(mod, names):
    env = Env(mod)
    out = {}
    table = dict((k, v[0]) for k, v in CASES.items())
    table.update((k, v[0]) for k, v in DIVERGENT.items())
    for name in order(names):
        t0 = time.monotonic()
        try:
            out[name] = _jsonable(table[name](env))
        except Exception as e:  # the result *is* the exception type
            out[name] = {"raises": type(e).__name__, "message": str(e)[:300]}
        if os.environ.get("KVFERRY_CASE_TIMES"):
            print("case %s: %.2f s" % (name, time.monotonic() - t0), file=sys.stderr)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["kvferry", "mooncake"], required=True)
    ap.add_argument("--cases", nargs="*", help="default: all")
    args = ap.parse_args(argv)
    # Keep stdout for the JSON: native code that prints goes to stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(out_fd, "w")
    if args.impl == "kvferry":
        import kvferry.mooncake.engine as mod
        import kvferry.mooncake.store as store
    else:
        import mooncake.engine as mod
        import mooncake.store as store
    Env.impl = args.impl
    Env.store = store
    names = args.cases or list(CASES) + list(DIVERGENT)
    try:
        result = run(mod, names)
    finally:
        stop_master()
    out.write(json.dumps(result) + "\n")
    out.flush()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (Mooncake's threads can make it slow)


if __name__ == "__main__":
    main()
