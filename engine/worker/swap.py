"""The CPU tier's tensors and the block copies between it and the GPU pool.

Same layout per layer as the GPU cache ([num_blocks, block_size, num_kv_heads, head_dim], same dtype), in pinned
host memory when the pool is on CUDA. On CUDA the copies run on a side stream: `issue` enqueues them after the
compute stream's earlier work (the previous step wrote the blocks being swapped out) and `wait` makes the compute
stream wait for them before the forward that reads them. On the CPU path both are plain synchronous copies.
"""
import torch


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs -> (src, dst, count) runs of consecutive ids, in order: one copy per run."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]


class CpuKVTier:
    def __init__(self, gpu_caches: list[torch.Tensor], num_blocks: int):
        """gpu_caches: every layer's K and V cache tensors (the tier keeps one host twin of each)."""
        self.gpu_caches = gpu_caches
        self.num_blocks = num_blocks
        device = gpu_caches[0].device
        self.on_cuda = device.type == "cuda"
        self.cpu_caches = [torch.zeros((num_blocks, *c.shape[1:]), dtype=c.dtype, pin_memory=self.on_cuda)
                           for c in gpu_caches]
        self.stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.done = torch.cuda.Event() if self.on_cuda else None
        self._pending = False

    @property
    def bytes_per_block(self) -> int:
        return sum(c[0].numel() * c.element_size() for c in self.cpu_caches)

    def issue(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """swap_out: (gpu, cpu) pairs, swap_in: (cpu, gpu) pairs. Swap-outs go first: a GPU block whose content
        leaves may be the destination of a swap-in in the same step."""
        if not swap_out and not swap_in:
            return
        if not self.on_cuda:
            self._copy(swap_out, swap_in)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self._copy(swap_out, swap_in)
            self.done.record(self.stream)
        self._pending = True

    def wait(self) -> None:
        """Make the compute stream wait for the copies issued so far (no host sync)."""
        if self._pending:
            torch.cuda.current_stream(self.stream.device).wait_event(self.done)
            self._pending = False

    def _copy(self, swap_out, swap_in) -> None:
        for gpu, cpu in zip(self.gpu_caches, self.cpu_caches):
            for src, dst, n in block_runs(swap_out):
                cpu[dst:dst + n].copy_(gpu[src:src + n], non_blocking=True)
        for gpu, cpu in zip(self.gpu_caches, self.cpu_caches):
            for src, dst, n in block_runs(swap_in):
                gpu[dst:dst + n].copy_(cpu[src:src + n], non_blocking=True)
