// Causal prefill attention, GQA: bf16 with AVX512-BF16 dot products (vdpbf16ps), or fp32 with FMAs.
// The torch reference, the layouts and why: kernels/cpu_attention.py (causal_attention).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_attend.h"

namespace {

using sparrow_attend::attend;
using sparrow_attend::KEYS;

constexpr int QB = 32;  // query positions per work item: its G * QB rows share each K/V tile

// q [B, Hq, T, D] (any strides, dims contiguous) -> out [B, T, Hq, D] in q's dtype: causal attention of every
// position to positions <= it, over keys and values packed for `attend`: bf16 kp [B * Hkv, Tp/16, D/2, 16,
// 2] and vp [B * Hkv, Tp/2, D, 2]; fp32 kp [B * Hkv, Tp/16, D, 16] and vp [B * Hkv, Tp, D]; Tp >= T.
// Work items are (sequence, KV head, QB query positions); the G query heads of a KV head share its
// tiles. The items' costs grow with their position, so threads take them largest first from a counter.
template <typename T, typename E>  // T: the tensors' element type, E: attend's (bf16 as its bits)
at::Tensor prefill(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), T_ = q.size(2), D = q.size(3);
  const int64_t Hkv = kp.size(0) / B, G = Hq / Hkv, Tp = kp.size(1) * KEYS;
  auto out = at::empty({B, T_, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t blocks = (T_ + QB - 1) / QB, items = B * Hkv * blocks;
  std::atomic<int64_t> next{0};
  const T* qd = q.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const auto* kd = reinterpret_cast<const E*>(kp.data_ptr<T>());
  const auto* vd = reinterpret_cast<const E*>(vp.data_ptr<T>());
  const int64_t sb = q.stride(0), sh = q.stride(1), st = q.stride(2);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t R = QB * G;
    std::vector<T> qbuf(R * D);
    std::vector<int> pos(R);
    std::vector<float> o(R * D), m(R), l(R);
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const int64_t blk = blocks - 1 - item / (B * Hkv), bh = item % (B * Hkv), b = bh / Hkv, h = bh % Hkv;
      const int64_t t0 = blk * QB, rows = std::min<int64_t>(QB, T_ - t0) * G;
      for (int64_t r = 0; r < rows; ++r) {  // row (position t0 + r / G, query head h G + r % G)
        const int64_t t = t0 + r / G, hq = h * G + r % G;
        std::copy_n(qd + b * sb + hq * sh + t * st, D, qbuf.data() + r * D);
        pos[r] = t;
      }
      const E* qp = reinterpret_cast<const E*>(qbuf.data());
      auto run = D == 64 ? attend<64, E> : attend<128, E>;
      run(qp, pos.data(), rows, kd + bh * Tp * D, vd + bh * Tp * D, 0, T_, (float)scale, o.data(), m.data(),
          l.data());
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r / G, hq = h * G + r % G;
        T* dst = od + ((b * T_ + t) * Hq + hq) * D;
        const simd::vf inv = simd::set1(1.f / l[r]);
        for (int64_t d = 0; d < D; d += 16) {
          const simd::vf x = simd::mul(simd::loadu(&o[r * D + d]), inv);
          if constexpr (std::is_same_v<T, float>) simd::storeu(dst + d, x);
          else _mm256_storeu_si256((__m256i*)(dst + d), simd::to_bf16(x));
        }
      }
    }
  });
  return out;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && kp.scalar_type() == dtype &&
              vp.scalar_type() == dtype, "prefill_attention: bf16 or fp32 tensors of one dtype expected");
  TORCH_CHECK(q.dim() == 4 && q.stride(3) == 1, "q [B, Hq, T, D] with contiguous dims expected");
  TORCH_CHECK(kp.is_contiguous() && vp.is_contiguous(), "packed keys and values: contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  TORCH_CHECK(D == 64 || D == 128, "head dim 64 or 128 expected");
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(kp.dim() == (bf16 ? 5 : 4) && kp.size(0) % B == 0 && kp.size(2) == (bf16 ? D / 2 : D) &&
              kp.size(3) == KEYS && kp.size(1) * KEYS >= T, "packed keys [B * Hkv, Tp/16, D/2, 16, 2] (bf16) or "
              "[B * Hkv, Tp/16, D, 16] (fp32) expected");
  const int64_t Hkv = kp.size(0) / B, Tp = kp.size(1) * KEYS;
  TORCH_CHECK(Hq % Hkv == 0, "whole GQA groups expected");
  TORCH_CHECK(vp.size(0) == B * Hkv && vp.numel() == B * Hkv * Tp * D, "packed values of the keys' length expected");
  return bf16 ? prefill<at::BFloat16, uint16_t>(q, kp, vp, scale) : prefill<float, float>(q, kp, vp, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparrow_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor kp, Tensor vp, float scale) -> Tensor");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
}
