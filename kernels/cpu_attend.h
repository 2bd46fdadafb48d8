// The attention kernel shared by the decode prefix op (cpu_attention.cpp) and the causal prefill op
// (cpu_prefill.cpp): bf16 operands multiplied with vdpbf16ps (pairs of bf16 products accumulated in fp32),
// or fp32 ones with FMAs, over keys and values packed as kernels/cpu_attention.py describes.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace sparrow_attend {

constexpr int KEYS = 16;   // keys per score vector (one block of the packed key layout)
constexpr int TILE = 64;   // keys per online-softmax update: a tile's K and V (16 KB at D = 64) stay in L1
constexpr int BLOCKS = TILE / KEYS;
constexpr int RB = 4;      // query rows per register block

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

// Scores of rows q [rn <= RB, D] against nb <= BLOCKS blocks of 16 packed keys kb -> s [RB][TILE] fp32
// times scale. bf16 (T = uint16_t, the bits): blocks [D/2, 16, 2], one vdpbf16ps per pair of dims; fp32:
// blocks [D, 16], one FMA per dim. Its own function, so that GCC keeps the 16 accumulators in registers.
template <int D, typename T>
inline void scores(const T* q, int rn, const T* kb, int nb, float scale, float (*s)[TILE]) {
  constexpr bool f32 = std::is_same_v<T, float>;
  constexpr int STEPS = f32 ? D : D / 2, LANE = f32 ? 1 : 2;  // elements of q per step
  __m512 acc[RB][BLOCKS];
#pragma GCC unroll 4
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < BLOCKS; ++j) acc[i][j] = _mm512_setzero_ps();
  const T* kj[BLOCKS];
  for (int j = 0; j < BLOCKS; ++j) kj[j] = kb + (j < nb ? j : 0) * D * 16;
  const T* qi[RB];
  for (int i = 0; i < RB; ++i) qi[i] = q + std::min(i, rn - 1) * D;
  for (int p = 0; p < STEPS; ++p) {
    __m512i kv[BLOCKS];
#pragma GCC unroll 4
    for (int j = 0; j < BLOCKS; ++j) kv[j] = _mm512_loadu_si512(kj[j] + p * 16 * LANE);
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) {
      int32_t qp;  // q's element (fp32) or pair of elements (bf16) of this step, as bits
      std::memcpy(&qp, qi[i] + p * LANE, 4);
      const __m512i qv = _mm512_set1_epi32(qp);
#pragma GCC unroll 4
      for (int j = 0; j < BLOCKS; ++j)
        if constexpr (f32) acc[i][j] = _mm512_fmadd_ps(_mm512_castsi512_ps(qv), _mm512_castsi512_ps(kv[j]), acc[i][j]);
        else acc[i][j] = _mm512_dpbf16_ps(acc[i][j], as_bh(qv), as_bh(kv[j]));
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < BLOCKS; ++j) _mm512_store_ps(&s[i][j * KEYS], _mm512_mul_ps(acc[i][j], _mm512_set1_ps(scale)));
}

// Rows q [R, D] (bf16 bits) of one head over its keys [s0, s1) (s0 a multiple of 16), each row only up
// to its position when pos [R] (non-decreasing) is given (causal): kp [*, D/2, 16, 2] (packed keys), vp [*,
// D, 2] (packed values) -> unnormalised out [R, D] fp32 with each row's running max m and sum l (of
// exp(score - m)). Online softmax over key tiles; the probabilities are rounded to bf16 for the value
// product (as PyTorch's flash kernel does in bf16). T = float: the fp32 twin, rows q [R, D], keys packed
// [*, D, 16], values [*, D] as they are, fp32 probabilities and FMAs throughout.
template <int D, typename T = uint16_t>
void attend(const T* q, const int* pos, int R, const T* kp, const T* vp, int s0, int s1, float scale, float* out,
            float* m, float* l) {
  constexpr bool f32 = std::is_same_v<T, float>;
  constexpr int DV = D / 16;
  std::fill(out, out + R * D, 0.f);
  std::fill(m, m + R, -std::numeric_limits<float>::infinity());
  std::fill(l, l + R, 0.f);
  alignas(64) float s[RB][TILE];
  alignas(64) uint16_t pb[RB][TILE];  // bf16 probabilities (f32: they stay in s)
  auto end = [&](int r) { return pos ? std::min(s1, pos[r] + 1) : s1; };  // a row's keys end here
  for (int k0 = s0; k0 < end(R - 1); k0 += TILE) {
    for (int r0 = 0; r0 < R; r0 += RB) {
      const int rn = std::min(RB, R - r0);
      const int last = end(r0 + rn - 1);
      if (last <= k0) continue;  // these rows see none of the tile's keys
      const int nb = std::min(BLOCKS, (last - k0 + KEYS - 1) / KEYS);
      scores<D>(q + r0 * D, rn, kp + (int64_t)k0 * D, nb, scale, s);
      float alpha[RB];
      for (int i = 0; i < rn; ++i) {  // online softmax over the keys <= the row's position
        const int r = r0 + i, visible = std::min(nb * KEYS, end(r) - k0);
        if (visible <= 0) {  // nothing visible in this tile (only with rows of several positions)
          alpha[i] = 1.f;
          std::fill(pb[i], pb[i] + nb * KEYS, 0);
          std::fill(s[i], s[i] + nb * KEYS, 0.f);
          continue;
        }
        __mmask16 mask[BLOCKS];
        __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int b = 0; b < nb; ++b) {
          const int n = std::max(0, std::min(KEYS, visible - b * KEYS));
          mask[b] = (__mmask16)((1u << n) - 1);
          mx = _mm512_mask_max_ps(mx, mask[b], mx, _mm512_load_ps(&s[i][b * KEYS]));
        }
        const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
        alpha[i] = std::exp(m[r] - m_new);
        __m512 sum = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
          const __m512 x = _mm512_sub_ps(_mm512_load_ps(&s[i][b * KEYS]), _mm512_set1_ps(m_new));
          const __m512 p = _mm512_maskz_mov_ps(mask[b], exp_ps(x));
          sum = _mm512_add_ps(sum, p);
          if constexpr (f32) _mm512_store_ps(&s[i][b * KEYS], p);
          else _mm256_store_si256((__m256i*)&pb[i][b * KEYS], (__m256i)_mm512_cvtneps_pbh(p));
        }
        l[r] = l[r] * alpha[i] + _mm512_reduce_add_ps(sum);
        m[r] = m_new;
      }
      constexpr int RV = D == 64 ? 4 : 2;  // RV rows x DV vectors of the output in registers
      for (int i0 = 0; i0 < rn; i0 += RV) {  // out = alpha out + P V: lanes are 16 dims, key pairs per step
        const int iv = std::min(RV, rn - i0);
        __m512 o[RV][DV];
        for (int i = 0; i < RV; ++i)
          for (int d = 0; d < DV; ++d)
            o[i][d] = i < iv ? _mm512_mul_ps(_mm512_loadu_ps(out + (r0 + i0 + i) * D + d * 16),
                                             _mm512_set1_ps(alpha[i0 + i]))
                             : _mm512_setzero_ps();
        if constexpr (f32) {
          for (int j = 0; j < nb * KEYS; ++j) {  // one key per step: lanes are 16 dims
            const float* vrow = vp + (int64_t)(k0 + j) * D;
            __m512 pp[RV];
            for (int i = 0; i < RV; ++i) pp[i] = _mm512_set1_ps(s[i0 + std::min(i, iv - 1)][j]);
            for (int d = 0; d < DV; ++d) {
              const __m512 vv = _mm512_loadu_ps(vrow + d * 16);
              for (int i = 0; i < RV; ++i) o[i][d] = _mm512_fmadd_ps(pp[i], vv, o[i][d]);
            }
          }
        } else {
          for (int jp = 0; jp < nb * KEYS / 2; ++jp) {
            const uint16_t* vrow = vp + (int64_t)(k0 / 2 + jp) * D * 2;
            __m512bh pp[RV];
            for (int i = 0; i < RV; ++i)
              pp[i] = as_bh(_mm512_set1_epi32(*(const int*)&pb[i0 + std::min(i, iv - 1)][2 * jp]));
            for (int d = 0; d < DV; ++d) {
              const __m512bh vv = as_bh(_mm512_loadu_si512(vrow + d * 32));
              for (int i = 0; i < RV; ++i) o[i][d] = _mm512_dpbf16_ps(o[i][d], pp[i], vv);
            }
          }
        }
        alignas(64) float ob[RV][D];
        for (int i = 0; i < RV; ++i)
          for (int d = 0; d < DV; ++d) _mm512_store_ps(&ob[i][d * 16], o[i][d]);
        std::copy_n(&ob[0][0], iv * D, out + (r0 + i0) * D);
      }
    }
  }
}

}  // namespace sparrow_attend
