"""The W4A8 wing: INT4 weights times activations quantized on the fly to int8, multiplied on integer tensor cores
with integer accumulation and the scales applied per group (llama.cpp's MMQ and QServe's W4A8 do the same).

    reference.py   the torch twin: activation quantization and the exact integer matmul it defines
"""
