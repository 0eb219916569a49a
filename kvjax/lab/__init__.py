"""`kvjax run`: the experiment registry, the runner (sweeps, seeds, resume), the results
folder and its report, progress, and the workloads experiments and benchmarks share."""
