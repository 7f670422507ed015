"""The allocator and OpenMP settings vLLM's CPU build runs with, for the benchmarks (and users who
want them): tcmalloc preloaded, OpenMP threads bound to cores. Nothing is installed system-wide.

``tcmalloc_path`` fetches Debian's ``libtcmalloc-minimal4`` with ``apt-get download`` and unpacks it
into a cache directory (``dpkg-deb -x``), once; ``preload_env`` gives the environment a child process
needs (``LD_PRELOAD`` must be set before a process starts: the dynamic loader reads it once).
docs/performance.md ("Allocator and threads") has what they measured.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

PACKAGE = "libtcmalloc-minimal4"
LIBRARY = "libtcmalloc_minimal.so.4"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hf_paged_attn" / "tcmalloc"


def tcmalloc_path(cache_dir: Path | None = None) -> Path | None:
    """The unpacked ``libtcmalloc_minimal.so.4`` (fetched on first use), or None where apt-get or
    dpkg-deb is missing or the download fails (not a Debian-like system, offline)."""
    cache_dir = cache_dir or default_cache_dir()
    found = next(cache_dir.rglob(LIBRARY), None) if cache_dir.exists() else None
    if found is not None:
        return found
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, check=True, capture_output=True, timeout=120)
            deb = next(Path(tmp).glob("*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), str(cache_dir)], check=True, capture_output=True, timeout=60)
        except (subprocess.SubprocessError, StopIteration, OSError):
            return None
    return next(cache_dir.rglob(LIBRARY), None)


def preload_env(env: dict[str, str], allocator: str = "tcmalloc", bind: bool = False) -> dict[str, str]:
    """``env`` plus ``LD_PRELOAD`` of ``allocator`` ("tcmalloc", or "none") and, with ``bind``, OpenMP
    threads bound to cores (``OMP_PROC_BIND=close``, ``OMP_PLACES=cores``)."""
    env = dict(env)
    if allocator == "tcmalloc":
        path = tcmalloc_path()
        if path is None:
            raise RuntimeError(f"could not fetch {PACKAGE} (apt-get download) to preload tcmalloc")
        env["LD_PRELOAD"] = ":".join(p for p in (str(path), env.get("LD_PRELOAD", "")) if p)
    if bind:
        env.setdefault("OMP_PROC_BIND", "close")
        env.setdefault("OMP_PLACES", "cores")
    return env
