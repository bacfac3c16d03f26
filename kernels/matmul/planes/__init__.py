"""The W8A16 wing: int8-code weights x FP16/BF16 activations (GGUF Q8_0, Q5_*, Q6_K load here without
re-quantizing; a layer of Q6_K or of Q5_K shards keeps its file's bits in code planes).

    reference.py   the internal layout (int8 [K, N], scales / offsets [G, N]) and the torch twin
    plan.py        plan_w8a16: kernel + tile + why (`quant-serve kernels --explain --weight-format w8`)
    kernels.py     the Triton kernels: split-K GEMV (M <= 16) and the dequantize pass before cuBLAS
    q6k.py         GGUF Q6_K at 6 bits (code planes, int8 sub-scales, fp16 d), read by the same kernels (Q6)
    q5k.py         GGUF Q5_K at 5 bits (code planes, Q4_K's two-level scales), read by the same kernels (Q5); its
                   chunk decoder and GEMV K loop (Triton) live there
    dispatch.py    w8a16_matmul: the twin on CPU, the planned kernel on CUDA
"""
