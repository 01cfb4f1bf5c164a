#!/usr/bin/env python3
"""Mooncake 0.3.14's new MooncakeDistributedStore calls and types, run against one
implementation per process, each against its own master (compat_cases._master: `kvferry
master`, or the wheel's `mooncake_master`).

    python store314_cases.py kvferry     # kvferry.mooncake.store
    python store314_cases.py mooncake    # the stock 0.3.14 wheel (mooncake-transfer-engine-cuda13)

Prints one JSON object {case: result} on stdout: the calls' return values and bytes read
(or {"raises": type, "msg": first line}). test_store314.py runs both and compares them;
DIVERGENT there lists the deliberate differences. Every case uses keys of its own and
removes them (force) at its end: a key leased by one case does not hold up another.
"""

import ctypes
import json
import os
import sys
import time

os.environ.setdefault("MC_FORCE_TCP", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compat_cases  # noqa: E402 - its master launcher

if sys.argv[1] == "mooncake":
    import mooncake.store as m
else:
    import kvferry.mooncake.store as m

HOST = "127.0.0.1"
IMPL = sys.argv[1]
_KEEP = []


class _Env:
    impl = IMPL


def master():
    return compat_cases._master(_Env)


def store(**kw):
    s = m.MooncakeDistributedStore()
    rc = s.setup(HOST, "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", kw.pop("addr", None) or master(), **kw)
    assert rc == 0, rc
    return s


def cbuf(n, seed=0):
    b = (ctypes.c_ubyte * n)(*[(i * 7 + seed) % 251 for i in range(n)])
    _KEEP.append(b)
    return ctypes.addressof(b), b


def cfg(**kw):
    c = m.ReplicateConfig()
    for k, v in kw.items():
        setattr(c, k, v)
    return c


CASES = {}


def case(f):
    CASES[f.__name__] = f
    return f


# -- types (no master) -------------------------------------------------------------------------

@case
def exist_options(_):
    o = m.ExistOptions()
    r = [o.prefetch_to_memory]
    o.prefetch_to_memory = True
    return r + [o.prefetch_to_memory]


@case
def exist_options_numbers(_):
    o = m.ExistOptions()
    o.prefetch_to_memory = 1
    r = [o.prefetch_to_memory]
    o.prefetch_to_memory = None
    return r + [o.prefetch_to_memory]


@case
def exist_options_not_bool(_):
    m.ExistOptions().prefetch_to_memory = "yes"


@case
def replicate_config_new_fields(_):
    c = m.ReplicateConfig()
    r = [c.preferred_hca_names, c.per_key_preferred_hca_names, c.residency_affinity_ids, c.session_ids]
    c.preferred_hca_names, c.per_key_preferred_hca_names = ["mlx5_0"], [["mlx5_0"], []]
    c.residency_affinity_ids, c.session_ids = ["a", "b"], ["s"]
    r.append([c.preferred_hca_names, c.per_key_preferred_hca_names, c.residency_affinity_ids, c.session_ids])
    c.session_ids = None
    return r + [c.session_ids]


@case
def replicate_config_hca_not_a_list(_):
    m.ReplicateConfig().preferred_hca_names = "mlx5_0"


@case
def replicate_config_affinity_not_str(_):
    m.ReplicateConfig().residency_affinity_ids = [1]


@case
def replicate_config_per_key_hca_flat(_):
    m.ReplicateConfig().per_key_preferred_hca_names = ["mlx5_0"]


@case
def ranged_snapshot_no_constructor(_):
    m.RangedReadSnapshot()


@case
def host_mem_allocator(_):
    a, b = m.MooncakeHostMemAllocator(), m.MooncakeHostMemAllocator()
    p = a.alloc(4096)
    ctypes.memset(p, 7, 4096)
    r = [p % 4096, ctypes.string_at(p + 4092, 4).hex(), b.free(p), a.free(p), a.free(12345)]
    q = a.alloc(1 << 20)
    return r + [q % 4096, ctypes.string_at(q, 4).hex(), a.free(q)]


@case
def host_mem_allocator_zero(_):
    m.MooncakeHostMemAllocator().alloc(0)


@case
def module_names(_):
    return [n in dir(m) for n in ("ExistOptions", "RangedReadSnapshot", "MooncakeHostMemAllocator")]


# -- against a master ----------------------------------------------------------------------------

@case
def probe_grants_no_lease(s):
    r = [s.put("pr1", b"hello"), s.probe_key("pr1"), s.probe_key("pr-missing"), s.remove("pr1")]
    r += [s.put("pr1", b"hello"), s.is_exist("pr1"), s.remove("pr1")]
    return r


@case
def probe_empty_key(s):
    return [s.probe_key(""), s.is_exist(""), s.batch_probe_key(["", "pe-missing"]), s.batch_is_exist([""])]


@case
def batch_probe_none(s):
    s.put("bp1", b"x"), s.put("bp2", b"y")
    return [s.batch_probe_key(["bp1", "bp2", "bp3"]), s.batch_probe_key(["bp1", "bp3"], "none", 0), s.remove("bp1"), s.remove("bp2"), s.batch_probe_key([])]


@case
def batch_probe_last_hit_only(s):
    s.put("bl1", b"x"), s.put("bl2", b"y")
    return [s.batch_probe_key(["bl1", "bl2", "bl3"], "LastHitOnly", 1), s.remove("bl1"), s.remove("bl2")]


@case
def batch_probe_last_hit_only_groups(s):
    s.put("bg1", b"x"), s.put("bg2", b"y"), s.put("bg3", b"z")
    r = [s.batch_probe_key(["bg1", "bg2", "bg3", "bg4"], "LastHitOnly", 2), s.remove("bg1"), s.remove("bg2"), s.remove("bg3")]
    r.append(s.batch_probe_key(["bg4", "bg3", "bg5", "bg6"], "LastHitOnly", 2))
    return r + [s.remove("bg3")]


@case
def batch_probe_bad_candidate_size(s):
    s.put("bc1", b"x")
    return [s.batch_probe_key(["bc1", "bc2", "bc3"], "LastHitOnly", 2), s.batch_probe_key(["bc1"], "LastHitOnly", 0), s.remove("bc1")]


@case
def batch_probe_unknown_policy(s):
    return s.batch_probe_key(["x"], "lasthitonly")


@case
def is_exist_with_options(s):
    o = m.ExistOptions()
    s.put("eo1", b"x")
    r = [s.is_exist("eo1", o), s.batch_is_exist(["eo1", "eo2"], options=o)]
    o.prefetch_to_memory = True
    return r + [s.is_exist("eo2", o), s.batch_is_exist(["eo1"], o)]


@case
def per_key_config_counts(s):
    src, _ = cbuf(64)
    assert s.register_buffer(src, 64) == 0
    out = {}
    for name, c in [("aff1", cfg(residency_affinity_ids=["x"])), ("aff2", cfg(residency_affinity_ids=["x", "y"])),
                    ("ses1", cfg(session_ids=["s"])), ("ses2", cfg(session_ids=["s", "t"])),
                    ("hca1", cfg(per_key_preferred_hca_names=[["mlx5_0"]])), ("hca2", cfg(per_key_preferred_hca_names=[["mlx5_0"], []])),
                    ("grp1", cfg(group_ids=["g"])), ("grp2", cfg(group_ids=["g", "g"])), ("grp0", cfg(group_ids=[])),
                    ("phca", cfg(preferred_hca_names=["mlx5_9"]))]:
        out[name] = [s.put_batch([name + "a", name + "b"], [b"1", b"2"], c), s.batch_put_from([name + "c", name + "d"], [src, src], [10, 10], c),
                     s.put(name + "e", b"1", c), s.put_from(name + "f", src, 10, c), s.upsert(name + "u", b"1", c),
                     s.batch_put_from_multi_buffers([name + "g", name + "h"], [[src], [src]], [[5], [5]], c), s.put_parts(name + "p", b"a", config=c)]
    return out


@case
def setup_embedded_master(_):
    s = m.MooncakeDistributedStore()
    # master_server_addr is unused: the embedded master listens where the kernel says.
    r = [s.setup(HOST, "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", "127.0.0.1:1", enable_embedded_master=True)]
    r += [s.put("em1", b"embedded"), s.get("em1").decode(), s.probe_key("em1"), s.close()]
    return r


@case
def setup_dict_embedded_master(_):
    s = m.MooncakeDistributedStore()
    d = {"local_hostname": HOST, "metadata_server": "P2PHANDSHAKE", "master_server_addr": "127.0.0.1:1",
         "global_segment_size": "16MB", "local_buffer_size": "16MB", "enable_embedded_master": "true"}
    return [s.setup(d), s.put("em2", b"x"), s.get("em2").decode(), s.close()]


@case
def setup_embedded_master_false(_):
    s = m.MooncakeDistributedStore()
    return [s.setup(HOST, "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master(), enable_embedded_master=False), s.close()]


@case
def setup_dict_known_keys(_):
    s = m.MooncakeDistributedStore()
    d = {"local_hostname": HOST, "metadata_server": "P2PHANDSHAKE", "master_server_addr": master(), "global_segment_size": "16MB",
         "local_buffer_size": "16MB", "ipc_socket_path": "/tmp/kvferry-absent.sock", "enable_ssd_prefetch": "false", "client_http_port": "9301"}
    return [s.setup(d), s.close()]


@case
def setup_dict_unknown_key(_):
    s = m.MooncakeDistributedStore()
    d = {"local_hostname": HOST, "metadata_server": "P2PHANDSHAKE", "master_server_addr": master(), "global_segment_size": "16MB",
         "local_buffer_size": "16MB", "bogus_option": "1"}
    return [s.setup(d), s.close()]


def _snapshot_fixture(s):
    dst, db = cbuf(8192)
    ctypes.memset(dst, 0, 8192)
    assert s.register_buffer(dst, 8192) == 0
    s.put("sn1", bytes(range(200))), s.put("sn2", b"abcdefgh")
    return dst, db


@case
def snapshot_reads(s):
    dst, db = _snapshot_fixture(s)
    snap = s.prepare_get_into_ranges_snapshot(["sn1", "sn2", "sn-missing"])
    r = [type(snap).__name__, s.remove("sn2")]
    r.append(s.get_into_ranges_from_snapshot(snap, [dst], [["sn1", "sn2"]], [[[0, 10], [100]]], [[[5, 50], [2]]], [[[3, 4], [5]]]))
    r.append([bytes(db[:3]).hex(), bytes(db[10:14]).hex(), bytes(db[100:105]).decode()])
    r.append(s.get_into_ranges_from_snapshot(snap, [dst, dst + 4096], [["sn2"], ["sn1"]], [[[0]], [[0]]], [[[0]], [[199]]], [[[8]], [[1]]]))
    r.append(s.get_into_ranges_from_snapshot(snap, [dst], [["sn-missing"]], [[[0]]], [[[0]]], [[[1]]]))
    s.remove_all(True)
    return r


@case
def snapshot_refusals(s):
    dst, _ = _snapshot_fixture(s)
    snap = s.prepare_get_into_ranges_snapshot(["sn1", "sn2"])
    other = cbuf(64)[0]
    r = [s.get_into_ranges_from_snapshot(snap, [dst], [["sn3"]], [[[0]]], [[[0]]], [[[3]]]),
         s.get_into_ranges_from_snapshot(snap, [dst], [["sn2"]], [[[0]]], [[[5]]], [[[10]]]),
         s.get_into_ranges_from_snapshot(snap, [dst], [["sn2"]], [[[0, 1]]], [[[5]]], [[[1]]]),
         s.get_into_ranges_from_snapshot(snap, [other], [["sn2"]], [[[0]]], [[[0]]], [[[4]]]),
         s.get_into_ranges_from_snapshot(snap, [0], [["sn2"]], [[[0]]], [[[0]]], [[[4]]])]
    s.remove_all(True)
    return r


@case
def snapshot_of_nothing(s):
    dst, _ = _snapshot_fixture(s)
    snap = s.prepare_get_into_ranges_snapshot([])
    r = [s.get_into_ranges_from_snapshot(snap, [dst], [["sn1"]], [[[0]]], [[[0]]], [[[4]]])]
    s.remove_all(True)
    return r


@case
def snapshot_of_another_store(s):
    t = store()
    try:
        snap = t.prepare_get_into_ranges_snapshot(["x"])
        return s.get_into_ranges_from_snapshot(snap, [1], [["x"]], [[[0]]], [[[0]]], [[[1]]])
    finally:
        t.close()


@case
def snapshot_not_a_snapshot(s):
    return s.get_into_ranges_from_snapshot(None, [1], [["x"]], [[[0]]], [[[0]]], [[[1]]])


@case
def put_session(s):
    src, sb = cbuf(8192, 3)
    assert s.register_buffer(src, 8192) == 0
    r = [s.batch_put_session_start(["ps1", "ps2"], [100, 50])]
    r.append([s.is_exist("ps1"), s.probe_key("ps1"), s.get("ps1")])
    r.append(s.batch_put_from_multi_buffer_ranges(["ps1", "ps2"], [[src, src + 1000], [src + 2000]], [[60, 40], [50]], [[0, 60], [0]]))
    r.append(s.batch_put_session_end(["ps1", "ps2", "ps-none"]))
    r.append([s.get("ps1") == bytes(sb[:60]) + bytes(sb[1000:1040]), s.get("ps2") == bytes(sb[2000:2050])])
    r.append(s.batch_put_session_end(["ps1"]))
    s.remove_all(True)
    return r


@case
def put_session_refusals(s):
    src, _ = cbuf(4096)
    assert s.register_buffer(src, 4096) == 0
    s.put("pz-exists", b"x")
    r = [s.batch_put_session_start(["pz1"], [100])]
    r.append(s.batch_put_from_multi_buffer_ranges(["pz1"], [[src]], [[10]], [[95]]))
    r.append(s.batch_put_from_multi_buffer_ranges(["pz-none"], [[src]], [[10]], [[0]]))
    r.append(s.batch_put_from_multi_buffer_ranges(["pz1"], [[src, src]], [[10]], [[0]]))
    r.append(s.batch_put_session_start(["pz-exists", "pz2"], [100, 10]))
    r.append(s.batch_put_session_revoke(["pz2", "pz-exists", "pz-none"]))
    r.append([s.is_exist("pz2"), s.batch_put_session_end(["pz1"])])
    r.append(s.batch_put_session_start(["pz3"], [10, 20]))
    r.append(s.batch_put_session_start(["pz4"], [0]))
    r.append(s.batch_put_session_start(["pz6", "pz7"], [10, 10], cfg(group_ids=["g"])))
    s.remove_all(True)
    return r


@case
def get_session(s):
    src, sb = cbuf(4096, 5)
    dst, db = cbuf(4096)
    ctypes.memset(dst, 0, 4096)
    assert s.register_buffer(src, 4096) == 0 and s.register_buffer(dst, 4096) == 0
    r = [s.put_from("gs1", src, 100), s.put_from("gs2", src + 200, 50)]
    r += [s.batch_get_session_start(["gs1", "gs2", "gs-missing"]), s.remove("gs2")]
    r.append(s.batch_get_into_multi_buffer_ranges(["gs1", "gs2"], [[dst, dst + 500], [dst + 1000]], [[30, 20], [10]], [[0, 50], [40]]))
    r.append([bytes(db[:30]) == bytes(sb[:30]), bytes(db[500:520]) == bytes(sb[50:70]), bytes(db[1000:1010]) == bytes(sb[240:250])])
    r.append([s.batch_get_into_multi_buffer_ranges(["gs1"], [[dst]], [[10]], [[95]]),
              s.batch_get_into_multi_buffer_ranges(["gs-other"], [[dst]], [[10]], [[0]]),
              s.batch_get_into_multi_buffer_ranges(["gs-missing"], [[dst]], [[10]], [[0]])])
    r.append(s.batch_get_session_end(["gs1", "gs2", "gs-missing"]))
    r.append([s.batch_get_into_multi_buffer_ranges(["gs1"], [[dst]], [[10]], [[0]]), s.batch_get_session_end(["gs1"])])
    s.remove_all(True)
    return r


@case
def put_from_with_metadata(s):
    src, sb = cbuf(4096, 1)
    md, mb = cbuf(16, 100)
    assert s.register_buffer(src, 4096) == 0
    r = [s.put_from_with_metadata("md1", src, md, 32, 16), s.get_size("md1"), s.get("md1") == bytes(mb) + bytes(sb[:32])]
    r += [s.put_from_with_metadata("md2", src, 0, 32, 0), s.get_size("md2"), s.get("md2") == bytes(sb[:32])]
    s.remove_all(True)
    return r


@case
def init_all_when_set_up(s):
    return s.init_all("tcp", "", 16 << 20)


@case
def init_all_keywords(s):
    return s.init_all(protocol="tcp", device_name="", mount_segment_size=16 << 20)


@case
def allocate_and_mount_segment(s):
    n = 18 << 20  # more than the setup's 16 MiB segment: lands in the one mounted here
    src, _ = cbuf(n, 9)
    assert s.register_buffer(src, n) == 0
    r = s.allocate_and_mount_segment(20 << 20)
    ids = r["segment_ids"]
    out = [sorted(r), r["ret"], len(ids), r["allocated_size"] >= 20 << 20]
    out += [s.put_from("seg-big", src, n), s.get_size("seg-big")]
    out += [s.unmount_and_free_segment(ids), s.is_exist("seg-big"), s.unmount_and_free_segment(ids), s.unmount_and_free_segment(["nope"])]
    z = s.allocate_and_mount_segment(0)
    s.unregister_buffer(src)
    s.remove_all(True)
    return out + [[z["ret"], z["segment_ids"], z["allocated_size"]]]


@case
def module_names_tasks(_):
    """The task types of the module, their numbers, and an empty QueryTaskResponse."""
    return [[(n, int(v)) for n, v in m.TaskStatus.__members__.items()], [(n, int(v)) for n, v in m.TaskType.__members__.items()],
            [m.FAILED == m.TaskStatus.FAILED, m.PROCESSING == m.TaskStatus.PROCESSING, int(m.PENDING), int(m.SUCCESS), int(m.REPLICA_MOVE)],
            repr(m.QueryTaskResponse())]


def _task_end(s, tid):
    """query_task until the task finished (30 s at most): (response, code). A task runs in
    its owner's background thread (stock polls every second) and nothing announces its end
    but query_task itself, so it is asked again."""
    deadline = time.time() + 30
    while True:
        q, rc = s.query_task(tid)
        if rc != 0 or int(q.status) in (2, 3) or time.time() > deadline:
            return q, rc
        time.sleep(0.05)


def _task_shape(s, tid, rc):
    """What is comparable of a task across implementations (ids and times are not)."""
    q, qrc = _task_end(s, tid)
    if q is None:
        return [rc, qrc]
    times = 1.7e12 < q.created_at_ms_epoch <= q.last_updated_at_ms_epoch < 4e12
    return [rc, type(tid).__name__, len(tid), qrc, q.id == tid, int(q.type), int(q.status), q.message, times,
            type(q.assigned_client).__name__, len(q.assigned_client)]


def _eps(s, key):
    return {r.get_memory_descriptor().buffer_descriptor.transport_endpoint for r in s.get_replica_desc(key)}


@case
def copy_and_move_tasks(s):
    """A copy to another client's segment adds a replica there; a move of the source to a
    segment already holding one drops the source; a move to a fresh segment leaves exactly
    the target replica; the bytes read back (from the one replica left)."""
    t = store()
    a, b = s.get_hostname(), t.get_hostname()
    on_a = cfg(preferred_segment=a)
    out = [s.put("ct1", b"copied value", on_a), s.put("ct2", b"moved value", on_a)]
    e0 = _eps(s, "ct1")
    out.append(_task_shape(s, *s.create_copy_task("ct1", [b])))
    e1 = _eps(s, "ct1")
    out += [len(e0), len(e1), e0 < e1]
    out.append(_task_shape(s, *s.create_move_task("ct1", a, b)))
    e2 = _eps(s, "ct1")
    out += [e2 == e1 - e0, s.get("ct1")]
    f0 = _eps(s, "ct2")
    out.append(_task_shape(t, *t.create_move_task("ct2", a, b)))
    f1 = _eps(s, "ct2")
    out += [len(f1), f1 == e2, f0 == e0, s.get("ct2")]
    # A copy to the segment that holds the replica: nothing to copy, SUCCESS.
    out.append(_task_shape(s, *s.create_copy_task("ct2", [b])))
    out.append(len(_eps(s, "ct2")))
    out += [s.remove("ct1", True), s.remove("ct2", True)]
    t.close()
    return out


@case
def task_refusals(s):
    a = s.get_hostname()
    out = [s.put("ct3", b"x", cfg(preferred_segment=a))]
    out += [list(s.create_copy_task("ct3", [])), list(s.create_copy_task("ct3-nope", [a])),
            list(s.create_copy_task("ct3", ["127.0.0.1:1"])), list(s.create_move_task("ct3", a, a)),
            list(s.create_move_task("ct3-nope", a, a)), list(s.create_move_task("ct3", "127.0.0.1:1", a)),
            list(s.create_move_task("ct3", a, "127.0.0.1:1")), list(s.query_task((1, 2)))]
    out.append(s.remove("ct3", True))
    return out


@case
def query_task_not_a_pair(s):
    return s.query_task(5)


@case
def put_session_no_space(s):
    """Last: a start that finds no space makes stock Mooncake's master evict (unleased
    objects of the cases before could go)."""
    return s.batch_put_session_start(["pz5"], [1 << 40])


def _jsonable(v):
    if isinstance(v, bytes):
        return {"bytes": v.hex()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


def main():
    # Keep stdout for the JSON: native code that prints goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    names = sys.argv[2:] or list(CASES)
    result = {}
    shared = None
    try:
        for name in names:
            try:
                if name.startswith("exist_options") or name.startswith(("replicate_config", "ranged_snapshot", "module_names", "setup_", "host_mem")):
                    v = CASES[name](None)
                else:
                    shared = shared or store()
                    v = CASES[name](shared)
                result[name] = _jsonable(v)
            except Exception as e:  # noqa: BLE001 - the type is the result
                result[name] = {"raises": type(e).__name__, "msg": str(e).splitlines()[0][:160] if str(e) else ""}
        if shared is not None:
            shared.close()
    finally:
        compat_cases.stop_master()
    out.write(json.dumps(result) + "\n")
    out.flush()
    os._exit(0)  # skip interpreter teardown (Mooncake's threads can make it slow)


if __name__ == "__main__":
    main()
