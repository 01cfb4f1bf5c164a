"""Opt-in aliasing of ``mooncake`` / ``mooncake.engine`` to kvferry's modules.

The wheel does not ship a top-level ``mooncake`` package (it would collide with an
installed official Mooncake). Instead, a ``sys.meta_path`` finder answers imports of the
``mooncake.*`` modules of Mooncake 0.3.14's wheel from the table in
``kvferry._mooncake_modules``: the modules kvferry serves (``mooncake``, ``mooncake.engine``,
``mooncake.store``, ``mooncake.http_metadata_server``, ``mooncake.buffer_pool``,
``mooncake.async_store``, ``mooncake.mooncake_config``, ...) with thin modules re-exporting the
``kvferry.mooncake`` modules (same objects:
``mooncake.engine.TransferEngine is kvferry.mooncake.engine.TransferEngine``); the others with a
loader that raises ``MooncakeModuleUnavailable`` (a ModuleNotFoundError) naming why kvferry does
not provide the module and what to use. ``python -m mooncake.http_metadata_server`` runs
kvferry's module as ``__main__``. Names that are not in the 0.3.14 wheel get None from the
finder (Python's own ModuleNotFoundError); the ``mooncake`` alias package's ``__path__`` is
empty, so no other finder supplies half of a real Mooncake. docs/PYTHON.md lists every module.

Turned on by :func:`install` (``kvferry.install_mooncake_shim()``), or at interpreter start
by ``KVFERRY_MOONCAKE_SHIM=1`` through the ``kvferry-mooncake-shim.pth`` file the wheel
installs in site-packages.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any, Optional, Sequence

from kvferry import _mooncake_modules as _modules

_ALIASES = _modules.SERVED
_lock = threading.Lock()


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return None  # a fresh module; exec_module fills it

    def get_code(self, fullname: str) -> Any:
        """For ``python -m mooncake.X``: runpy executes this code as ``__main__``; it runs the
        kvferry module as ``__main__`` in turn (same argv)."""
        src = "import runpy\nrunpy.run_module(%r, run_name='__main__', alter_sys=True)\n" % self.target
        return compile(src, "<kvferry shim for %s>" % fullname, "exec")

    def is_package(self, fullname: str) -> bool:
        return fullname in _modules.PACKAGES

    def exec_module(self, module: ModuleType) -> None:
        real = importlib.import_module(self.target)
        names = getattr(real, "__all__", None) or [n for n in vars(real) if not n.startswith("_")]
        for n in names:
            setattr(module, n, getattr(real, n))
        for n in _modules.PRIVATE_EXPORTS.get(module.__name__, ()):
            setattr(module, n, getattr(real, n))
        module.__all__ = list(names)  # type: ignore[attr-defined]
        module.__doc__ = real.__doc__
        module.__kvferry_target__ = self.target  # type: ignore[attr-defined]
        if hasattr(real, "__getattr__"):
            module.__getattr__ = real.__getattr__  # type: ignore[attr-defined]


class _RefusedLoader(importlib.abc.Loader):
    """A module of Mooncake 0.3.14 kvferry does not provide: importing it raises
    MooncakeModuleUnavailable (a ModuleNotFoundError) saying why and what to use."""

    def __init__(self, why: str) -> None:
        self.why = why

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        raise _modules.MooncakeModuleUnavailable(_modules.message(spec.name, self.why), name=spec.name)

    def exec_module(self, module: ModuleType) -> None:  # never reached: create_module raised
        raise _modules.MooncakeModuleUnavailable(_modules.message(module.__name__, self.why), name=module.__name__)


class MooncakeShimFinder(importlib.abc.MetaPathFinder):
    """Resolves ``mooncake`` and the ``mooncake.*`` modules kvferry provides to kvferry, and
    the other modules of Mooncake 0.3.14's wheel to a loader that refuses them with the reason."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname in _ALIASES:
            package = fullname in _modules.PACKAGES
            spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(_ALIASES[fullname]), is_package=package)
            if package:
                spec.submodule_search_locations = []
            return spec
        why = _modules.refusal(fullname)
        if why is not None:
            # A spec whose loader raises: find_spec() says the module exists (it is one of
            # the 0.3.14 wheel's), and `import` fails with the reason instead of Python's
            # bare "No module named ...".
            return importlib.machinery.ModuleSpec(fullname, _RefusedLoader(why))
        # Names that are not in Mooncake 0.3.14's wheel: a finder answers None for names it
        # does not serve (importlib.util.find_spec gets None; `import` raises Python's own
        # ModuleNotFoundError).
        return None


def installed() -> bool:
    """True when the finder is on sys.meta_path."""
    return any(isinstance(f, MooncakeShimFinder) for f in sys.meta_path)


def install() -> None:
    """Makes ``import mooncake.engine`` resolve to kvferry (idempotent). Modules named
    ``mooncake`` imported earlier (e.g. an official Mooncake) are dropped from sys.modules so
    later imports get kvferry's."""
    with _lock:
        if not installed():
            sys.meta_path.insert(0, MooncakeShimFinder())
        for name in [n for n in sys.modules if n == "mooncake" or n.startswith("mooncake.")]:
            mod = sys.modules.get(name)
            if mod is not None and getattr(mod, "__kvferry_target__", None) is None:
                del sys.modules[name]


def uninstall() -> None:
    """Removes the finder and kvferry's ``mooncake`` aliases from sys.modules."""
    with _lock:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, MooncakeShimFinder)]
        for name in [n for n in sys.modules if n == "mooncake" or n.startswith("mooncake.")]:
            if getattr(sys.modules.get(name), "__kvferry_target__", None) is not None:
                del sys.modules[name]


def _install_from_pth() -> None:
    """Called by kvferry-mooncake-shim.pth when KVFERRY_MOONCAKE_SHIM is set."""
    try:
        install()
    except Exception as e:  # never break interpreter start-up
        sys.stderr.write("kvferry: KVFERRY_MOONCAKE_SHIM is set but the shim could not be installed: %s\n" % e)
