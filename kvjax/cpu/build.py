"""Builds kvjax's CPU kernel library with the system C++ compiler: plain Python, no JAX.

The library is compiled for the CPU it runs on (`-march=native`) and cached under
`KVJAX_KERNEL_CACHE` (default `kernels` in `kvjax.backend.cache_home()`) by a digest of the
sources, the compiler, its flags, the CPU's features and the jaxlib version whose FFI
headers it was built against: any of them changed, a new library is built; the same, the
cached one loads at once (and is marked used). A new build drops the libraries no process
took for `STALE_DAYS` (older kvjax or jaxlib versions) and temporary files a killed build
left. Builds write a temporary file and rename it, so processes racing on a cold cache
(pytest workers) each end with a whole library. Where no compiler is found, or it fails,
`build` says why and kvjax runs its pure-JAX products and attention
(`kvjax.cpu.product.kernel`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kvjax.backend import cache_home

SOURCES = tuple(Path(__file__).with_name(name) for name in ("product.cc", "attention.cc"))
HEADERS = (Path(__file__).with_name("split.h"),)  # part of the digest, not compiled alone
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
COMPILE_SECONDS = 300
STALE_DAYS = 30  # a library no process took for this long is dropped by the next build


@dataclasses.dataclass(frozen=True)
class Build:
    path: Path | None  # the library, or None when it could not be built
    reason: str  # what was done ("cached", "built in 4.1 s") or why there is no library


def cpu_features() -> str:
    """The CPU's model and feature flags (what `-march=native` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    lines = [ln.split(":", 1)[1].strip() for ln in text.splitlines()
             if ln.startswith(("flags", "model name", "Features")) and ":" in ln]
    return "\n".join(sorted(set(lines)))


def compiler(environ=os.environ) -> str | None:
    """The C++ compiler: $CXX, else c++ or g++ on the PATH; None when there is none."""
    path = environ.get("PATH", os.defpath)
    if environ.get("CXX"):
        return shutil.which(environ["CXX"], path=path)
    return shutil.which("c++", path=path) or shutil.which("g++", path=path)


def cache_dir(environ=os.environ) -> Path:
    return Path(environ.get("KVJAX_KERNEL_CACHE") or cache_home(environ) / "kernels")


def drop_stale(folder: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Removes from `folder` the libraries other than `keep` last used (modified: a cache
    hit touches its library) over `STALE_DAYS` ago, and temporary files of builds over a
    day old; returns what it removed. A process that loaded a removed library keeps its
    mapping."""
    now = time.time() if now is None else now
    gone = []
    for path in folder.glob("*.so"):
        with contextlib.suppress(OSError):  # another process may rename or remove it first
            age = now - path.stat().st_mtime
            stale = path.name.startswith("kvjax_cpu-") and age > STALE_DAYS * 86400
            if path != keep and (stale or (path.name.startswith("tmp") and age > 86400)):
                path.unlink()
                gone.append(path)
    return gone


def _version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(include_dir: str, jaxlib_version: str, environ=os.environ,
          extra_flags: tuple[str, ...] = ()) -> Build:
    """The kernel library for this machine, built or taken from the cache (module
    docstring); `include_dir` holds XLA's FFI headers (`jax.ffi.include_dir()`);
    `extra_flags` go after FLAGS (tests build narrower vector widths with them)."""
    flags = (*FLAGS, *extra_flags)
    cxx = compiler(environ)
    if cxx is None:
        return Build(None, "no C++ compiler found ($CXX, c++, g++)")
    key = hashlib.sha256("\0".join([
        *(source.read_text() for source in SOURCES + HEADERS), cxx, _version(cxx),
        " ".join(flags), cpu_features(),
        jaxlib_version]).encode()).hexdigest()[:20]
    path = cache_dir(environ) / f"kvjax_cpu-{key}.so"
    if path.exists():
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: `drop_stale` keeps it
        return Build(path, "cached")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    except OSError as e:
        return Build(None, f"cannot write the kernel cache {path.parent}: {e}")
    os.close(fd)
    cmd = [cxx, *flags, "-I", include_dir, "-o", tmp, *map(str, SOURCES)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_SECONDS)
    except (OSError, subprocess.SubprocessError) as e:
        os.unlink(tmp)
        return Build(None, f"{cxx} failed to run: {e}")
    if done.returncode != 0:
        os.unlink(tmp)
        return Build(None, f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    os.replace(tmp, path)
    drop_stale(path.parent, path)
    return Build(path, "built")
