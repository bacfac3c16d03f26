"""The activation path of each quantized linear layer: fp16 (W4A16 / W8A16: activations in the model's dtype) or
int8 (W4A8 / W8A8: quantized on the fly per token or per token and weight group; kernels/matmul/int8/). Resolved once at
load from KernelOptions.activation_dtype; "auto" becomes one explicit choice per layer, which the start-up log and
the eval report name."""
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from quant_serve.kernels.gpu import KernelOptions
from quant_serve.kernels.matmul.frag.layout import FragWeights
from quant_serve.kernels.matmul.int8.eligibility import int8_is_free
from quant_serve.kernels.matmul.int8.rules import w4a8_takes
from quant_serve.quant.layers.linear import QuantLinear
from quant_serve.quant.layers.w8 import W8Linear


def path_name(act_scale: str | None) -> str:
    """A layer's activation path as the log and the report name it."""
    return "fp16" if act_scale is None else f"int8/{act_scale}"


@dataclass
class ActivationPlan:
    """What --activation-dtype resolved to: the request and, per weight format, how many layers run each path."""
    requested: str
    act_scale: str
    layers: Counter = field(default_factory=Counter)     # (weight format, path name) -> quantized layers

    @property
    def paths(self) -> list[str]:
        return sorted({path for _, path in self.layers})

    def summary(self) -> str:
        """One short label: "int8/group", "fp16", or "mixed (...)"; "-" for a model without quantized layers."""
        paths = self.paths
        if not paths:
            return "-"
        if len(paths) == 1:
            return paths[0]
        by_path = Counter()
        for (_, path), n in self.layers.items():
            by_path[path] += n
        return "mixed (" + ", ".join(f"{path} x {n}" for path, n in sorted(by_path.items())) + ")"

    def describe(self) -> str:
        """The start-up log's line: the request, what it resolved to and why per weight format."""
        if not self.layers:
            return f"activations: {self.requested}: no quantized linear layers (float activations throughout)"
        parts = ", ".join(f"{fmt} x {n} -> {path}" for (fmt, path), n in sorted(self.layers.items()))
        note = (f" (int8 only where the weight format met the accuracy gate at {self.act_scale} scales: "
                "kernels/matmul/int8/eligibility.py)") if self.requested == "auto" else ""
        return f"activations: {self.requested} -> {self.summary()}: {parts}{note}"

    def to_json(self) -> dict:
        return {"requested": self.requested, "act_scale": self.act_scale, "resolved": self.summary(),
                "layers": [{"format": fmt, "path": path, "count": n} for (fmt, path), n in sorted(self.layers.items())]}


def layer_formats(layer: nn.Module) -> list[str]:
    """The weight formats a quantized layer holds: the checkpoint's method, "rtn" for the --quantize-lm-head
    copy, or "gguf:TYPE" for each GGUF type among its source tensors."""
    qc = layer.quant_config
    if qc is None:
        return ["rtn"]
    type_of = getattr(qc, "type_of", None)
    if type_of is not None:
        return sorted({f"gguf:{type_of(prefix).name}" for prefix in layer.source_prefixes})
    return [qc.method]


def resolve_act_scale(options: KernelOptions, formats: list[str], device: torch.device) -> str | None:
    """One layer's activation path: None (fp16) or the int8 scale granularity; "auto": int8 where the weight format
    met the accuracy gate (eligibility.py). On CUDA this is the layer's ceiling: the W4A8 plan runs int8 per call
    only where its kernel reads the weights, and under "auto" only in the M band where it pays (int8/rules.py)."""
    if options.activation_dtype == "fp16":
        return None
    if options.activation_dtype == "int8":
        return options.act_scale
    return options.act_scale if int8_is_free(formats, options.act_scale) else None


def gpu_int8_reads(layer: nn.Module) -> bool:
    """Whether a CUDA layer can run int8 activations at all: INT4 weights in the fragment layout that the W4A8
    kernel reads (8-bit codes and the row layout have no int8-activation kernel)."""
    packed = getattr(layer, "packed", None)
    return isinstance(packed, FragWeights) and not w4a8_takes(packed.zp_mode, packed.in_features, packed.group_size)


def check_activation_device(options: KernelOptions, device: str) -> None:
    """Before any weight loads: the activation options are ones the kernels know."""
    if options.activation_dtype not in ("auto", "fp16", "int8") or options.act_scale not in ("token", "group"):
        raise ValueError(f"activation_dtype {options.activation_dtype!r} / act_scale {options.act_scale!r}: "
                         "expected auto, fp16 or int8 / token or group")


def plan_activations(model: nn.Module, options: KernelOptions, device: torch.device | str) -> ActivationPlan:
    """Set each quantized layer's act_scale from the options and count what they resolved to."""
    device = torch.device(device)
    check_activation_device(options, str(device))
    plan = ActivationPlan(options.activation_dtype, options.act_scale)
    for layer in model.modules():
        if not isinstance(layer, (QuantLinear, W8Linear)):
            continue
        formats = layer_formats(layer)
        act_scale = resolve_act_scale(options, formats, device)
        if device.type == "cuda":           # the kernel plan decides per call; the CPU twin's switch stays off
            act_scale = act_scale if gpu_int8_reads(layer) else None
            if isinstance(getattr(layer, "packed", None), FragWeights):
                # only "auto" needs a per-layer word: fp16 where the format has not met the gate
                ineligible = options.activation_dtype == "auto" and act_scale is None
                layer.packed.activation_dtype = "fp16" if ineligible else None
        else:
            layer.act_scale = act_scale
        if isinstance(layer, QuantLinear) and layer.parts is not None:
            continue                    # its act-order parts are counted (and run) themselves
        plan.layers[(" + ".join(formats), path_name(act_scale))] += 1
    return plan
