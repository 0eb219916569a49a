"""kvjax's own CPU kernels, built with the system C++ compiler on first use (build.py, host)
and called from JAX through XLA's FFI (product.py)."""
