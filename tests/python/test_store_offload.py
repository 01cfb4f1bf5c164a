"""The disk tier from Python, as Mooncake spells it: ``setup(..., enable_ssd_offload=True,
ssd_offload_path=DIR)`` (and its dict form) against a ``kvferry master --enable_offload``.
What the master evicts from the owner's segment lands on its disk, ``get_replica_desc``
shows it as a local-disk replica, and a get from another client reads it back (every value
read is checked). Waits are polls of a condition with a deadline."""

from __future__ import annotations

import os

import pytest

from kvferry.mooncake.store import MooncakeDistributedStore
from conftest import wait_for
from test_store import start_master, value

HOST = "127.0.0.1"
KIB = 1024


@pytest.fixture()
def offload_master():
    m = start_master("--enable_offload=true")
    yield m.field("rpc=")
    m.stop()


def test_evicted_values_are_read_back_from_the_owners_disk(offload_master, tmp_path, monkeypatch):
    monkeypatch.setenv("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1")
    owner = MooncakeDistributedStore()
    # The dict form, as Mooncake's config files spell it.
    assert owner.setup({
        "local_hostname": HOST, "metadata_server": "P2PHANDSHAKE", "global_segment_size": "4MB",
        "local_buffer_size": "4MB", "protocol": "tcp", "master_server_address": offload_master,
        "enable_ssd_offload": True, "ssd_offload_path": str(tmp_path),
    }) == 0
    reader = MooncakeDistributedStore()
    assert reader.setup(HOST, "P2PHANDSHAKE", 0, 8 << 20, "tcp", "", offload_master) == 0
    keys = ["t%02d" % i for i in range(15)]  # 15 x 256 KiB: over the 90% watermark of 4 MiB
    for k in keys:
        assert reader.put(k, value(k, 256 * KIB)) == 0

    def on_disk():
        descs = reader.batch_get_replica_desc(keys)
        return [k for k in keys if any(d.is_local_disk_replica() for d in descs.get(k, []))]

    disk_keys = wait_for(on_disk, 20, 0.05)
    assert disk_keys, "no evicted value on the owner's disk within 20 s"
    for k in disk_keys:
        (d,) = reader.get_replica_desc(k)
        assert d.is_local_disk_replica() and not d.is_memory_replica() and not d.is_disk_replica()
        with pytest.raises(RuntimeError):
            d.get_memory_descriptor()
    for k in keys:
        assert reader.get(k) == value(k, 256 * KIB), k
        assert owner.get(k) == value(k, 256 * KIB), k
    assert any(f.name.endswith(".kv") for f in tmp_path.rglob("*")), "records on the directory"
    assert reader.close() == 0 and owner.close() == 0


def test_enable_ssd_offload_needs_a_directory(offload_master, monkeypatch):
    monkeypatch.delenv("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", raising=False)
    s = MooncakeDistributedStore()
    rc = s.setup(HOST, "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", offload_master, enable_ssd_offload=True)
    assert rc < 0
    missing = os.path.join("/nonexistent-kvferry", "dir")
    assert s.setup(HOST, "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", offload_master, enable_ssd_offload=True, ssd_offload_path=missing) < 0
