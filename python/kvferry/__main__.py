"""The ``kvferry`` command from the wheel: ``kvferry ...`` (the console script that
``pip install kvferry`` puts on PATH) and ``python -m kvferry ...`` run the same code as the
``kvferry`` binary built from source -- every subcommand (``master``, ``store-client``,
``metadata-server``, ``doctor``, ``bench``, ...) -- inside the extension module
``kvferry._kvferry``: the wheel has one native library.

This process becomes the command: SIGINT gets its default action back (Python's handler
would only set a flag nothing checks while the native code runs), so Ctrl-C and SIGTERM end
``kvferry master`` as they end the binary; the exit status is the command's.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import List, Optional

__all__ = ["main", "self_command"]


def self_command() -> List[str]:
    """How to start another ``kvferry`` from this installation: subcommands that start
    children (``bench``, ``doctor``'s probe, ``store-bench``) use it."""
    return [sys.executable, "-m", "kvferry"]


def main(argv: Optional[List[str]] = None) -> int:
    """Runs ``kvferry`` with ``argv`` (default: ``sys.argv[1:]``); returns its exit status."""
    from kvferry import _kvferry

    args = list(sys.argv[1:] if argv is None else argv)
    # Python's own handler only: a SIGINT ignored by whoever started us stays ignored, as it
    # would for the binary.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    # The command writes to file descriptors 1 and 2 directly: what Python buffered goes first.
    for f in (sys.stdout, sys.stderr):
        if f is not None:
            f.flush()
    return int(_kvferry.cli_main(["kvferry"] + args, self_command()))


if __name__ == "__main__":
    sys.exit(main())
