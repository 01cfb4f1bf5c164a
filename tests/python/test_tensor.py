"""Mooncake 0.3.14's torch tensor calls on kvferry (kvferry/mooncake/_tensor.py), checked
against the stock 0.3.14 wheel: tensor_cases.py runs the same calls on each (stock on its
mooncake_master, kvferry on kvferry master) and the results, the stored objects' bytes and the
tensors read back are compared; then each side reads the objects the other one wrote.

Skipped only when torch is not installed: `KVFERRY_TEST_TORCH=1 scripts/python-test` installs it
in the test venv (about 215 s and 5.4 GB from PyPI, with its CUDA libraries), which the default
run leaves out to stay within CI's time.
The stock side runs in the 0.3.14 venv; torch comes from this interpreter's site-packages
when that venv has none (both are CPython 3.11 on CI)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from conftest import peer_env, stock_python
from test_store import cluster  # noqa: F401 - the fixture is used by name

torch = pytest.importorskip("torch", reason="torch is not installed: KVFERRY_TEST_TORCH=1 scripts/python-test installs it (about 215 s, 5.4 GB)")

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(HERE, "tensor_cases.py")


def _stock_env(python: str) -> dict:
    env = peer_env(False)
    r = subprocess.run([python, "-c", "import torch"], capture_output=True, env=env, timeout=120)
    if r.returncode != 0:
        env["PYTHONPATH"] = os.path.dirname(os.path.dirname(torch.__file__))
    return env


def _run(python: str, env: dict, *args: str) -> dict:
    r = subprocess.run([python, CASES, *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    stock_py = stock_python("0.3.14")
    senv = _stock_env(stock_py)
    sdir, kdir = tmp_path_factory.mktemp("stock"), tmp_path_factory.mktemp("kvferry")
    stock = _run(stock_py, senv, "stock", str(sdir))
    ours = _run(sys.executable, peer_env(False), "kvferry", str(kdir))
    return {"stock": stock, "kvferry": ours, "sdir": sdir, "kdir": kdir, "stock_py": stock_py, "senv": senv}


def test_every_case_agrees_with_stock_0_3_14(both):
    s, k = both["stock"], both["kvferry"]
    assert sorted(s) == sorted(k)
    diff = {n: (s[n], k[n]) for n in s if s[n] != k[n]}
    assert diff == {}, json.dumps(diff, indent=1)[:6000]


def test_cases_exercise_success_and_failure(both):
    """The parity above compares real outcomes: stores that worked and bytes that were read."""
    s = both["stock"]
    assert s["meta_size"] == 304
    assert s["put_f32_2d"][0] == 0 and s["put_f32_2d"][1][0] == 304 + 48
    assert s["put_f32_2d"][2] == ["torch.float32", [3, 4], s["ser_f32_2d"][3][2]]
    assert s["batch_put"] == [0, -600, 0] and s["tp_uneven"] == -600
    assert s["tp_get"][0][:2] == ["torch.float32", [4, 3]]
    assert s["get_into"][1] is True  # the tensor aliases the caller's buffer
    assert s["safetensors"][0] == 0 and s["safetensors"][2] == -1100
    assert s["ser_dims9"] == {"raises": "ValueError"}


def test_stored_objects_are_byte_identical(both):
    sdir, kdir = both["sdir"], both["kdir"]
    names = sorted(f for f in os.listdir(sdir) if f.endswith(".bin"))
    assert names == sorted(f for f in os.listdir(kdir) if f.endswith(".bin")) and len(names) >= 20
    for n in names:
        with open(os.path.join(sdir, n), "rb") as a, open(os.path.join(kdir, n), "rb") as b:
            assert a.read() == b.read(), n


def test_each_reads_what_the_other_wrote(both):
    """kvferry reads the objects stock Mooncake stored and stock Mooncake reads kvferry's: the
    same tensors (dtype, shape, bytes) as the writer had."""
    k_reads_stock = _run(sys.executable, peer_env(False), "kvferry", str(both["kdir"]), "read", str(both["sdir"]))
    s_reads_k = _run(both["stock_py"], both["senv"], "stock", str(both["sdir"]), "read", str(both["kdir"]))
    assert k_reads_stock == s_reads_k
    written = both["stock"]
    for name, d in k_reads_stock.items():
        if name.startswith("t_"):
            assert d == written["put_" + name[2:]][2], name
    assert k_reads_stock["tp_tp_1"] == written["tp_get"][0]


# -- kvferry only ----------------------------------------------------------------------------

def test_calls_before_setup_fail_cleanly(caplog):
    from kvferry.mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    t = torch.ones(2)
    assert s.put_tensor("k", t) == -600 and s.upsert_tensor("k", t) == -600 and s.pub_tensor("k", t) == -600
    assert s.get_tensor("k") is None and s.batch_get_tensor(["a", "b"]) == [None, None]
    assert s.batch_put_tensor(["a"], [t]) == [-600] and s.put_tensor_with_tp("k", t, 0, 2, 0) == -600
    assert s.put_tensor_from("k", 0, 400) == -600 and s.batch_get_tensor_into(["a"], [1], [1]) == [-600]
    assert "not set up" in caplog.text


def test_shim_serves_the_private_serializers():
    r = subprocess.run([sys.executable, "-c", "import torch\nfrom mooncake.store import _serialize_tensor, _deserialize_tensor, _tensor_metadata_size\n"
                        "h, p, n, o = _serialize_tensor(torch.arange(3.0))\nprint(_tensor_metadata_size(), len(h), n, _deserialize_tensor(bytes(h) + bytes(o.numpy())).tolist())"],
                       capture_output=True, text=True, env=peer_env(True), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["304", "304", "12", "[0.0,", "1.0,", "2.0]"]


def test_tensor_calls_against_a_master_round_trip_and_share_memory(cluster):
    """Large and strided tensors round-trip; get_tensor owns its bytes (a later upsert does
    not change it); get_tensor_into's tensor is the caller's buffer."""
    from kvferry.mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", cluster) == 0
    try:
        big = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)
        assert s.put_tensor("big", big[:, ::2]) == 0
        got = s.get_tensor("big")
        assert torch.equal(got, big[:, ::2]) and got.is_contiguous()
        assert s.upsert_tensor("big", torch.zeros(2)) == 0
        assert torch.equal(got, big[:, ::2])  # a copy, not the store's memory
        n = 304 + 8
        buf = (ctypes.c_char * 4096)()
        ptr = ctypes.addressof(buf)
        assert s.register_buffer(ptr, 4096) == 0
        t = s.get_tensor_into("big", ptr, 4096)
        assert t.tolist() == [0.0, 0.0] and t.data_ptr() == ptr + 304
        t[1] = 7.0  # writes land in the caller's buffer ...
        assert s.put_tensor_from("big2", ptr, n) == 0  # ... and put_tensor_from stores them
        assert s.get_tensor("big2").tolist() == [0.0, 7.0]
        assert s.unregister_buffer(ptr) == 0
    finally:
        s.close()
