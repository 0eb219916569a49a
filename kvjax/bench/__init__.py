"""Benchmarks (`kvjax bench decode|prefix|peer|spec`) and the GPU device check: scripts that
warm up, take medians and compare side by side in one run."""
