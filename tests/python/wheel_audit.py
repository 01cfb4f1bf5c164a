"""What a built wheel links: every ELF file in it, its dynamic dependencies (DT_NEEDED, read
with binutils' `readelf -d`), and whether the wheel's platform tag is honest.

A wheel passes when
  - no ELF in it needs a CUDA library (libcuda, libcudart, libnvidia*, ...) or a verbs/RDMA
    one (libibverbs, librdmacm, libmlx*): kvferry loads libcuda.so.1 and libibverbs.so.1 with
    dlopen when asked, so one wheel serves CUDA 12, CUDA 13 and CPU-only hosts;
  - every DT_NEEDED is on the manylinux allow-list of each platform tag in the file name
    (auditwheel's own policy file, so the list is the one PyPI's tools enforce);
  - `auditwheel show` finds the wheel consistent with a manylinux tag no newer than the one
    in its file name (the glibc symbol versions it uses are covered by its claim).

Used by tests/python/test_packaging.py (the built wheel, and deliberately bad wheels to prove
it fails), and runnable alone: `python tests/python/wheel_audit.py WHEEL...` prints the
report and exits 1 naming every problem (the aarch64 cross-build script uses it so).
Needs `readelf` (Debian: binutils) and auditwheel (pip; scripts/python-test installs both).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# Libraries a kvferry wheel must never link (prefixes of DT_NEEDED names).
CUDA = ("libcuda.", "libcudart", "libnvidia", "libcublas", "libnccl", "libnvrtc", "libcupti")
VERBS = ("libibverbs", "librdmacm", "libmlx", "libefa", "libionic")
# The dynamic loader itself is no library dependency (auditwheel treats it apart as well).
LOADERS = re.compile(r"^ld-linux(-x86-64|-aarch64)?\.so\.\d+$|^ld64\.so\.\d+$")


def readelf_needed(path: str) -> List[str]:
    """DT_NEEDED of one ELF file, as binutils' readelf reads them."""
    exe = shutil.which("readelf")
    if exe is None:
        raise RuntimeError("readelf not found: install binutils (scripts/test does)")
    r = subprocess.run([exe, "-d", "-W", path], capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"), timeout=60)
    if r.returncode != 0:
        raise RuntimeError("readelf -d %s failed: %s" % (path, r.stderr.strip()))
    if "There is no dynamic section" in r.stdout:
        return []
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", r.stdout)


def wheel_elfs(wheel: str, into: str) -> Tuple[List[str], Dict[str, List[str]]]:
    """(every file in the wheel, {ELF member: its DT_NEEDED}); ELFs found by their magic,
    whatever their name. Members are extracted under `into`."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        elfs = {}
        for n in names:
            if n.endswith("/"):
                continue
            with z.open(n) as f:
                if f.read(4) != b"\x7fELF":
                    continue
            elfs[n] = readelf_needed(z.extract(n, into))
    return names, elfs


def platform_tags(wheel: str) -> List[str]:
    """The platform tags of a wheel file name (`a.b.c` compressed sets are split)."""
    stem = os.path.basename(wheel)[: -len(".whl")]
    return stem.split("-")[-1].split(".")


def _policies() -> list:
    import auditwheel  # installed by scripts/python-test

    with open(Path(auditwheel.__file__).parent / "policy" / "manylinux-policy.json") as f:
        return json.load(f)


def _glibc(tag: str) -> Optional[Tuple[int, int, str]]:
    """manylinux_2_34_x86_64 -> (2, 34, 'x86_64'); legacy aliases too; None if not manylinux."""
    legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
    m = re.match(r"^manylinux_(\d+)_(\d+)_(.+)$", tag)
    if m:
        return int(m.group(1)), int(m.group(2)), m.group(3)
    m = re.match(r"^(manylinux1|manylinux2010|manylinux2014)_(.+)$", tag)
    if m:
        return legacy[m.group(1)] + (m.group(2),)
    return None


def allowed_libs(tag: str) -> Optional[set]:
    """The manylinux allow-list (auditwheel's policy) for one platform tag; None if unknown."""
    g = _glibc(tag)
    if g is None:
        return None
    name = "manylinux_%d_%d" % g[:2]
    for p in _policies():
        if p["name"] == name or name in p.get("aliases", []):
            return set(p["lib_whitelist"])
    return None


def auditwheel_show(wheel: str) -> dict:
    """`auditwheel show --json WHEEL` as a dict (raises with its output when it fails)."""
    cmd = [sys.executable, "-m", "auditwheel", "show", "--json", wheel]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    try:
        return json.loads(r.stdout)
    except ValueError:
        raise RuntimeError("auditwheel show failed (rc %d): %s %s" % (r.returncode, r.stdout, r.stderr))


def audit(wheel: str) -> Tuple[dict, List[str]]:
    """(report, problems): problems is empty when the wheel passes; each names what is wrong."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="kvf-wheel-") as tmp:
        names, elfs = wheel_elfs(wheel, tmp)
    tags = platform_tags(wheel)
    report = {"wheel": os.path.basename(wheel), "files": names, "elf_needed": elfs, "platform_tags": tags}
    if not elfs:
        problems.append("no ELF file in the wheel (not a platform wheel?)")
    for member, needed in sorted(elfs.items()):
        for lib in needed:
            if lib.startswith(CUDA):
                problems.append("%s needs %s: a CUDA library (kvferry must load libcuda.so.1 at run time, never link CUDA)" % (member, lib))
            elif lib.startswith(VERBS):
                problems.append("%s needs %s: a verbs/RDMA library (kvferry must load libibverbs.so.1 at run time, never link it)" % (member, lib))
            elif LOADERS.match(lib):
                continue
            else:
                for tag in tags:
                    allow = allowed_libs(tag)
                    if allow is None:
                        problems.append("%s: platform tag %s is not a manylinux tag" % (os.path.basename(wheel), tag))
                    elif lib not in allow:
                        problems.append("%s needs %s, which is not on the %s allow-list (not a manylinux library)" % (member, lib, tag))
    if elfs:
        show = auditwheel_show(wheel)
        report["auditwheel"] = {k: show.get(k) for k in ("overall_tag", "sym_tag", "external_libs", "error")}
        found = _glibc(show.get("overall_tag") or "")
        if found is None:
            problems.append("auditwheel show: the wheel is consistent with no manylinux tag (%s; external libraries: %s; %s)"
                            % (show.get("overall_tag"), sorted(show.get("external_libs") or {}), show.get("error") or "no error"))
        else:
            for tag in tags:
                claim = _glibc(tag)
                if claim is None:
                    continue  # reported above
                if claim[2] != found[2]:
                    problems.append("platform tag %s names architecture %s, the ELF files are %s" % (tag, claim[2], found[2]))
                elif claim[:2] < found[:2]:
                    problems.append("platform tag %s claims glibc %d.%d, but auditwheel finds the wheel needs %s (newer glibc symbol versions)"
                                    % (tag, claim[0], claim[1], show.get("overall_tag")))
    return report, problems


def main(argv: List[str]) -> int:
    if not argv:
        print("usage: wheel_audit.py WHEEL...", file=sys.stderr)
        return 2
    rc = 0
    for w in argv:
        report, problems = audit(w)
        print(json.dumps(report, indent=2))
        for p in problems:
            print("wheel_audit: %s: %s" % (os.path.basename(w), p), file=sys.stderr)
        if problems:
            rc = 1
        else:
            print("wheel_audit: %s: ok (%d files, ELF: %s)" % (os.path.basename(w), len(report["files"]), ", ".join("%s -> %s" % (k, " ".join(v)) for k, v in report["elf_needed"].items())), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
