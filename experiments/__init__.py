"""The shipped experiments, one module each (`kvjax run configs/<name>.toml`), and their
shared helpers (`common.py`). See `kvjax.lab.registry` for the interface a module exposes."""
