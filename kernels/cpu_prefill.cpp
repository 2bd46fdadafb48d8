// Causal prefill attention in bf16 with AVX512-BF16 dot products (vdpbf16ps), GQA.
// The torch reference, the layouts and why: kernels/cpu_attention.py (causal_attention).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_attend.h"

namespace {

using sparrow_attend::attend;
using sparrow_attend::KEYS;

constexpr int QB = 32;  // query positions per work item: its G * QB rows share each K/V tile

// q [B, Hq, T, D] bf16 (any strides, dims contiguous); kp [B * Hkv, Tp/16, D/2, 16, 2] and vp [B * Hkv, Tp/2,
// D, 2] bf16, Tp >= T -> out [B, T, Hq, D] bf16: causal attention of every position to positions <= it.
// Work items are (sequence, KV head, QB query positions); the G query heads of a KV head share its
// tiles. The items' costs grow with their position, so threads take them largest first from a counter.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kp.scalar_type() == at::kBFloat16 &&
              vp.scalar_type() == at::kBFloat16, "prefill_attention: bf16 tensors expected");
  TORCH_CHECK(q.dim() == 4 && q.stride(3) == 1, "q [B, Hq, T, D] with contiguous dims expected");
  TORCH_CHECK(kp.is_contiguous() && vp.is_contiguous(), "packed keys and values: contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  TORCH_CHECK(D == 64 || D == 128, "head dim 64 or 128 expected");
  TORCH_CHECK(kp.dim() == 5 && kp.size(0) % B == 0 && kp.size(2) == D / 2 && kp.size(3) == KEYS &&
              kp.size(1) * KEYS >= T, "packed keys [B * Hkv, Tp/16, D/2, 16, 2] expected");
  const int64_t Hkv = kp.size(0) / B, G = Hq / Hkv, Tp = kp.size(1) * KEYS;
  TORCH_CHECK(Hq % Hkv == 0, "whole GQA groups expected");
  TORCH_CHECK(vp.dim() == 4 && vp.size(0) == B * Hkv && vp.size(1) * 2 == Tp && vp.size(2) == D,
              "packed values [B * Hkv, Tp/2, D, 2] expected");
  auto out = at::empty({B, T, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t blocks = (T + QB - 1) / QB, items = B * Hkv * blocks;
  std::atomic<int64_t> next{0};
  const auto* qd = q.data_ptr<at::BFloat16>();
  auto* od = out.data_ptr<at::BFloat16>();
  const auto* kd = reinterpret_cast<const uint16_t*>(kp.data_ptr<at::BFloat16>());
  const auto* vd = reinterpret_cast<const uint16_t*>(vp.data_ptr<at::BFloat16>());
  const int64_t sb = q.stride(0), sh = q.stride(1), st = q.stride(2);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t R = QB * G;
    std::vector<at::BFloat16> qbuf(R * D);
    std::vector<int> pos(R);
    std::vector<float> o(R * D), m(R), l(R);
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const int64_t blk = blocks - 1 - item / (B * Hkv), bh = item % (B * Hkv), b = bh / Hkv, h = bh % Hkv;
      const int64_t t0 = blk * QB, rows = std::min<int64_t>(QB, T - t0) * G;
      for (int64_t r = 0; r < rows; ++r) {  // row (position t0 + r / G, query head h G + r % G)
        const int64_t t = t0 + r / G, hq = h * G + r % G;
        std::copy_n(qd + b * sb + hq * sh + t * st, D, qbuf.data() + r * D);
        pos[r] = t;
      }
      const auto* qp = reinterpret_cast<const uint32_t*>(qbuf.data());
      const uint16_t* kh = kd + bh * Tp * D;
      const uint16_t* vh = vd + bh * Tp * D;
      auto run = D == 64 ? attend<64> : attend<128>;
      run(qp, pos.data(), rows, kh, vh, 0, T, (float)scale, o.data(), m.data(), l.data());
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r / G, hq = h * G + r % G;
        at::BFloat16* dst = od + ((b * T + t) * Hq + hq) * D;
        const __m512 inv = _mm512_set1_ps(1.f / l[r]);
        for (int64_t d = 0; d < D; d += 16)
          _mm256_storeu_si256((__m256i*)(dst + d),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&o[r * D + d]), inv)));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparrow_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor kp, Tensor vp, float scale) -> Tensor");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
}
