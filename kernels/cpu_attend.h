// The attention kernel shared by the decode prefix op (cpu_attention.cpp) and the causal prefill op
// (cpu_prefill.cpp): bf16 operands multiplied with vdpbf16ps (pairs of bf16 products accumulated in fp32),
// or fp32 ones with FMAs, over keys and values packed as kernels/cpu_attention.py describes.
#pragma once
#include "cpu_simd.h"

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
// query rows per register block of the scores (RB x BLOCKS accumulators) and of the values (RV x D/16)
constexpr int RB = 4;
template <int D> constexpr int RV = D == 64 ? 4 : 2;
// AVX2's sub-blocks (its 16 registers hold 8 lanes: the blocks above would spill on every step): the scores
// of SCORE_ROWS rows x SCORE_BLOCKS key blocks, the output in VALUE_DIMS vectors of 16 dims a pass
constexpr int SCORE_ROWS = 4, SCORE_BLOCKS = 1, VALUE_DIMS = 2;

using simd::as_bh;

// The scores of NR rows qi[i0..] against NB blocks kj[j0..] of 16 packed keys -> s[i0 + i][(j0 + j) * 16 ..]
// times scale, the NR x NB accumulators in registers (its own function, so that GCC keeps them there).
template <int D, typename T, int NR, int NB>
inline void score_block(const T* const* qi, const T* const* kj, int i0, int j0, float scale, float (*s)[TILE]) {
  constexpr bool f32 = std::is_same_v<T, float>;
  constexpr int STEPS = f32 ? D : D / 2, LANE = f32 ? 1 : 2;  // elements of q per step
  simd::vf acc[NR][NB];
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = simd::zero();
  for (int p = 0; p < STEPS; ++p) {
    simd::vi kv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) kv[j] = simd::loadu_bits(kj[j0 + j] + p * 16 * LANE);
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      int32_t qp;  // q's element (fp32) or pair of elements (bf16) of this step, as bits
      std::memcpy(&qp, qi[i0 + i] + p * LANE, 4);
      const simd::vi qv = simd::set1_bits(qp);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j)
        if constexpr (f32) acc[i][j] = simd::fmadd(simd::as_f32(qv), simd::as_f32(kv[j]), acc[i][j]);
        else acc[i][j] = simd::dpbf16(acc[i][j], as_bh(qv), as_bh(kv[j]));
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j)
      simd::store(&s[i0 + i][(j0 + j) * KEYS], simd::mul(acc[i][j], simd::set1(scale)));
}

// Scores of rows q [rn <= RB, D] against nb <= BLOCKS blocks of 16 packed keys kb -> s [RB][TILE] fp32 times
// scale. bf16 (T = uint16_t, the bits): blocks [D/2, 16, 2], one vdpbf16ps per pair of dims; fp32: blocks
// [D, 16], one FMA per dim. With AVX512 all RB x BLOCKS accumulators at once; with AVX2 in sub-blocks.
template <int D, typename T>
inline void scores(const T* q, int rn, const T* kb, int nb, float scale, float (*s)[TILE]) {
  constexpr int SR = SPARROW_SIMD_AVX512 ? RB : std::min(RB, SCORE_ROWS);
  constexpr int SB = SPARROW_SIMD_AVX512 ? BLOCKS : SCORE_BLOCKS;
  const T* kj[BLOCKS];
  for (int j = 0; j < BLOCKS; ++j) kj[j] = kb + (j < nb ? j : 0) * D * 16;
  const T* qi[RB];
  for (int i = 0; i < RB; ++i) qi[i] = q + std::min(i, rn - 1) * D;
  for (int i0 = 0; i0 < RB; i0 += SR)
    for (int j0 = 0; j0 < BLOCKS; j0 += SB)
      if (i0 < rn && j0 < nb) score_block<D, T, SR, SB>(qi, kj, i0, j0, scale, s);
}

// Rows [0, NR) of a register block (iv of them real) and dims [d0 * 16, (d0 + ND) * 16) of out (rows of D):
// out = alpha out + P V over the keys k0 .. k0 + n, P the block's probabilities (s in fp32, pb in bf16).
template <int D, typename T, int NR, int ND>
inline void value_block(float* out, const float* alpha, const float (*s)[TILE], const uint16_t (*pb)[TILE], int iv,
                        const T* vp, int k0, int n, int d0) {
  simd::vf o[NR][ND];
  for (int i = 0; i < NR; ++i)
    for (int d = 0; d < ND; ++d)
      o[i][d] = i < iv ? simd::mul(simd::loadu(out + i * D + (d0 + d) * 16), simd::set1(alpha[i])) : simd::zero();
  if constexpr (std::is_same_v<T, float>) {
    for (int j = 0; j < n; ++j) {  // one key per step: lanes are 16 dims
      const float* vrow = vp + (int64_t)(k0 + j) * D + d0 * 16;
      simd::vf pp[NR];
      for (int i = 0; i < NR; ++i) pp[i] = simd::set1(s[std::min(i, iv - 1)][j]);
      for (int d = 0; d < ND; ++d) {
        const simd::vf vv = simd::loadu(vrow + d * 16);
        for (int i = 0; i < NR; ++i) o[i][d] = simd::fmadd(pp[i], vv, o[i][d]);
      }
    }
  } else {
    for (int jp = 0; jp < n / 2; ++jp) {
      const uint16_t* vrow = vp + (int64_t)(k0 / 2 + jp) * D * 2 + d0 * 32;
      simd::vbh pp[NR];
      for (int i = 0; i < NR; ++i) pp[i] = as_bh(simd::set1_bits(*(const int*)&pb[std::min(i, iv - 1)][2 * jp]));
      for (int d = 0; d < ND; ++d) {
        const simd::vbh vv = as_bh(simd::loadu_bits(vrow + d * 32));
        for (int i = 0; i < NR; ++i) o[i][d] = simd::dpbf16(o[i][d], pp[i], vv);
      }
    }
  }
  alignas(64) float ob[NR][ND * 16];
  for (int i = 0; i < NR; ++i)
    for (int d = 0; d < ND; ++d) simd::store(&ob[i][d * 16], o[i][d]);
  if constexpr (ND * 16 == D) {
    std::copy_n(&ob[0][0], iv * D, out);
  } else {
    for (int i = 0; i < iv; ++i) std::copy_n(&ob[i][0], ND * 16, out + i * D + d0 * 16);
  }
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
  constexpr int DV = D / 16, VD = SPARROW_SIMD_AVX512 ? DV : std::min(DV, VALUE_DIMS);  // a row's vectors, a pass's
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
        simd::vmask mask[BLOCKS];
        simd::vf mx = simd::set1(-std::numeric_limits<float>::infinity());
        for (int b = 0; b < nb; ++b) {
          const int n = std::max(0, std::min(KEYS, visible - b * KEYS));
          mask[b] = simd::prefix(n);
          mx = simd::mask_max(mx, mask[b], mx, simd::load(&s[i][b * KEYS]));
        }
        const float m_new = std::max(m[r], simd::reduce_max(mx));
        alpha[i] = std::exp(m[r] - m_new);
        simd::vf sum = simd::zero();
        for (int b = 0; b < nb; ++b) {
          const simd::vf x = simd::sub(simd::load(&s[i][b * KEYS]), simd::set1(m_new));
          const simd::vf p = simd::maskz_mov(mask[b], simd::exp_le0(x));
          sum = simd::add(sum, p);
          if constexpr (f32) simd::store(&s[i][b * KEYS], p);
          else _mm256_store_si256((__m256i*)&pb[i][b * KEYS], simd::to_bf16(p));
        }
        l[r] = l[r] * alpha[i] + simd::reduce_add(sum);
        m[r] = m_new;
      }
      for (int i0 = 0; i0 < rn; i0 += RV<D>)  // out = alpha out + P V: lanes are 16 dims, key pairs per step
        for (int d0 = 0; d0 < DV; d0 += VD)
          value_block<D, T, RV<D>, VD>(out + (r0 + i0) * D, alpha + i0, s + i0, pb + i0, std::min(RV<D>, rn - i0),
                                       vp, k0, nb * KEYS, d0);
    }
  }
}

}  // namespace sparrow_attend
