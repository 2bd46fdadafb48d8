// Cascade prefix attention for a CPU decode step in bf16, with AVX512-BF16 dot products.
// The torch reference, the layouts and why: kernels/cpu_prefix_attention.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

namespace {

constexpr int KB = 16;    // keys per score vector (one K block of the packed layout)
constexpr int TILE = 128;  // keys per online-softmax update
constexpr int KS = 4;     // key blocks per register block of the scores
constexpr int RB = 4;     // query rows per register block

// e^x for x <= 0, relative error below 1e-6 for x > -80 (x below -87 gives ~0)
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
  __m512 p = _mm512_set1_ps(1.f / 5040);  // e^f for |f| <= ln2 / 2: Taylor to degree 7
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// Rows q [R, D/2] (bf16 pairs) over keys [s0, s1) of one head -> unnormalised out [R, D] fp32 with
// each row's running max m and sum l (of exp(score - m)).
template <int D>
void attend_range(const uint32_t* q, const uint16_t* kp, const uint16_t* vp, int R, int s0, int s1,
                  float scale, float* out, float* m, float* l) {
  constexpr int P = D / 2, DV = D / 16, RV = D == 64 ? 4 : 2;  // RV rows x DV vectors in registers
  std::fill(out, out + R * D, 0.f);
  std::fill(m, m + R, -std::numeric_limits<float>::infinity());
  std::fill(l, l + R, 0.f);
  alignas(64) float s[RB][TILE];
  alignas(64) uint16_t pb[RB][TILE];
  for (int t0 = s0; t0 < s1; t0 += TILE) {
    const int nb = std::min(TILE, s1 - t0) / KB;
    for (int r0 = 0; r0 < R; r0 += RB) {
      const int rn = std::min(RB, R - r0);
      for (int b = 0; b < nb; b += KS) {  // scores: lanes are 16 keys, each dot product in D/2 pair steps
        const int bn = std::min(KS, nb - b);
        const uint16_t* kb = kp + (int64_t)(t0 / KB + b) * P * 32;
        __m512 acc[RB][KS];
        for (int i = 0; i < RB; ++i)
          for (int j = 0; j < KS; ++j) acc[i][j] = _mm512_setzero_ps();
        for (int p = 0; p < P; ++p) {
          __m512bh kv[KS];
          for (int j = 0; j < KS; ++j) kv[j] = as_bh(_mm512_loadu_si512(kb + ((j < bn ? j : 0) * P + p) * 32));
          for (int i = 0; i < RB; ++i) {
            const __m512bh qv = as_bh(_mm512_set1_epi32((int)q[(r0 + std::min(i, rn - 1)) * P + p]));
            for (int j = 0; j < KS; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], qv, kv[j]);
          }
        }
        for (int i = 0; i < RB; ++i)
          for (int j = 0; j < bn; ++j)
            _mm512_store_ps(&s[i][(b + j) * KB], _mm512_mul_ps(acc[i][j], _mm512_set1_ps(scale)));
      }
      float alpha[RB];
      for (int i = 0; i < rn; ++i) {  // online softmax: new max, rescale, probabilities in bf16
        const int r = r0 + i;
        __m512 mx = _mm512_load_ps(&s[i][0]);
        for (int b = 1; b < nb; ++b) mx = _mm512_max_ps(mx, _mm512_load_ps(&s[i][b * KB]));
        const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
        alpha[i] = std::exp(m[r] - m_new);
        __m512 sum = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
          const __m512 p = exp_ps(_mm512_sub_ps(_mm512_load_ps(&s[i][b * KB]), _mm512_set1_ps(m_new)));
          sum = _mm512_add_ps(sum, p);
          _mm256_storeu_si256((__m256i*)&pb[i][b * KB], (__m256i)_mm512_cvtneps_pbh(p));
        }
        l[r] = l[r] * alpha[i] + _mm512_reduce_add_ps(sum);
        m[r] = m_new;
      }
      for (int i0 = 0; i0 < rn; i0 += RV) {  // out += P V: lanes are 16 dims, key pairs per step
        const int iv = std::min(RV, rn - i0);
        __m512 acc[RV][DV];
        for (int i = 0; i < RV; ++i)
          for (int d = 0; d < DV; ++d)
            acc[i][d] = i < iv ? _mm512_mul_ps(_mm512_loadu_ps(out + (r0 + i0 + i) * D + d * 16),
                                               _mm512_set1_ps(alpha[i0 + i]))
                               : _mm512_setzero_ps();
        for (int jp = 0; jp < nb * KB / 2; ++jp) {
          const uint16_t* vrow = vp + (int64_t)(t0 / 2 + jp) * D * 2;
          __m512bh pp[RV];
          for (int i = 0; i < RV; ++i) {
            uint32_t pair;
            std::memcpy(&pair, &pb[i0 + std::min(i, iv - 1)][2 * jp], 4);
            pp[i] = as_bh(_mm512_set1_epi32((int)pair));
          }
          for (int d = 0; d < DV; ++d) {
            const __m512bh vv = as_bh(_mm512_loadu_si512(vrow + d * 32));
            for (int i = 0; i < RV; ++i) acc[i][d] = _mm512_dpbf16_ps(acc[i][d], pp[i], vv);
          }
        }
        for (int i = 0; i < iv; ++i)
          for (int d = 0; d < DV; ++d) _mm512_storeu_ps(out + (r0 + i0 + i) * D + d * 16, acc[i][d]);
      }
    }
  }
}

// q [H, R, D] bf16; kp [H, S/16, D/2, 16, 2] and vp [H, S/2, D, 2] bf16 -> out [H, R, D], lse [H, R] fp32
std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q, const at::Tensor& kp,
                                                    const at::Tensor& vp, double scale, int64_t chunks) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kp.scalar_type() == at::kBFloat16 &&
              vp.scalar_type() == at::kBFloat16, "prefix_attention: bf16 tensors expected");
  TORCH_CHECK(q.is_contiguous() && kp.is_contiguous() && vp.is_contiguous(), "contiguous tensors expected");
  const int H = q.size(0), R = q.size(1), D = q.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head dim 64 or 128 expected");
  TORCH_CHECK(kp.dim() == 5 && kp.size(0) == H && kp.size(2) == D / 2 && kp.size(3) == KB, "packed keys");
  const int blocks = kp.size(1), S = blocks * KB;
  TORCH_CHECK(vp.dim() == 4 && vp.size(1) * 2 == S && vp.size(2) == D, "packed values");
  const int per = (blocks + std::max<int64_t>(chunks, 1) - 1) / std::max<int64_t>(chunks, 1);
  const int C = (blocks + per - 1) / per;  // every chunk has keys
  auto f32 = q.options().dtype(at::kFloat);
  auto part = at::empty({H, C, R, D}, f32), pm = at::empty({H, C, R}, f32), pl = at::empty({H, C, R}, f32);
  const auto* qd = reinterpret_cast<const uint32_t*>(q.data_ptr<at::BFloat16>());
  const auto* kd = reinterpret_cast<const uint16_t*>(kp.data_ptr<at::BFloat16>());
  const auto* vd = reinterpret_cast<const uint16_t*>(vp.data_ptr<at::BFloat16>());
  float *po = part.data_ptr<float>(), *pmd = pm.data_ptr<float>(), *pld = pl.data_ptr<float>();
  at::parallel_for(0, H * C, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int h = t / C, c = t % C, s0 = c * per * KB, s1 = std::min(S, s0 + per * KB);
      const uint32_t* qh = qd + (int64_t)h * R * D / 2;
      const uint16_t* kh = kd + (int64_t)h * S * D;
      const uint16_t* vh = vd + (int64_t)h * S * D;
      auto run = D == 64 ? attend_range<64> : attend_range<128>;
      run(qh, kh, vh, R, s0, s1, (float)scale, po + t * R * D, pmd + t * R, pld + t * R);
    }
  });
  auto out = at::empty({H, R, D}, f32), lse = at::empty({H, R}, f32);
  float *od = out.data_ptr<float>(), *ld = lse.data_ptr<float>();
  for (int h = 0; h < H; ++h) {  // merge the chunks by their log-sum-exp
    for (int r = 0; r < R; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int c = 0; c < C; ++c) mx = std::max(mx, pmd[(h * C + c) * R + r]);
      float total = 0.f;
      for (int c = 0; c < C; ++c) total += pld[(h * C + c) * R + r] * std::exp(pmd[(h * C + c) * R + r] - mx);
      float* o = od + (h * R + r) * D;
      std::fill(o, o + D, 0.f);
      for (int c = 0; c < C; ++c) {
        const float w = std::exp(pmd[(h * C + c) * R + r] - mx) / total;
        const float* src = po + ((int64_t)(h * C + c) * R + r) * D;
        for (int d = 0; d < D; ++d) o[d] += w * src[d];
      }
      ld[h * R + r] = mx + std::log(total);
    }
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(sparrow_cpu, m) {
  m.def("prefix_attention(Tensor q, Tensor kp, Tensor vp, float scale, int chunks) -> (Tensor, Tensor)");
  m.impl("prefix_attention", c10::DispatchKey::CPU, TORCH_FN(prefix_attention));
}
