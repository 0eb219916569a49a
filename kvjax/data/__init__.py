"""Real workloads from packages on the index: ShareGPT conversations and MT-Bench
questions, as chat messages (host code: no JAX).

    conversations = kvjax.data.sharegpt(64, min_turns=2, seed=0)
    questions = kvjax.data.mtbench(categories=["coding", "math"])
    conversations[0].messages  # [{"role": "user", "content": ...}, ...]

A missing package is a `DataNotInstalledError` naming the install command
(`scripts/_setup.sh` installs both); a truncated or malformed file gives the complete
records before the damage, with what was dropped counted (`Loaded.dropped`).
"""

from kvjax.data.chat import Conversation, Loaded
from kvjax.data.mtbench import CATEGORIES, mtbench
from kvjax.data.sharegpt import sharegpt
from kvjax.data.sources import SOURCES, DataNotInstalledError, DataSource

__all__ = ["CATEGORIES", "SOURCES", "Conversation", "DataNotInstalledError", "DataSource",
           "Loaded", "mtbench", "sharegpt"]
