"""Mooncake's ``mooncake.cli`` (its ``mooncake_master`` console command) on kvferry: runs
``kvferry master`` with the same arguments. ``kvferry master`` takes ``mooncake_master``'s
command line (docs/MIGRATING.md: which flags are translated, ignored with a warning or refused).

The master is this installation's ``kvferry`` command (``python -m kvferry master``; the wheel
carries the whole CLI in its extension module), or ``$KVFERRY_BIN master`` when
``KVFERRY_BIN`` is set (a binary built from source). The process is replaced (``exec``), so
the pid, signals and exit status are the master's, as with Mooncake's launcher."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

__all__ = ["main"]


def master_command(argv: List[str]) -> List[str]:
    """The command line ``main`` execs: kvferry's master with ``argv``."""
    binary = os.environ.get("KVFERRY_BIN")
    if binary:
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            raise FileNotFoundError("KVFERRY_BIN=%r is not an executable file; unset it to use this installation's `python -m kvferry`" % binary)
        return [binary, "master"] + list(argv)
    return [sys.executable, "-m", "kvferry", "master"] + list(argv)


def main(argv: Optional[List[str]] = None) -> None:
    """Runs ``kvferry master`` in place of this process (as Mooncake's ``main`` execs
    ``mooncake_master``)."""
    cmd = master_command(sys.argv[1:] if argv is None else argv)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
