"""KV-cache memory and step cost: the calculator (`kvjax memory`) and the planner that fits
a model, a cache and a mesh into device memory (`kvjax memory --plan`)."""

from kvjax.memory.calculator import (
    ASSUMPTIONS,
    StepCost,
    human_bytes,
    kv_bytes,
    kv_bytes_paged,
    num_params,
    param_counts,
    report,
    step_cost,
    windowed_pages,
)

__all__ = ["ASSUMPTIONS", "StepCost", "human_bytes", "kv_bytes", "kv_bytes_paged", "num_params",
           "param_counts", "report", "step_cost", "windowed_pages"]
