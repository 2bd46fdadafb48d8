"""The exponential race of a decode step, on the device: the CPU's counter-noise race (cpu_sampling.cpp)
as a Triton kernel and in torch ops, so a step samples without the host.

Per row b with 64-bit seed s_b and log-probabilities logp [B, V] (fp32; -inf never drawn), the token is
argmax_v logp_v - ln E_v, E_v = max(-ln U_v, 2^-25), U_v = (24 bits + 0.5) / 2^24 in fp32 from one 32-bit
half of splitmix64(s_b + (v // 2 + 1) * golden): element v takes the low half when v is even, the high
half when odd. That is `race_sample_reference` (kernels/cpu_sampling.py, float64 numpy) and the CPU's
C++ `race_sample`, bit for bit in the noise; the logs round differently (fp32 library logs here, a
polynomial there, float64 in the reference), so the three agree except at near ties (score gaps about
1e-6). The floor on E is where fp32 rounds U up to 1 (the 24 bits all ones): -ln U would be 0 and the
token would win whatever its probability; 2^-25 is -ln U of the exact U there.

A step's row seed comes from the sample's seed and the position of the query that produced the logits:
`row_seeds(seed, position)` = splitmix64's output function of seed + (position + 1) * golden. So a
sample's draws depend on its own seed and position only: not on its batch, not on when it runs, and a
preempted sample that is recomputed draws what it would have drawn. The kernel computes it itself when
given the positions (`race_sample_triton(logp, seeds, positions)`), so a CUDA graph needs no other op.

Grid (B, splits): each program races one slice of the vocabulary keeping, per lane, the first best
score (strict >) and its index, then the slice's first maximum; the splits' results are reduced by a
torch argmax (first maximum), so the token is the first index of the row's maximum score, as in the C++
kernel and numpy's argmax. The splits give a row of 150K tokens about 2 x the SM count of programs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ._triton_utils import lazy_jit, require_triton
from .cpu_sampling import GOLDEN, MIX1, MIX2, race_sample_reference

__all__ = ["race_sample_reference", "race_sample_torch", "race_sample_triton", "row_seeds",
           "row_seeds_reference"]

tl = None  # triton.language, bound on the first kernel launch (see _triton_utils)

E_FLOOR = 2.0**-25  # -ln U of U = 1 - 2^-25, the exact U of the largest 24-bit cell


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    return x - 2**64 if x >= 2**63 else x


# ---------------------------------------------------------------------------------------- row seeds

def row_seeds_reference(seeds: np.ndarray | list[int], positions: np.ndarray | list[int]) -> np.ndarray:
    """splitmix64 output of seed + (position + 1) * golden, per row -> uint64 [B] (numpy, exact)."""
    s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)
    p = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = s + (p + np.uint64(1)) * np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    return z ^ (z >> np.uint64(31))


def _shr(z: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(z: Tensor) -> Tensor:
    """splitmix64's output mix of int64 bit patterns (products wrap modulo 2^64)."""
    z = (z ^ _shr(z, 30)) * _signed(MIX1)
    z = (z ^ _shr(z, 27)) * _signed(MIX2)
    return z ^ _shr(z, 31)


def row_seeds(seeds: Tensor, positions: Tensor) -> Tensor:
    """`row_seeds_reference` in torch int64 ops: [B] int64 on any device."""
    return _splitmix(seeds.long() + (positions.long() + 1) * _signed(GOLDEN))


# ---------------------------------------------------------------------------------------- torch

def race_sample_torch(logp: Tensor, seeds: Tensor, chunk: int = 1 << 16) -> Tensor:
    """The race in torch ops on logp's device: logp [B, V] fp32, seeds [B] int64 (row seeds) -> [B] int64.
    The vocabulary goes in chunks so that the int64 noise of a chunk, not of the row, is alive at once."""
    b, v = logp.shape
    dev = logp.device
    best = torch.full((b,), float("-inf"), device=dev)
    best_at = torch.zeros(b, dtype=torch.long, device=dev)
    seeds = seeds.long()[:, None]
    for start in range(0, v, chunk):
        idx = torch.arange(start, min(start + chunk, v), device=dev)
        z = _splitmix(seeds + (idx // 2 + 1) * _signed(GOLDEN))
        half = torch.where(idx % 2 == 0, z & 0xFFFFFFFF, _shr(z, 32))
        u = (_shr(half, 8).float() + 0.5) * (1.0 / 16777216)
        e = (-torch.log(u)).clamp_(min=E_FLOOR)
        score = logp[:, start: start + len(idx)].float() - torch.log(e)
        top, at = score.max(-1)  # the first maximum of the chunk
        better = top > best
        best = torch.where(better, top, best)
        best_at = torch.where(better, at + start, best_at)
    return best_at


# ---------------------------------------------------------------------------------------- Triton

@lazy_jit
def _race_jit(logp, seeds, positions, best_score, best_index, V, stride, SPLITS, CHUNK,
              KEYED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    seed = tl.load(seeds + row).to(tl.uint64, bitcast=True)
    if KEYED:  # the row seed of (sample seed, position): row_seeds
        pos = tl.load(positions + row).to(tl.uint64, bitcast=True)
        z = seed + (pos + 1) * 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        seed = z ^ (z >> 31)
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.full([BLOCK], 2147483647, tl.int32)
    start = split * CHUNK
    for off in range(0, CHUNK, BLOCK):
        v = start + off + lane
        inside = v < V
        x = tl.load(logp + row.to(tl.int64) * stride + v, mask=inside, other=float("-inf"))
        vv = v.to(tl.uint64)
        h = seed + ((vv >> 1) + 1) * 0x9E3779B97F4A7C15
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB
        h = h ^ (h >> 31)
        half = tl.where((vv & 1) == 0, h & 0xFFFFFFFF, h >> 32)
        u = ((half >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216)
        e = tl.maximum(-tl.log(u), 2.9802322387695312e-08)
        score = x - tl.log(e)
        better = inside & (score > best)
        best = tl.where(better, score, best)
        best_at = tl.where(better, v, best_at)
    top = tl.max(best, 0)
    first = tl.min(tl.where(best == top, best_at, 2147483647), 0)
    tl.store(best_score + row * SPLITS + split, top)
    tl.store(best_index + row * SPLITS + split, first)



def race_splits(batch: int, vocab: int, device: torch.device, block: int) -> int:
    """Vocabulary slices per row: about two programs per SM on a GPU, one row one program on a CPU."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-vocab // (4 * block)), -(-2 * sms // max(batch, 1))))


def race_sample_triton(logp: Tensor, seeds: Tensor, positions: Tensor | None = None,
                       block: int = 1024, splits: int | None = None) -> Tensor:
    """The race as a Triton kernel: logp [B, V] fp32, seeds [B] int64 (row seeds, or with `positions`
    [B] int64 the samples' seeds, keyed by `row_seeds`) -> [B] int64. No host sync (CUDA graphs)."""
    require_triton()
    b, v = logp.shape
    if logp.stride(1) != 1:
        logp = logp.contiguous()
    s = splits or race_splits(b, v, logp.device, block)
    per_split = -(-v // s)
    chunk = -(-per_split // block) * block
    score = torch.empty(b, s, dtype=torch.float32, device=logp.device)
    index = torch.empty(b, s, dtype=torch.int32, device=logp.device)
    if b:
        seeds = seeds.long().contiguous()
        pos = positions.long().contiguous() if positions is not None else seeds
        _race_jit[(b, s)](logp, seeds, pos, score, index, v, logp.stride(0), s, chunk,
                             KEYED=positions is not None, BLOCK=block, num_warps=4)
    if s == 1:
        return index[:, 0].long()
    return index.gather(1, score.argmax(1, keepdim=True))[:, 0].long()
