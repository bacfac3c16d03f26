"""Fixes for running these kernels under TRITON_INTERPRET=1 (the CPU tests) with triton 3.6 and numpy >= 2.4.

Used by tests only; it changes nothing outside the interpreter. Three interpreter defects, each seen on these
kernels:
  - runtime loop bounds become ints through int(1-element array), which numpy >= 2.4 refuses;
  - float down-casts (fp32 -> bf16/fp8) truncate and never carry into the exponent; the GPU rounds to nearest
    even, so every interpreter cast is routed through torch's conversion instead;
  - tl.dot on bf16 multiplies the raw uint16 bit patterns.
"""
import numpy as np
import torch

_TORCH_FLOAT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
_TORCH_BITS = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


def _convert_float(data, src_dtype, dst_dtype, rounding_mode):
    """Bit patterns of src_dtype (numpy) -> bit patterns of dst_dtype, rounded as the GPU does (RTNE)."""
    raw = np.ascontiguousarray(data)
    bits = torch.from_numpy(raw.view(getattr(np, f"int{src_dtype.primitive_bitwidth}")).copy()
                            if src_dtype.primitive_bitwidth > 8 else raw.view(np.uint8).copy())
    values = bits.view(_TORCH_FLOAT[src_dtype.name]).to(_TORCH_FLOAT[dst_dtype.name])
    out = values.view(_TORCH_BITS[dst_dtype.primitive_bitwidth]).numpy()
    return out.view(getattr(np, f"uint{dst_dtype.primitive_bitwidth}")).reshape(raw.shape)


def patch_triton_interpreter() -> None:
    from triton import language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_quant_serve_patched", False):
        return
    interpreter._quant_serve_patched = True
    interpreter._convert_float = _convert_float

    original_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor

    builder = interpreter.InterpreterBuilder
    original_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype.scalar != tl.bfloat16:
                return h
            return interpreter.TensorHandle(_convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32),
                                            tl.float32)
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
