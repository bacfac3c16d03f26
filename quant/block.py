"""What the calibrated quantizers (AWQ, GPTQ) need from a model: a decoder block they can observe stage by stage.

quant keeps the algorithms; the model definition is the engine's (engine/models/dense_calib.py implements these
protocols with engine/models/decoder.py's layers), handed in by server/cli/quantize.py, so that one decoder serves
both serving and calibration and quant still imports nothing from engine.

Every stage takes w, the block's checkpoint-named fp32 weights ("self_attn.q_proj.weight", "input_layernorm.weight",
...): the quantizers change them (AWQ folds scales into norms and rows, tries fake-quantized candidates; GPTQ swaps
in dequantized linears) and the block computes with whatever w holds at the call. Activations are [S, L, *]
(calibration sequences, tokens):
    a = attn_input(w, x)          input of the q/k/v linears
    o = attn_core(w, a)           input of o_proj
    h, m = mlp_input(w, x, o)     residual stream after attention, input of gate/up
    d = mlp_act(w, m)             input of down
    y = block_output(w, h, d)     the block's output
"""
from typing import Callable, Protocol

import torch


class CalibBlock(Protocol):
    qkv: list[str]                  # the linears reading attn_input's output (q, k, v; or Phi-3's fused qkv_proj)
    o: str                          # reads attn_core's output
    gate_up: list[str]              # read mlp_input's m
    down: str                       # reads mlp_act's output
    qkv_norm: str                   # the norm whose output feeds `qkv` (AWQ folds their input scales into it)
    gate_up_norm: str               # the norm whose output feeds `gate_up`
    v_rows: tuple[str, slice]       # the linear rows that produce o's input channels (AWQ's v -> o fold)
    up_rows: tuple[str, slice]      # the linear rows that multiply into down's input channels (up -> down fold)

    def attn_input(self, w: dict, x: torch.Tensor) -> torch.Tensor: ...
    def attn_core(self, w: dict, a: torch.Tensor) -> torch.Tensor: ...
    def attn_output(self, w: dict, a: torch.Tensor) -> torch.Tensor: ...      # o_proj(attn_core(a))
    def mlp_input(self, w: dict, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def mlp_act(self, w: dict, m: torch.Tensor) -> torch.Tensor: ...
    def mlp_output(self, w: dict, m: torch.Tensor) -> torch.Tensor: ...       # down(mlp_act(m))
    def block_output(self, w: dict, h: torch.Tensor, d: torch.Tensor) -> torch.Tensor: ...
    def forward(self, w: dict, x: torch.Tensor) -> torch.Tensor: ...

    def fold_norm(self, w: dict, name: str, s: torch.Tensor) -> None:
        """Divide norm `name`'s output by s [H] in w (the norm's own weight convention: Gemma's is 1 + w)."""


class CalibModel(Protocol):
    num_layers: int

    def embed(self, ids: torch.Tensor, device) -> torch.Tensor:
        """ids [S, L] -> the first block's input [S, L, H] fp32 on device."""

    def block(self, index: int, seq_len: int, device) -> CalibBlock:
        """Decoder block `index`, for sequences of seq_len tokens, computing on device."""

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's output [S, L, H] -> the lm_head's input."""


def chunked(fn: Callable, *tensors: torch.Tensor, chunk: int) -> torch.Tensor:
    """fn over slices of dim 0 (calibration sequences), concatenated: bounds the transient activations."""
    outs = [fn(*(t[i:i + chunk] for t in tensors)) for i in range(0, tensors[0].shape[0], chunk)]
    return torch.cat(outs)


def gram(x: torch.Tensor, chunk_tokens: int = 8192) -> torch.Tensor:
    """x [..., K] -> X^T X [K, K] fp32 summed over every token, accumulated in chunks."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float32, device=x.device)
    for i in range(0, flat.shape[0], chunk_tokens):
        part = flat[i:i + chunk_tokens].float()
        out.addmm_(part.t(), part)
    return out
