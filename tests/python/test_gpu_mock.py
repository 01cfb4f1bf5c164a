"""GPU pointers through the Mooncake shim, against the mock libcuda.so.1 of the Rust tests
(crates/kvferry/tests/cuda_mock/mock_cuda.c: device memory the CPU cannot touch, reached only
through the driver's copies). The body runs in a child Python whose LD_LIBRARY_PATH holds the
mock, so kvferry loads it by soname as it loads the real driver."""

import os
import shutil
import subprocess
import sys

from conftest import ROOT

MOCK = ROOT / "crates" / "kvferry" / "tests" / "cuda_mock" / "mock_cuda.c"

CHILD = r"""
import ctypes
import kvferry
from kvferry.mooncake import engine as mc

assert kvferry.features()["cuda"] is True, kvferry.features()
# SUPPORT_CUDA promises the *_on_cuda calls, which need the driver's cuStreamSynchronize (the
# mock has none): the flag and the calls go together.
assert mc.SUPPORT_CUDA == hasattr(mc.TransferEngine, "transfer_write_on_cuda") == hasattr(ctypes.CDLL("libcuda.so.1"), "cuStreamSynchronize")
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
U64 = ctypes.c_uint64

def on(dev):
    ctx = ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0

def alloc(dev, n):
    on(dev)
    p = U64()
    assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) == 0
    return p.value

def dtoh(dev, p, n):
    on(dev)
    out = ctypes.create_string_buffer(n)
    assert cu.cuMemcpyDtoH_v2(out, U64(p), ctypes.c_size_t(n)) == 0
    return out.raw

a, b = mc.TransferEngine(), mc.TransferEngine()
for e in (a, b):
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
g0 = alloc(0, 1 << 20)
g1 = alloc(1, 1 << 20)
# Interior pointers, as PyTorch's caching allocator hands out; Mooncake's default location "*".
assert b.register_memory(g0 + 4096, 65536) == 0
assert b.batch_register_memory([g1, g1 + 65536], [65536, 65536]) == 0
locs = {r.addr: r.location for r in b.get_engine().registered()}
assert locs == {g0 + 4096: "cuda:0", g1: "cuda:1", g1 + 65536: "cuda:1"}, locs
# Host memory registers as before.
host = ctypes.create_string_buffer(bytes(range(256)) * 256)
hp = ctypes.addressof(host)
assert a.register_memory(hp, 65536) == 0
assert {r.addr: r.location for r in a.get_engine().registered()} == {hp: "*"}
# Host -> GPU and GPU -> host over TCP, the bytes checked through the driver.
seg = "127.0.0.1:%d" % b.get_rpc_port()
assert a.transfer_sync_write(seg, hp, g0 + 4096, 65536) == 0
assert dtoh(0, g0 + 4096, 65536) == host.raw[:65536]
back = ctypes.create_string_buffer(65536)
assert a.register_memory(ctypes.addressof(back), 65536) == 0
assert a.transfer_sync_read(seg, ctypes.addressof(back), g0 + 4096, 65536) == 0
assert back.raw == host.raw[:65536]
# The CPU never touches GPU memory: a view of it is refused, not a crash.
import kvferry
try:
    b.get_engine().view(g0 + 4096, 16)
    raise SystemExit("a view of GPU memory was made")
except kvferry.InvalidArgument as e:
    assert "GPU memory" in str(e), e
print("gpu-mock-ok")
"""


def test_mooncake_register_memory_classifies_gpu_pointers_and_moves_them(tmp_path):
    cc = shutil.which(os.environ.get("CC", "cc"))
    assert cc, "building the mock libcuda needs a C compiler (cc)"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-pthread", "-o", str(tmp_path / "libcuda.so.1"), str(MOCK)], check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "gpu-mock-ok" in r.stdout, r.stdout + r.stderr


def test_without_a_driver_features_say_no_cuda(tmp_path):
    # A driver that finds no GPU, first in the library path (so this holds on GPU hosts too).
    cc = shutil.which(os.environ.get("CC", "cc"))
    assert cc, "building the mock libcuda needs a C compiler (cc)"
    subprocess.run([cc, "-shared", "-fPIC", "-DINIT_RESULT=100", "-DCOUNT=0", "-o", str(tmp_path / "libcuda.so.1"), str(MOCK)], check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    code = "import kvferry; assert kvferry.features()['cuda'] is False; print('no-cuda-ok')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "no-cuda-ok" in r.stdout, r.stdout + r.stderr
