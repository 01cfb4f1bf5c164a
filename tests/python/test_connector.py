"""examples/python/pd_connector.py, the connector-shaped example, run as a deployment runs it:
a prefill process and a decode process, each importing ``mooncake.engine``. kvferry on both
sides, and a stock Mooncake decode side against a kvferry prefill side. The decode side checks
every byte of each done request, that a request naming unregistered memory is reported failed,
and that an aborted request's blocks, freed only once its write is over, are never written
after; ``--release-early`` (a connector freeing them at once) must be caught."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, peer_env

EXAMPLE = ROOT / "examples" / "python" / "pd_connector.py"
REQUESTS = 8
CONNECTIONS = REQUESTS + 2  # the requests, the aborted one, the one naming bad memory


def env(shim: bool, same_host: bool) -> dict:
    e = peer_env(shim)
    if same_host:  # kvferry engines on one host then move bytes through shared memory
        e.pop("MC_FORCE_TCP", None)
    return e


def run_pair(prefill_py: str, prefill_shim: bool, decode_py: str, decode_shim: bool, *extra: str, same_host: bool = False) -> dict:
    pre = subprocess.Popen([prefill_py, str(EXAMPLE), "prefill", "--connections", str(CONNECTIONS), "--idle-s", "60"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(prefill_shim, same_host))
    try:
        assert pre.stdout is not None
        first = pre.stdout.readline()
        assert first, "the prefill side printed nothing: %s" % pre.communicate(timeout=30)[1][-3000:]
        port = json.loads(first)["listening"]
        dec = subprocess.run([decode_py, str(EXAMPLE), "decode", "--prefill", "127.0.0.1:%d" % port, "--requests", str(REQUESTS), *extra],
                             capture_output=True, text=True, timeout=180, env=env(decode_shim, same_host))
        lines = [ln for ln in dec.stdout.splitlines() if ln.startswith("{")]
        assert lines, "the decode side printed no summary (rc=%d): %s" % (dec.returncode, dec.stderr[-3000:])
        out = json.loads(lines[-1])
        out["rc"] = dec.returncode
        assert pre.wait(timeout=60) == 0, pre.stderr.read()[-3000:] if pre.stderr else ""
        return out
    finally:
        if pre.poll() is None:
            pre.kill()
            pre.wait(timeout=30)


def expect_ok(out: dict) -> None:
    assert out["errors"] == [], out
    assert out == {"ok": True, "done": REQUESTS, "failed": [REQUESTS + 1], "aborted": [REQUESTS], "errors": [], "rc": 0}


@pytest.mark.parametrize("same_host", [False, True], ids=["tcp", "shm"])
def test_kvferry_prefill_and_decode_move_every_block_and_free_aborted_blocks_only_after_their_write(same_host):
    expect_ok(run_pair(sys.executable, True, sys.executable, True, same_host=same_host))


@pytest.mark.parametrize("same_host", [False, True], ids=["tcp", "shm"])
def test_a_connector_freeing_an_aborted_requests_blocks_at_once_is_caught(same_host):
    out = run_pair(sys.executable, True, sys.executable, True, "--release-early", same_host=same_host)
    assert out["rc"] == 1 and not out["ok"], out
    assert any("released it" in e or "wrong bytes" in e for e in out["errors"]), out


def test_a_stock_mooncake_decode_side_gets_every_block_from_a_kvferry_prefill_side(mooncake_py):
    # Only this way round: a stock Mooncake 0.3.13 prefill side's batch_transfer_sync_write can
    # return 0 while its TCP lanes still hold a descriptor to send (after "queue-full
    # rejection"), so a decode side freeing blocks on "done" sees late bytes land in them;
    # that is Mooncake's initiator, documented in docs/PYTHON.md.
    expect_ok(run_pair(sys.executable, True, mooncake_py, False))
