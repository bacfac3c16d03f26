"""The W4A16 wing: INT4-weight x FP16/BF16-activation matmuls and the layouts they read.

Which kernel runs for a layer and a batch is decided in one place, `plan.py` (`plan_w4a16`), from the GPU's
capability record (kernels/gpu.py) and the engine's kernel options; `quant-serve kernels --explain` prints it.

Zero points come in four kinds, one constexpr in every kernel (ZP_MODE in the fragment kernels, HAS_ZEROS /
OFFSETS in the row-layout ones): symmetric (z = 8), packed integer zeros (AWQ, GPTQ, compressed-tensors:
(q - z) * s), float per-group offsets (GGUF Q4_0 / Q4_1: q * s + o), carried by W4A16Weights.offsets /
FragWeights.offsets in the scales' layout, and GGUF Q4_K's two-level scales as stored (kquant.py: int16 sub-codes
as the scales, `superscales` per 256 weights).

    reference.py   the standard internal INT4 layout every checkpoint format converts into, and the torch twin
    rows.py        the row layout (bf16 and odd shapes): a byte repack of the standard layout
    kquant.py      GGUF Q4_K's two-level scales (sub-codes, super-scales), their twin and byte count
    frag.py        the fragment layout (fp16, N % 16 == 0): each int32 word holds one tensor-core A fragment
    rules.py       the measured tile rules and tables per GPU family (configs for each kernel family)
    plan.py        plan_w4a16: kernel + config + why, the layout choice, the on-device probes
    dispatch.py    the entry points: prepare_kernel_weights (at load), w4a16_matmul / w4a16_forward (per call)
    rows_gemv.py   row layout, few rows: CUDA-core GEMV with split-K
    rows_gemm.py   row layout, more rows: tensor-core tiles (Triton), and the dequantize pass + cuBLAS
    frag_tiles.py  fragment layout: tile loads and the in-register dequantize shared by the kernels below
    mma.py         fragment layout, M = 1..64: mma.sync (sm80+), wgmma variant (sm90)
    mma_steps.py   the unrolled mma.sync main-loop steps
    wgmma.py       Hopper wgmma steps
    tma.py         fragment layout, M = 17..4096 on sm90: TMA-fed wgmma on a stream-K grid
    splitk.py      split-K partial buffers and their reduce pass
    streamk.py     the stream-K plan and its reduce pass
    fold_tiles.py  the decode step's RMSNorm / residual pieces that run inside the mma kernel
    fold.py        batch-1 launchers of the matmul with the norm folded in (w4a16_residual / w4a16_normed)
    sweep.py       the search space bench/kernel_speed.py --tune times
"""
