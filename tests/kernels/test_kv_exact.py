"""The exact window of an integer KV cache (kernels/attention/kv_exact.py): the torch twin against a dense
brute-force attention that applies the window rule key by key, and the Triton kernel (interpreter on the CPU)
against the twin, for decodes, prefill chunks, ring reads and a spare row."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (decoration time)

from quant_serve.kernels.attention.kv_exact import ExactRows, ExactWindow, alloc_rings, write_ring  # noqa: E402
from quant_serve.kernels.attention.kv_int import IntKVFormat, alloc_int_cache, dequantize_int  # noqa: E402
from quant_serve.kernels.attention.kv_int_paged import paged_attention_int  # noqa: E402
from quant_serve.kernels.attention.reference import paged_attention_ref, store_kv_ref  # noqa: E402
from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()
BS, R, HKV, G, D = 16, 8, 2, 2, 32
FMT = IntKVFormat(4, D, False)


def _case(gen, seq_lens, q_lens, ring_ranges):
    """Random true K/V of every position, the quantized cache holding all of them, this step's new K/V and rings
    holding ring_ranges[b] = (lo, hi) of sequence b (row b + 1; row 0 unused)."""
    batch = len(seq_lens)
    blocks_per = -(-max(seq_lens) // BS)
    tables = torch.arange(batch * blocks_per, dtype=torch.int32).flip(0).view(batch, blocks_per).to(DEV)
    k_c, k_s = alloc_int_cache(FMT, batch * blocks_per, BS, HKV, D, DEV)
    v_c, v_s = alloc_int_cache(FMT, batch * blocks_per, BS, HKV, D, DEV)
    ring_k, ring_v = alloc_rings(batch + 2, R, HKV, D, torch.float16, DEV)
    true_k, true_v, new_k, new_v = [], [], [], []
    for b, (n, q) in enumerate(zip(seq_lens, q_lens)):
        k = torch.randn(n, HKV, D, generator=gen).half()
        v = torch.randn(n, HKV, D, generator=gen).half()
        slots = torch.tensor([int(tables[b, p // BS]) * BS + p % BS for p in range(n)], device=DEV)
        store_kv_ref(k.to(DEV), v.to(DEV), k_c, v_c, slots, k_s, v_s)
        lo, hi = ring_ranges[b]
        for p in range(lo, hi):
            ring_k[b + 1, p % R], ring_v[b + 1, p % R] = k[p], v[p]
        true_k.append(k), true_v.append(v), new_k.append(k[n - q:]), new_v.append(v[n - q:])
    rows = ExactRows(ring_row=torch.arange(1, batch + 1, dtype=torch.int32, device=DEV),
                     ring_lo=torch.tensor([r[0] for r in ring_ranges], dtype=torch.int32, device=DEV),
                     ring_hi=torch.tensor([r[1] for r in ring_ranges], dtype=torch.int32, device=DEV),
                     ring_slot=torch.zeros(sum(q_lens), dtype=torch.int64, device=DEV))
    exact = ExactWindow(torch.cat(new_k).to(DEV), torch.cat(new_v).to(DEV), ring_k, ring_v, rows)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), HKV * G, D, generator=gen).half().to(DEV)
    return q, k_c, v_c, k_s, v_s, tables, lens, qsl, exact, true_k, true_v


def _brute(q, k_c, v_c, k_s, v_s, tables, seq_lens, q_lens, ring_ranges, true_k, true_v, scale):
    """Dense attention, key by key: exact iff in the query's last R positions and new or in the ring."""
    out, row = [], 0
    for b, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        flat = lambda c, s: dequantize_int(c[tables[b].long()].flatten(0, 1)[:n].cpu(),     # noqa: E731
                                           s[tables[b].long()].flatten(0, 1)[:n].cpu())
        kq, vq = flat(k_c, k_s), flat(v_c, v_s)                                         # [n, Hkv, D]
        lo, hi = ring_ranges[b]
        for i in range(ql):
            pos = n - ql + i
            have = [(j >= n - ql or lo <= j < hi) and j > pos - R for j in range(pos + 1)]
            m = torch.tensor(have).view(-1, 1, 1)
            k = torch.where(m, true_k[b][:pos + 1].float(), kq[:pos + 1])
            v = torch.where(m, true_v[b][:pos + 1].float(), vq[:pos + 1])
            qh = q[row + i].float().cpu().view(HKV, G, D)
            p = torch.softmax(torch.einsum("hgd,khd->hgk", qh, k) * scale, -1)
            out.append(torch.einsum("hgk,khd->hgd", p, v).reshape(HKV * G, D))
        row += ql
    return torch.stack(out)


CASES = {   # seq_lens, q_lens, ring ranges
    "decode": ([21, 9, 40], [1, 1, 1], [(12, 20), (0, 8), (33, 39)]),
    "prefill chunks": ([37, 30], [13, 30], [(16, 24), (0, 0)]),
    "partial ring": ([26, 50], [3, 1], [(20, 23), (45, 47)]),       # a ring shorter than R, e.g. a prefix hit
    "shorter than R": ([5, 12], [1, 1], [(0, 4), (4, 11)]),          # windows reaching before position 0
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_twin_follows_the_window_rule(case):
    seq_lens, q_lens, ranges = CASES[case]
    gen = torch.Generator().manual_seed(0)
    q, k_c, v_c, k_s, v_s, tables, lens, qsl, exact, true_k, true_v = _case(gen, seq_lens, q_lens, ranges)
    out = paged_attention_ref(q, k_c, v_c, tables, lens, qsl, D ** -0.5, k_s, v_s, exact=exact)
    want = _brute(q, k_c, v_c, k_s, v_s, tables, seq_lens, q_lens, ranges, true_k, true_v, D ** -0.5)
    assert torch.allclose(out.float().cpu(), want, atol=2e-3), (out.float().cpu() - want).abs().max()
    plain = paged_attention_ref(q, k_c, v_c, tables, lens, qsl, D ** -0.5, k_s, v_s)
    assert (plain.float().cpu() - want).abs().max() > 1e-2           # the window changes the result


# every case whole, and the decode batches (one new token a sequence) also split across 3 programs
KERNEL_CASES = [(case, None) for case in CASES] + [(case, 3) for case, (_, q_lens, _) in CASES.items()
                                                   if set(q_lens) == {1}]


@pytest.mark.parametrize("case, splits", KERNEL_CASES, ids=lambda v: str(v))
def test_kernel_matches_twin(case, splits):
    """Decode batches also split each context across programs and merge the partials (the window's tiles land in
    the last split)."""
    seq_lens, q_lens, ranges = CASES[case]
    gen = torch.Generator().manual_seed(1)
    q, k_c, v_c, k_s, v_s, tables, lens, qsl, exact, _, _ = _case(gen, seq_lens, q_lens, ranges)
    ref = paged_attention_ref(q, k_c, v_c, tables, lens, qsl, D ** -0.5, k_s, v_s, exact=exact)
    out = paged_attention_int(q, k_c, v_c, tables, lens, qsl, D ** -0.5, k_s, v_s, exact=exact,
                              block_n=8 if DEV == "cpu" else 16,   # compiled, tl.dot needs 16 keys
                              num_splits=splits)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 3e-3, err


def test_write_ring_puts_each_token_at_its_slot():
    ring_k, ring_v = alloc_rings(3, R, HKV, D, torch.float16, DEV)
    new = torch.randn(3, HKV, D).half().to(DEV)
    slots = torch.tensor([1 * R + 5, 2 * R + 0, 2 * R + 7], device=DEV)     # row 2 is the spare row here
    rows = ExactRows(*(torch.zeros(1, dtype=torch.int32, device=DEV),) * 3, ring_slot=slots)
    write_ring(ExactWindow(new, -new, ring_k, ring_v, rows))
    assert torch.equal(ring_k[1, 5], new[0]) and torch.equal(ring_v[2, 7], -new[2])
    assert not ring_k[0].any() and not ring_k[1, :5].any()
