"""The card model's fitted constants (engine/plan/card_model.py), written by
`python -m quant_serve.engine.plan.card_refit bench/results --write`; tests/engine/plan/test_card_model.py refits them
from the committed runs named in each `source`."""
from quant_serve.engine.plan.card_step import CardParams

FITTED = {
    "sm90": CardParams(
        eta_mem=0.95,
        eta_tc={"fp16_f32acc": 0.71, "fp16": 0.71, "int8": 0.71, "fp8": 0.71},
        sm_bytes={"fp16": 15.73, "int4": 17.09, "attn_fp16": 14.05, "attn_fp8": 7.685, "gguf_q4_k": 9.983,
        "gguf_q5_k": 10.69, "gguf_q6_k": 9.248, "gguf_q8_0": 5.083},
        sm_ops={"mma": 655.9, "wgmma": 2281, "mma:gguf_q4_0": 570.8, "mma:gguf_q4_k": 383.2, "mma:gguf_q5_k": 317.8,
        "mma:gguf_q6_k": 309.9},
        launch_us=4.607, small_us=5.262, step_us=0.001,
        source=('e2e-gguf-before-probe-fix-h200.json (61c12a79f627); ' 'e2e-gguf-h100.json (4ae45ab); '
        'e2e-gguf-q5-h100.json (a58e592); ' 'e2e-gguf-q8-h100.json (1ad1e0b); ' 'e2e-h200.json (ea9d457); '
        'e2e-qwen-fp8-h200.json (6938874ec34e); ' 'kernels-gguf-q4k-h100.json (d6f3e1ce87dd); '
        'kernels-gguf-q5k-frag-h100.json (a58e592); ' 'kernels-gguf-q6k-frag-h100.json (b73e2ffad5a7); '
        'kernels-gguf-q8-h100.json (1ad1e0b); ' 'kernels-h200.json (19dfdc495fe4)'),
        derived={},
    ),
    "sm86": CardParams(
        eta_mem=0.95,
        eta_tc={"fp16_f32acc": 0.71, "fp16": 0.71, "int8": 0.71, "fp8": 0.71},
        sm_bytes={"fp16": 15.85, "int4": 29.08, "attn_fp16": 26.29, "attn_fp8": 10.33, "gguf_q4_k": 9.983,
        "gguf_q5_k": 10.69, "gguf_q6_k": 9.248, "gguf_q8_0": 5.083},
        sm_ops={"mma": 1574, "mma:gguf_q4_0": 570.8, "mma:gguf_q4_k": 383.2, "mma:gguf_q5_k": 317.8,
        "mma:gguf_q6_k": 309.9},
        launch_us=5.492, small_us=4.919, step_us=12.25,
        source=('e2e-sm86-profile-h200.json (6938874ec34e); ' 'kernels-sm86-profile-h200.json (19dfdc495fe4)'),
        derived={"eta_mem": 'the sm90 fit (one GPU ran this plan)', "eta_tc": 'the sm90 fit (one GPU ran this plan)',
        "sm_bytes:gguf_q4_k": 'the sm90 fit (no runs of it under this plan)',
        "sm_bytes:gguf_q5_k": 'the sm90 fit (no runs of it under this plan)',
        "sm_bytes:gguf_q6_k": 'the sm90 fit (no runs of it under this plan)',
        "sm_bytes:gguf_q8_0": 'the sm90 fit (no runs of it under this plan)',
        "sm_ops:mma:gguf_q4_0": 'the sm90 fit (no runs of it under this plan)',
        "sm_ops:mma:gguf_q4_k": 'the sm90 fit (no runs of it under this plan)',
        "sm_ops:mma:gguf_q5_k": 'the sm90 fit (no runs of it under this plan)',
        "sm_ops:mma:gguf_q6_k": 'the sm90 fit (no runs of it under this plan)'},
    ),
}
