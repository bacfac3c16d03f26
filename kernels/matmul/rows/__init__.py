"""The row layout (bf16 and odd shapes) and its GEMV / GEMM kernels."""
