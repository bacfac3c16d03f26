"""The adapters an engine serves: their names and ids, the --max-loras device slots they occupy, and the slot of
each token row of a step (the LoRABatch every LoRALinear of the model reads).

An adapter's id is never reused (1, 2, ...; 0 is the base): the prefix cache keys blocks by it, so blocks written
under an unloaded adapter can never be hit by a later one loaded into the same slot.
"""
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from quant_serve.engine.lora.adapter import load_adapter
from quant_serve.engine.worker.transfer import to_device
from quant_serve.quant.layers.lora import LoRABatch, LoRALinear

logger = logging.getLogger("quant_serve")
WRAPPED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass
class LoadedAdapter:
    name: str
    path: str
    lora_id: int
    slot: int
    rank: int


class LoRAManager:
    def __init__(self, model, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device):
        if max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {max_lora_rank}")
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.device = torch.device(device)
        self.fused_checkpoint = model.config.fused_checkpoint
        self.batch = LoRABatch()
        self.layers: dict[str, LoRALinear] = wrap_model(model, max_loras, max_lora_rank, self.batch, dtype, device)
        self.adapters: dict[str, LoadedAdapter] = {}
        self._slots: list[str | None] = [None] * max_loras
        self._next_id = 1

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        """Reads, checks and places an adapter in a free slot (ValueError naming the problem otherwise)."""
        if not name or name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded" if name else "a LoRA adapter needs a name")
        if None not in self._slots:
            raise ValueError(f"cannot load LoRA adapter {name!r}: all {self.max_loras} slots (--max-loras) hold "
                             f"adapters ({', '.join(self.adapters)}); unload one first")
        shapes = {key: (layer.in_features, layer.output_sizes) for key, layer in self.layers.items()}
        adapter = load_adapter(name, path, self.max_lora_rank, self.fused_checkpoint, shapes, self.device)
        slot = self._slots.index(None)
        for key, layer in self.layers.items():
            parts = adapter.modules.get(key, {})
            layer.set_slot(slot, [parts.get(i) for i in range(len(layer.output_sizes))])
        self._slots[slot] = name
        loaded = LoadedAdapter(name, str(path), self._next_id, slot, adapter.rank)
        self._next_id += 1
        self.adapters[name] = loaded
        return loaded

    def unload(self, name: str, users: int = 0) -> None:
        """users: unfinished requests that run under it (refused while there are any)."""
        loaded = self.get(name)
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
        for layer in self.layers.values():
            layer.clear_slot(loaded.slot)
        self._slots[loaded.slot] = None
        del self.adapters[name]

    def get(self, name: str) -> LoadedAdapter:
        if name not in self.adapters:
            known = ", ".join(self.adapters) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {known})")
        return self.adapters[name]

    def slot_of_id(self) -> dict[int, int]:
        return {a.lora_id: a.slot for a in self.adapters.values()}

    def step_slots(self, scheduled) -> torch.Tensor | None:
        """The slot of each token row of a step (its entries in order, num_new_tokens rows each): [T] int32 on the
        device, or None when no entry has an adapter. The runner sets it as batch.slots right before the forward."""
        if not any(item.seq.lora_id for item in scheduled):
            return None
        slot_of = self.slot_of_id()
        rows = []
        for item in scheduled:
            slot = slot_of[item.seq.lora_id] if item.seq.lora_id else -1
            rows += [slot] * item.num_new_tokens
        return to_device(rows, torch.int32, self.device)


def start(model, config, dtype: torch.dtype, device) -> LoRAManager:
    """An engine's LoRA (EngineConfig with lora.enable_lora): the model's layers wrapped (after load and the
    activation plan, which see the base layers), --lora-modules loaded. CUDA graphs go off: a captured graph would
    freeze the rows' adapter slots."""
    if not config.enforce_eager:
        logger.info("--enable-lora: CUDA graphs off (steps run eagerly)")
        config.enforce_eager = True
    manager = LoRAManager(model, config.lora.max_loras, config.lora.max_lora_rank, dtype, device)
    for name, path in config.lora.lora_modules.items():
        loaded = manager.load(name, path)
        logger.info("LoRA adapter %s (rank %d) from %s in slot %d", name, loaded.rank, path, loaded.slot)
    return manager


def require(manager: LoRAManager | None, verb: str) -> LoRAManager:
    if manager is None:
        raise ValueError(f"cannot {verb} a LoRA adapter: this engine was started without --enable-lora")
    return manager


def lora_id(manager: LoRAManager | None, name: str | None) -> int:
    """The id a request's lora_name runs under (0: the base)."""
    if not name:
        return 0
    if manager is None:
        raise ValueError(f"LoRA adapter {name!r} requested, but this engine serves none (start it with "
                         "--enable-lora)")
    return manager.get(name).lora_id


def wrap_model(model, max_loras: int, max_rank: int, batch: LoRABatch, dtype, device) -> dict[str, LoRALinear]:
    """Swaps every decoder layer's qkv, o, gate_up and down projection for a LoRALinear around it (after load and
    the activation plan, which see the base layers). -> the wrappers by module name."""
    wrapped = {}
    for i, layer in enumerate(model.model.layers):
        for path in WRAPPED:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            wrapper = LoRALinear(getattr(owner, attr), max_loras, max_rank, batch, dtype, device)
            setattr(owner, attr, wrapper)
            wrapped[f"model.layers.{i}.{path}"] = wrapper
    return wrapped
