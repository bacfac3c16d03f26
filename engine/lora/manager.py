"""The adapters an engine serves: their names and ids, the --max-loras device slots, and the slot of each token row
of a step (the LoRABatch every LoRALinear of the model reads).

Loaded adapters (--max-cpu-loras of them, --max-loras by default) keep their checked tensors in host memory; a step
places the ones its rows need into slots, evicting the least recently used adapter that the step does not need. The
scheduler admits at most --max-loras distinct adapters among the running sequences (SchedulerConfig.max_loras), so a
step's adapters always fit. On CUDA the copies into a slot are queued behind the forwards already launched, which
read the adapter they replace.

An adapter's id is never reused (1, 2, ...; 0 is the base): the prefix cache keys blocks by it, so blocks written
under an unloaded adapter can never be hit by a later one of the same name or slot.
"""
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from quant_serve.engine.lora.adapter import LoRAAdapter, load_adapter
from quant_serve.engine.worker.transfer import to_device
from quant_serve.quant.layers.lora import LoRABatch, LoRALinear

logger = logging.getLogger("quant_serve")
WRAPPED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass
class LoadedAdapter:
    name: str
    path: str
    lora_id: int
    rank: int
    weights: LoRAAdapter                  # checked tensors, in host memory
    slot: int | None = None               # its device slot, None while only the host holds it


class LoRAManager:
    def __init__(self, model, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device,
                 max_cpu_loras: int | None = None):
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {max_lora_rank}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"--max-cpu-loras ({max_cpu_loras}) must be at least --max-loras ({max_loras})")
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.device = torch.device(device)
        self.fused_checkpoint = model.config.fused_checkpoint
        self.batch = LoRABatch()
        self.layers: dict[str, LoRALinear] = wrap_model(model, max_loras, max_lora_rank, self.batch, dtype, device)
        self.adapters: dict[str, LoadedAdapter] = {}
        self._slots: list[str | None] = [None] * max_loras
        self._lru: OrderedDict[str, None] = OrderedDict()     # adapters in slots, least recently used first
        self._next_id = 1
        self.num_slot_loads = 0                                # adapters copied into a slot (swaps in)

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        """Reads and checks an adapter (ValueError naming the problem), placed in a slot if one is free."""
        if not name or name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded" if name else "a LoRA adapter needs a name")
        if len(self.adapters) >= self.max_cpu_loras:
            raise ValueError(f"cannot load LoRA adapter {name!r}: {len(self.adapters)} adapters are loaded "
                             f"({', '.join(self.adapters)}), the most --max-cpu-loras allows (default: "
                             "--max-loras); unload one first")
        shapes = {key: (layer.in_features, layer.output_sizes) for key, layer in self.layers.items()}
        weights = load_adapter(name, path, self.max_lora_rank, self.fused_checkpoint, shapes, "cpu")
        loaded = LoadedAdapter(name, str(path), self._next_id, weights.rank, weights)
        self._next_id += 1
        self.adapters[name] = loaded
        if None in self._slots:
            self._place(loaded, self._slots.index(None))
        return loaded

    def unload(self, name: str, users: int = 0) -> None:
        """users: unfinished requests that run under it (refused while there are any)."""
        loaded = self.get(name)
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
        if loaded.slot is not None:
            for layer in self.layers.values():
                layer.clear_slot(loaded.slot)
            self._slots[loaded.slot] = None
            self._lru.pop(name)
        del self.adapters[name]

    def get(self, name: str) -> LoadedAdapter:
        if name not in self.adapters:
            known = ", ".join(self.adapters) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {known})")
        return self.adapters[name]

    def _place(self, loaded: LoadedAdapter, slot: int) -> None:
        old = self._slots[slot]
        if old is not None:
            self.adapters[old].slot = None
            self._lru.pop(old)
        for key, layer in self.layers.items():
            parts = loaded.weights.modules.get(key, {})
            layer.set_slot(slot, [parts.get(i) for i in range(len(layer.output_sizes))])
        self._slots[slot], loaded.slot = loaded.name, slot
        self._lru[loaded.name] = None
        self.num_slot_loads += 1

    def _make_resident(self, names: set[str]) -> None:
        """Every adapter in names in a slot: a free one, else the least recently used one outside names."""
        if len(names) > self.max_loras:
            raise RuntimeError(f"a step needs {len(names)} LoRA adapters, more than --max-loras {self.max_loras} "
                               "(the scheduler admits no more)")
        for name in names:
            if self.adapters[name].slot is None:
                free = [i for i, held in enumerate(self._slots) if held is None]
                slot = free[0] if free else self.adapters[next(n for n in self._lru if n not in names)].slot
                self._place(self.adapters[name], slot)
            self._lru.move_to_end(name)

    def step_rows(self, entries) -> list[int] | None:
        """(seq, num_new_tokens) of each entry of a step -> the slot of each token row (-1: the base), or None when
        no entry has an adapter; the adapters it needs are placed in slots first."""
        if not any(seq.lora_id for seq, _ in entries):
            return None
        by_id = {a.lora_id: a for a in self.adapters.values()}
        self._make_resident({by_id[seq.lora_id].name for seq, _ in entries if seq.lora_id})
        rows = []
        for seq, n in entries:
            rows += [by_id[seq.lora_id].slot if seq.lora_id else -1] * n
        return rows

    def step_slots(self, scheduled) -> torch.Tensor | None:
        """An eager step's step_rows as [T] int32 on the device (scheduled: the SchedulerOutput's entries); the
        runner sets it as batch.slots right before the forward."""
        rows = self.step_rows([(item.seq, item.num_new_tokens) for item in scheduled])
        return None if rows is None else to_device(rows, torch.int32, self.device)


def start(model, config, dtype: torch.dtype, device) -> LoRAManager:
    """An engine's LoRA (EngineConfig with lora.enable_lora): the model's layers wrapped (after load and the
    activation plan, which see the base layers), --lora-modules loaded. Decode graphs take each row's adapter slot
    as an input (engine/worker/cuda_graph.py); verification steps run eagerly (engine/worker/startup.py)."""
    manager = LoRAManager(model, config.lora.max_loras, config.lora.max_lora_rank, dtype, device,
                          config.lora.max_cpu_loras)
    config.scheduler.max_loras = config.lora.max_loras       # distinct adapters among the running sequences
    for name, path in config.lora.lora_modules.items():
        loaded = manager.load(name, path)
        logger.info("LoRA adapter %s (rank %d) from %s, %s", name, loaded.rank, path,
                    "host memory only" if loaded.slot is None else f"slot {loaded.slot}")
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


def slot_bytes(cfg, lora_config, dtype: torch.dtype) -> int:
    """Device bytes of the adapters' slots (LoRALinear's stacks), from the model config: for the memory plan."""
    q, kv, hidden, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    qkv_parts, gate_up_parts = (1, 1) if cfg.fused_checkpoint else (3, 2)
    a_rows_by_k = qkv_parts * hidden + q + gate_up_parts * hidden + inter      # sum over layers' A of parts * K
    b_rows = (q + 2 * kv) + hidden + 2 * inter + hidden                        # sum of N
    per_layer = lora_config.max_loras * lora_config.max_lora_rank * (a_rows_by_k + b_rows)
    return cfg.num_layers * per_layer * dtype.itemsize


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
