"""Native code eaglenest compiles itself: C built at first use with the system's C compiler into a
private cache, checked against its build record before it is loaded, and called through ctypes.

gemv.py (+ gemv.c): the row-invariant bf16 matrix-vector kernel that eval's verification installs
(evaluate/rowwise/linears.py).  Public entry: `gemv.load()` (the library, or why it cannot run here)
and `gemv.linear(x, weight, bias)`.
"""
