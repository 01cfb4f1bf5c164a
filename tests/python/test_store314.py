"""Mooncake 0.3.14's store calls and types (store314_cases.py) on kvferry and on the stock
0.3.14 wheel, each against its own master: the same return codes and bytes. Plus what stock
cannot show: that probe_key is a request of its own that leases nothing, sessions across
threads, an embedded master's lifetime."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

CASES = pathlib.Path(__file__).with_name("store314_cases.py")

#: Where kvferry deliberately differs from stock 0.3.14: case -> (kvferry, stock) results.
DIVERGENT = {
    # Stock ignores keys it does not know; kvferry refuses them by name (-600, logged).
    "setup_dict_unknown_key": ([-600, 0], [0, 0]),
}


def _run(python: str, impl: str) -> dict:
    env = dict(os.environ, MC_FORCE_TCP="1", KVFERRY_TRANSPORT="tcp")
    env.pop("KVFERRY_MOONCAKE_SHIM", None)
    r = subprocess.run([python, str(CASES), impl], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, "store314_cases.py %s printed nothing:\n%s" % (impl, r.stderr[-3000:])
    return json.loads(lines[-1])


#: `dir(MooncakeDistributedStore)` of the stock 0.3.14 wheel, public names (90).
NAMES_0314 = (
    "alloc_from_mem_pool", "allocate_and_mount_segment", "batch_get_buffer", "batch_get_into",
    "batch_get_into_multi_buffer_ranges", "batch_get_into_multi_buffers", "batch_get_replica_desc",
    "batch_get_session_end", "batch_get_session_start", "batch_get_tensor",
    "batch_get_tensor_into", "batch_get_tensor_into_cuda", "batch_get_tensor_with_tp",
    "batch_get_tensor_with_tp_into", "batch_is_exist", "batch_probe_key", "batch_pub_tensor",
    "batch_pub_tensor_with_tp", "batch_put_from", "batch_put_from_multi_buffer_ranges",
    "batch_put_from_multi_buffers", "batch_put_session_end", "batch_put_session_revoke",
    "batch_put_session_start", "batch_put_tensor", "batch_put_tensor_from",
    "batch_put_tensor_with_tp", "batch_put_tensor_with_tp_from", "batch_remove",
    "batch_replica_clear", "batch_upsert_from", "batch_upsert_pub_tensor", "batch_upsert_tensor",
    "batch_upsert_tensor_from", "begin_weight_snapshot", "close", "create_copy_task",
    "create_move_task", "get", "get_batch", "get_buffer", "get_hostname", "get_into",
    "get_into_ranges", "get_into_ranges_from_snapshot", "get_offload_rpc_read_count",
    "get_replica_desc", "get_size", "get_tensor", "get_tensor_into", "get_tensor_into_cuda",
    "get_tensor_with_tp", "get_tensor_with_tp_into", "health_check", "init_all", "is_exist",
    "load_tensor_from_safetensor", "mount_segment", "prepare_get_into_ranges_snapshot",
    "probe_key", "pub_tensor", "pub_tensor_with_tp", "put", "put_batch", "put_from",
    "put_from_with_metadata", "put_parts", "put_tensor", "put_tensor_from", "put_tensor_with_tp",
    "put_tensor_with_tp_from", "query_task", "register_buffer", "remove", "remove_all",
    "remove_by_regex", "save_tensor_to_safetensor", "setup", "setup_dummy",
    "unmount_and_free_segment", "unmount_local_disk_segment", "unmount_segment",
    "unregister_buffer", "upsert", "upsert_batch", "upsert_from", "upsert_parts",
    "upsert_pub_tensor", "upsert_tensor", "upsert_tensor_from",
)


_KV = {}


def _kvferry() -> dict:
    if not _KV:
        _KV.update(_run(sys.executable, "kvferry"))
    return _KV


def test_parity_with_stock_0_3_14():
    """Every case on kvferry and on the stock 0.3.14 wheel: same results (exception types;
    Mooncake's message within kvferry's where kvferry raises its own), only DIVERGENT
    differs, and only as listed."""
    from conftest import stock_python

    stock = _run(stock_python("0.3.14"), "mooncake")
    ours = _kvferry()
    assert sorted(ours) == sorted(stock)
    bad = []
    for name in stock:
        o, s = ours[name], stock[name]
        if name in DIVERGENT:
            if [o, s] != list(DIVERGENT[name]):
                bad.append("%s (divergent): kvferry %r, stock %r, expected %r" % (name, o, s, DIVERGENT[name]))
            continue
        if isinstance(s, dict) and "raises" in s:
            ok = isinstance(o, dict) and o.get("raises") == s["raises"]
        else:
            ok = o == s
        if not ok:
            bad.append("%s: kvferry %r, stock %r" % (name, o, s))
    assert not bad, "\n".join(bad)


def _ok(kind):
    """A task's shape in a case (store314_cases._task_shape) once it succeeded."""
    return [0, "tuple", 2, 0, True, kind, 3, "Task completed successfully", True, "tuple", 2]


@pytest.mark.parametrize("name", ["probe_grants_no_lease", "batch_probe_last_hit_only", "put_session", "get_session", "snapshot_reads", "allocate_and_mount_segment",
                                  "copy_and_move_tasks"])
def test_kvferry_cases_hold_their_shape(name):
    """The cases that prove the semantics, checked on kvferry alone (so a missing stock wheel
    does not hide them): probe leases nothing where is_exist does; LastHitOnly leases only
    the last group found; sessions write and read ranges; snapshots read ranges; a segment
    mounted after setup takes a value too large for the setup's and loses it when unmounted; a
    copy task adds a replica on another client's segment, a move leaves only the target's."""
    want = {
        "probe_grants_no_lease": [0, 1, 0, 0, 0, 1, -706],
        "batch_probe_last_hit_only": [[1, 1, 0], 0, -706],
        "put_session": [[0, 0], [0, 0, {"bytes": ""}], [100, 50], [0, 0, -600], [True, True], [-600]],
        "get_session": [0, 0, [0, 0, -704], -706, [50, 10], [True, True, True], [[-600], [-600], [-600]], 0, [[-600], 0]],
        "allocate_and_mount_segment": [["allocated_size", "ret", "segment_ids"], 0, 1, True, 0, 18 << 20, 0, 0, -1, -1, [-1, [], 0]],
        # Each task: (rc, id shape, query rc, id, type, status, message, times, client shape).
        "copy_and_move_tasks": [0, 0, _ok(0), 1, 2, True, _ok(1), True, {"bytes": b"copied value".hex()}, _ok(1), 1, True, True,
                                {"bytes": b"moved value".hex()}, _ok(0), 1, 0, 0],
        "snapshot_reads": ["RangedReadSnapshot", -706, [[[3, 4], [5]]], ["050607", "32333435", "cdefg"], [[[8]], [[1]]], [[[-704]]]],
    }
    assert _kvferry()[name] == want[name]


def test_every_0_3_14_name_works_or_says_why_not():
    """Each public name of 0.3.14's MooncakeDistributedStore is served by kvferry or raises
    AttributeError naming kvferry and the reason (docs/PYTHON.md's table); the new 0.3.14
    calls of this issue are served."""
    from kvferry.mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    missing = {}
    for n in NAMES_0314:
        try:
            assert callable(getattr(s, n)), n
        except AttributeError as e:
            assert "not provided by kvferry (" in str(e), (n, str(e))
            missing[n] = str(e)
    served = ("probe_key", "batch_probe_key", "prepare_get_into_ranges_snapshot", "get_into_ranges_from_snapshot", "batch_put_session_start",
              "batch_put_session_end", "batch_put_session_revoke", "batch_get_session_start", "batch_get_session_end",
              "batch_put_from_multi_buffer_ranges", "batch_get_into_multi_buffer_ranges", "put_from_with_metadata")
    assert not set(served) & set(missing), sorted(set(served) & set(missing))


def test_the_list_of_names_is_the_stock_wheels():
    """NAMES_0314 is what the stock wheel has (so the test above covers every name)."""
    from conftest import stock_python

    r = subprocess.run([stock_python("0.3.14"), "-c", "import json, mooncake.store as s; print(json.dumps(sorted(n for n in dir(s.MooncakeDistributedStore) if not n.startswith('_'))))"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, MC_FORCE_TCP="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == sorted(NAMES_0314)


def test_an_embedded_master_serves_other_clients_until_its_store_closes():
    """setup(enable_embedded_master=True): a master in this process, at the address
    `embedded_master_address` names; another client can use it; close() stops it (its port
    then refuses connections)."""
    import socket

    from kvferry.mooncake.store import MooncakeDistributedStore

    a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert a.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", "127.0.0.1:1", enable_embedded_master=True) == 0
    addr = a.embedded_master_address
    host, port = addr.rsplit(":", 1)
    assert host == "127.0.0.1" and port != "1"
    assert b.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", addr) == 0
    assert a.put("em", b"shared") == 0 and b.get("em") == b"shared"
    assert b.close() == 0 and a.close() == 0
    assert a.embedded_master_address == ""
    # close() shut the master's listener before returning: a connection is refused at once.
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()


def test_setup_dict_names_the_keys_it_refuses_and_warns_once_for_those_without_effect(caplog):
    import logging

    from kvferry.mooncake.store import MooncakeDistributedStore

    d = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "enable_embedded_master": True,
         "global_segment_size": "16MB", "local_buffer_size": "16MB"}
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert MooncakeDistributedStore().setup(dict(d, bogus_option=1, other_typo="x")) == -600
        assert "unknown keys bogus_option, other_typo" in caplog.text
        assert MooncakeDistributedStore().setup(dict(d, enable_egm_store_pool="true")) == -600
        assert "enable_egm_store_pool" in caplog.text
        caplog.clear()
        s = MooncakeDistributedStore()
        assert s.setup(dict(d, ipc_socket_path="/tmp/x.sock", enable_ssd_prefetch="false")) == 0
        s.close()
        assert "ipc_socket_path='/tmp/x.sock' has no effect" in caplog.text
        assert "enable_ssd_prefetch" not in caplog.text, "false asks for nothing"


def test_module_names_not_served_say_why():
    import kvferry.mooncake.store as ms

    for n in ("get_alloc_func_addr", "EngramStore"):
        with pytest.raises(AttributeError, match="not provided by kvferry"):
            getattr(ms, n)
    with pytest.raises(AttributeError, match="has no attribute"):
        ms.no_such_name  # noqa: B018


def _kvferry_master(*flags: str):
    """A `kvferry master` on 127.0.0.1 with `flags`: (process, address)."""
    here = pathlib.Path(__file__).resolve().parent
    cands = [os.environ.get("KVFERRY_BIN", ""), os.path.join(os.path.dirname(sys.executable), "kvferry")]
    cands += [str(here.parent.parent / "target" / p / "kvferry") for p in ("ci", "release", "debug")]
    exe = next(c for c in cands if c and os.path.isfile(c))
    p = subprocess.Popen([exe, "master", "--port", "0", "--metrics-port", "-1", "--summary-interval", "0", *flags],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    return p, next(w[4:] for w in line.split() if w.startswith("rpc="))


def test_a_get_session_outlives_its_leases():
    """A get session's lists are asked for again once half their lease is spent, so a read
    after the first lease ran out still succeeds (without that, the read is refused: its
    replica may have been reused). The lease's end is observed, not waited for by a sleep:
    a key leased by the same request becomes removable."""
    import ctypes

    from conftest import wait_for
    from kvferry.mooncake.store import MooncakeDistributedStore

    p, addr = _kvferry_master("--default_kv_lease_ttl=300ms")
    s = MooncakeDistributedStore()
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", addr) == 0
        buf = ctypes.create_string_buffer(4096)
        dst = ctypes.addressof(buf)
        assert s.register_buffer(dst, 4096) == 0
        assert s.put("lv", b"lasting value") == 0 and s.put("lv-witness", b"w") == 0
        assert s.batch_get_session_start(["lv", "lv-witness"]) == [0, 0]
        assert s.remove("lv-witness") == -706
        # The session's first leases run out (the master's lease TTL), then the witness goes.
        assert wait_for(lambda: s.remove("lv-witness") == 0, 10), "the lease never ended"
        assert s.batch_get_into_multi_buffer_ranges(["lv"], [[dst]], [[7]], [[0]]) == [7]
        assert buf.raw[:7] == b"lasting"
        assert s.batch_get_session_end(["lv"]) == 0
    finally:
        s.close()
        p.kill()
        p.wait(10)
