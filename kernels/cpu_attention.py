"""CPU attention kernels in C++ (AVX512-BF16, or AVX2 and FMA), each beside its float64 or torch reference.

`paged_attention` (listed pages read through the block table), `select_pages` and `score_pages` (block
top-k in one op), `append_kv`, `sparse_decode_layer` (append, score, select, attend), the cascade's
`packed_prefix_attention` over a bf16 prefix stored once in the layouts `vdpbf16ps` wants, and
`causal_attention` (the prefill). Built on first use with torch's C++ extension loader, cached by the
source's hash; where they cannot be built or run, or with SPARROW_CPU_KERNELS=0, `available()` is False
and the torch paths run. Design and layouts: docs/cpu-kernels.md.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import sys
from pathlib import Path

import torch
from torch import Tensor

from sparrow.stages.core.definitions import RESERVED_PAGES

KEY_BLOCK = 16  # keys per packed key block


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


class Isa(enum.Enum):
    """The instruction sets the kernels are built for (kernels/cpu_simd.h), with their compiler flags."""

    AVX512_BF16 = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16")
    AVX2 = ("-mavx2", "-mfma", "-mf16c")  # each vector two halves, bf16 products widened to fp32


@functools.cache
def isa() -> Isa | None:
    """The instruction set the kernels are built for here (the first of `Isa` this CPU has), None where
    they do not run."""
    flags = cpu_flags()
    if {"avx512_bf16", "avx512bw"} <= flags:
        return Isa.AVX512_BF16
    return Isa.AVX2 if {"avx2", "fma", "f16c"} <= flags else None


SOURCES = [Path(__file__).with_suffix(".cpp")] + [Path(__file__).with_name(f"cpu_{name}.cpp")
                                                 for name in ("layers", "prefill", "sampling")]
HEADERS = [Path(__file__).with_name(f"cpu_{name}.h") for name in ("attend", "simd")]


def cflags(target: Isa) -> list[str]:
    return ["-O3", *target.value, "-fopenmp"]


def _build_directory(target: Isa) -> Path:
    """One folder per version of the source and flags: checkouts with the same source share a build, and
    an edited source never loads a stale one."""
    from torch.utils.cpp_extension import _get_build_directory

    source = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    flags = " ".join(cflags(target)).encode()
    digest = hashlib.sha256(source + flags + torch.__version__.encode()).hexdigest()
    path = Path(_get_build_directory(f"sparrow_cpu_attention_{digest[:16]}", verbose=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def available() -> bool:
    """Whether the kernels run here (building them on the first call on this machine)."""
    target = isa()
    if os.environ.get("SPARROW_CPU_KERNELS", "1") == "0" or target is None:
        return False
    try:
        library = _build_directory(target) / "sparrow_cpu_attention.so"
        if library.exists():  # torch's loader would run ninja and probe the compiler again: about 3 s
            try:
                torch.ops.load_library(str(library))
                return True
            except OSError:  # another process is still linking it: wait on the loader's lock below
                pass
        from torch.utils.cpp_extension import load

        print("sparrow: building the CPU attention kernels (once per machine, 10-80 s)", file=sys.stderr)
        load("sparrow_cpu_attention", [str(p) for p in SOURCES], extra_cflags=cflags(target),
             extra_ldflags=["-fopenmp"], build_directory=str(library.parent), is_python_module=False,
             verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch paths work everywhere
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"sparrow: the CPU attention kernels are not available ({reason}); using the PyTorch paths",
              file=sys.stderr)
        return False
    return True


def supports(head_dim: int, page_size: int, dtype: torch.dtype) -> bool:
    """Whether a prefix of this shape can be packed for `packed_prefix_attention`."""
    return dtype in (torch.bfloat16, torch.float32) and head_dim in (64, 128) and page_size % KEY_BLOCK == 0


def usable(q: Tensor, k_pages: Tensor) -> bool:
    """Whether `paged_attention` takes q [B, Hq, D] over pages [N, Hkv, P, D] here."""
    d, hkv = k_pages.shape[-1], k_pages.shape[1]
    return (q.device.type == "cpu" and k_pages.dtype in (torch.float32, torch.bfloat16) and d in (64, 128)
            and q.shape[1] % hkv == 0 and q.shape[1] // hkv <= 16 and available())


def append_kv_usable(k_pages: Tensor, centroids: Tensor, k: Tensor) -> bool:
    """Whether `append_kv` takes these (the torch reference does otherwise)."""
    return (k.device.type == "cpu" and k.dtype == k_pages.dtype
            and k_pages.dtype in (torch.float32, torch.bfloat16) and centroids.dtype == torch.float32
            and k_pages.is_contiguous() and centroids.is_contiguous() and available())


def append_kv(k_pages: Tensor, v_pages: Tensor, centroids: Tensor, k: Tensor, v: Tensor,
              slots: Tensor) -> None:
    """`append_kv_reference` in one op (about a dozen small torch ops and a host sync per layer there)."""
    torch.ops.sparrow_cpu.append_kv(k_pages, v_pages, centroids, k, v.to(v_pages.dtype), slots.long())


def score_pages(q: Tensor, prefixes: list[Tensor], group: Tensor, centroids: Tensor, block_table: Tensor,
                seq_lens: Tensor, page_size: int) -> Tensor:
    """`cascade_decode.cascade_page_scores` in one op, without its candidate mask (`select_pages` applies
    the same rules): q [B, Hq, D]; prefixes[g] [m, Hkv, D] fp32, the centroids of group g's shared
    pages, read once for the rows with group [B] == g (-1: none) -> [B, Hkv, W] fp32, -inf past a row's
    pages."""
    return torch.ops.sparrow_cpu.score_pages(q, centroids, block_table.int().contiguous(), seq_lens.int(),
                                             page_size, [p.contiguous() for p in prefixes], group.long())


def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seq_lens: Tensor,
                    pages: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """q [B, Hq, D] over the positions < seq_lens of the logical pages `pages` [B, Hkv, K] (-1 = none),
    read through block_table [B, W] -> out [B, Hq, D] fp32, lse [B, Hq] fp32 (-inf and 0 for a row with
    no valid position). Over bf16 pages of 16 keys, q is rounded to bf16 for the score products (exact for
    a bf16 model, whose queries are bf16)."""
    if not available():
        raise RuntimeError("the CPU attention kernels are not available here")
    return torch.ops.sparrow_cpu.paged_attention(
        q.float().contiguous(), k_pages, v_pages, block_table.int().contiguous(), seq_lens.int().contiguous(),
        pages.long().contiguous(), scale)


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """`cascade_decode.merge_attention` row by row in scalar arithmetic: out [..., D], lse [...] fp32."""
    return torch.ops.sparrow_cpu.merge_attention(out_a.contiguous(), lse_a.contiguous(), out_b.contiguous(),
                                                 lse_b.contiguous())


def select_pages(scores: Tensor, seq_lens: Tensor, budgets: Tensor, page_size: int,
                 max_selected: int | None = None) -> Tensor:
    """`page_scoring.finish_selection` in one op: page scores [B, Hkv, W] (-inf = not a candidate) ->
    [B, Hkv, K] int32 logical pages, sorted, -1 padded. Ties keep the lower page, as the Triton
    selection kernel does (torch.topk's order among equal scores is unspecified)."""
    if not available():
        raise RuntimeError("the CPU attention kernels are not available here")
    selected = torch.ops.sparrow_cpu.select_pages(scores.float().contiguous(), seq_lens.int(), budgets.int(),
                                                  page_size, RESERVED_PAGES, max_selected or 0)
    return selected if max_selected is None else selected[..., :max_selected]


def paged_attention_reference(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                              seq_lens: Tensor, pages: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """`paged_attention` in float64, one (sequence, KV head) at a time."""
    b, hq, d = q.shape
    hkv, size = k_pages.shape[1], k_pages.shape[2]
    g = hq // hkv
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float64)
    for i in range(b):
        for h in range(hkv):
            keys, values = [], []
            for page in pages[i, h].tolist():
                phys = int(block_table[i, page]) if 0 <= page < block_table.shape[1] else -1
                for j in range(size) if phys >= 0 else ():
                    if page * size + j < int(seq_lens[i]):
                        keys.append(k_pages[phys, h, j])
                        values.append(v_pages[phys, h, j])
            if keys:
                rows = slice(h * g, (h + 1) * g)
                scores = q[i, rows].double() @ torch.stack(keys).double().T * scale
                lse[i, rows] = torch.logsumexp(scores, -1)
                out[i, rows] = torch.softmax(scores, -1) @ torch.stack(values).double()
    return out, lse


def packed_key_shape(hkv: int, length: int, head_dim: int,
                     dtype: torch.dtype = torch.bfloat16) -> tuple[int, ...]:
    """bf16: per block of 16 keys, per pair of dims, the 16 keys' two values (one vdpbf16ps operand);
    fp32: per block of 16 keys, per dim, the 16 keys' values (one FMA operand)."""
    if dtype == torch.float32:
        return (hkv, length // KEY_BLOCK, head_dim, KEY_BLOCK)
    return (hkv, length // KEY_BLOCK, head_dim // 2, KEY_BLOCK, 2)


def packed_value_shape(hkv: int, length: int, head_dim: int,
                       dtype: torch.dtype = torch.bfloat16) -> tuple[int, ...]:
    """bf16: per pair of keys, per dim, the two keys' values; fp32: the values as they are."""
    if dtype == torch.float32:
        return (hkv, length, head_dim)
    return (hkv, length // 2, head_dim, 2)


def pack_keys(k: Tensor) -> Tensor:
    """[Hkv, S, D] -> the packed key layout of k's dtype (a strided view; copy it into the store)."""
    h, s, d = k.shape
    if k.dtype == torch.float32:
        return k.view(h, s // KEY_BLOCK, KEY_BLOCK, d).transpose(2, 3)
    return k.view(h, s // KEY_BLOCK, KEY_BLOCK, d // 2, 2).transpose(2, 3)


def pack_values(v: Tensor) -> Tensor:
    """[Hkv, S, D] -> the packed value layout of v's dtype (a strided view)."""
    h, s, d = v.shape
    return v if v.dtype == torch.float32 else v.view(h, s // 2, 2, d).transpose(2, 3)


def unpack_keys(kp: Tensor) -> Tensor:
    if kp.dim() == 4:  # fp32 [Hkv, S/16, D, 16]
        h, blocks, d, block = kp.shape
        return kp.transpose(2, 3).reshape(h, blocks * block, d)
    h, blocks, half, block, _ = kp.shape
    return kp.transpose(2, 3).reshape(h, blocks * block, half * 2)


def unpack_values(vp: Tensor) -> Tensor:
    if vp.dim() == 3:  # fp32, as they are
        return vp
    h, pairs, d, _ = vp.shape
    return vp.transpose(2, 3).reshape(h, pairs * 2, d)


def causal_attention_usable(q: Tensor, k: Tensor) -> bool:
    """Whether `causal_attention` takes q [B, Hq, T, D], k [B, Hkv, T, D] here."""
    return (q.device.type == "cpu" and q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float32)
            and q.shape[-1] in (64, 128) and q.shape[1] % k.shape[1] == 0 and q.shape[2] == k.shape[2]
            and available())


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of a prefill (kernels/cpu_prefill.cpp), bf16 or fp32: q [B, Hq, T, D], k/v [B, Hkv,
    T, D] -> [B, Hq, T, D] in q's dtype (a view of a [B, T, Hq, D] tensor, the layout the output projection
    reads). The keys and values are packed first, padded with zeros to whole key blocks (never visible)."""
    b, hkv, t, d = k.shape
    pad = -t % KEY_BLOCK
    k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(b * hkv, t + pad, d) for x in (k, v))
    kp, vp = pack_keys(k).contiguous(), pack_values(v).contiguous()
    return torch.ops.sparrow_cpu.prefill_attention(q, kp, vp, scale).transpose(1, 2)


def causal_attention_reference(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """`causal_attention` in float64."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(g, 1) for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    t = q.shape[2]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v


def packed_prefix_attention(q: Tensor, kp: Tensor, vp: Tensor, scale: float,
                            chunks: int) -> tuple[Tensor, Tensor]:
    """q [n, Hq, D] over a shared prefix packed in its dtype's layout (bf16 or fp32) -> out [n, Hq, D] fp32,
    lse [n, Hq] fp32."""
    if not available():  # loads the op (built and cached on the first call)
        raise RuntimeError("the CPU prefix attention kernel is not available here")
    n, hq, d = q.shape
    hkv = kp.shape[0]
    g = hq // hkv
    qh = q.view(n, hkv, g, d).transpose(0, 1).reshape(hkv, n * g, d).to(kp.dtype).contiguous()
    out, lse = torch.ops.sparrow_cpu.prefix_attention(qh, kp, vp, scale, chunks)  # [Hkv, n*G, D], [Hkv, n*G]
    return (out.view(hkv, n, g, d).transpose(0, 1).reshape(n, hq, d),
            lse.view(hkv, n, g).transpose(0, 1).reshape(n, hq))


def prefix_attention_reference(q: Tensor, kp: Tensor, vp: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """`packed_prefix_attention` in fp64 on the unpacked prefix."""
    n, hq, d = q.shape
    k, v = unpack_keys(kp).double(), unpack_values(vp).double()  # [Hkv, S, D]
    g = hq // k.shape[0]
    scores = torch.einsum("nhgd,hsd->nhgs", q.double().view(n, -1, g, d), k) * scale
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("nhgs,hsd->nhgd", (scores - lse[..., None]).exp(), v)
    return out.reshape(n, hq, d), lse.reshape(n, hq)
