// Sampling a decode step's tokens on the CPU: the exponential race in one pass over each row.
// The torch reference and why: stages/rollout/sampler.py (race_sample_reference).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "cpu_simd.h"

namespace {

constexpr uint64_t GOLDEN = 0x9e3779b97f4a7c15ull;  // splitmix64's increment

// ln x for normal x > 0: x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s), s = (m - 1) / (m + 1),
// |s| <= 0.172, by its series to s^11 (relative error below 1e-7)
inline simd::vf log_series(simd::vf m, simd::vf e) {
  const simd::vf one = simd::set1(1.f);
  const simd::vf s = simd::div(simd::sub(m, one), simd::add(m, one)), s2 = simd::mul(s, s);
  simd::vf p = simd::set1(2.f / 11);
  p = simd::fmadd(p, s2, simd::set1(2.f / 9));
  p = simd::fmadd(p, s2, simd::set1(2.f / 7));
  p = simd::fmadd(p, s2, simd::set1(2.f / 5));
  p = simd::fmadd(p, s2, simd::set1(2.f / 3));
  p = simd::fmadd(p, s2, simd::set1(2.f));
  return simd::fmadd(e, simd::set1(0.69314718055994531f), simd::mul(p, s));
}

#if SPARROW_SIMD_AVX512

// splitmix64's output function: 64 well-mixed bits from a counter
inline __m512i mix64(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(0xbf58476d1ce4e5b9ll));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(0x94d049bb133111ebll));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

inline __m512 log_ps(__m512 x) {
  __m512 e = _mm512_getexp_ps(x);
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.f));
  return log_series(m, e);
}

// U_v of elements v0 .. v0 + 15 (v0 even): 24 bits of splitmix64(seed + (v / 2 + 1) * golden), the low
// 32-bit half for an even v, the high half for an odd one, centred in their cell
inline __m512 uniform16(uint64_t seed, int64_t v0) {
  const __m512i pair = _mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8);  // counters of elements 0-15
  const __m512i ctr = _mm512_add_epi64(pair, _mm512_set1_epi64(v0 / 2));
  const __m512i bits = mix64(_mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(seed)),
                                              _mm512_mullo_epi64(ctr, _mm512_set1_epi64(GOLDEN))));
  // 32-bit lanes are (low, high) halves in element order
  return _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 8)), _mm512_set1_ps(0.5f)),
                       _mm512_set1_ps(1.f / 16777216));
}

// the race's running best: lanes of x in `in` that beat best replace it, with their element index
inline void keep_better(__m512 x, __mmask16 in, int64_t v0, __m512& best, __m512i& best_at) {
  const __mmask16 better = _mm512_mask_cmp_ps_mask(in, x, best, _CMP_GT_OQ);
  best = _mm512_mask_mov_ps(best, better, x);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  best_at = _mm512_mask_mov_epi32(best_at, better, _mm512_add_epi32(lane, _mm512_set1_epi32((int)v0)));
}

inline __m512i no_index() { return _mm512_set1_epi32(-1); }
inline void store_index(int32_t* p, __m512i x) { _mm512_store_si512(p, x); }

#else  // AVX2: 64-bit lanes four to a half, the low 64 bits of a product from 32-bit ones

inline __m256i mullo64(__m256i a, __m256i b) {
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b),
                                         _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)));
  return _mm256_add_epi64(_mm256_mul_epu32(a, b), _mm256_slli_epi64(cross, 32));
}

inline __m256i mix64(__m256i z) {
  z = mullo64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), _mm256_set1_epi64x(0xbf58476d1ce4e5b9ll));
  z = mullo64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), _mm256_set1_epi64x(0x94d049bb133111ebll));
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

// x = m 2^e with m in [sqrt(1/2), sqrt(2)) for a normal x > 0 (getexp and getmant, then m > sqrt(2) halved)
inline __m256 mantissa8(__m256 x, __m256& e) {
  const __m256i bits = _mm256_castps_si256(x);
  e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)),
                                                 _mm256_set1_epi32(0x3f800000)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
  e = _mm256_blendv_ps(e, _mm256_add_ps(e, _mm256_set1_ps(1.f)), big);
  return _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
}

inline simd::vf log_ps(simd::vf x) {
  simd::vf m, e;
  m.lo = mantissa8(x.lo, e.lo), m.hi = mantissa8(x.hi, e.hi);
  return log_series(m, e);
}

inline __m256 uniform8(uint64_t seed, int64_t first_counter) {
  const __m256i ctr = _mm256_add_epi64(_mm256_setr_epi64x(0, 1, 2, 3), _mm256_set1_epi64x(first_counter));
  const __m256i bits = mix64(_mm256_add_epi64(_mm256_set1_epi64x(static_cast<int64_t>(seed)),
                                              mullo64(ctr, _mm256_set1_epi64x(GOLDEN))));
  return _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bits, 8)), _mm256_set1_ps(0.5f)),
                       _mm256_set1_ps(1.f / 16777216));
}

inline simd::vf uniform16(uint64_t seed, int64_t v0) {  // as the AVX512 one: counters v0 / 2 + 1 ...
  return {uniform8(seed, v0 / 2 + 1), uniform8(seed, v0 / 2 + 5)};
}

inline void keep_better(simd::vf x, simd::vmask in, int64_t v0, simd::vf& best, simd::vi& best_at) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i base = _mm256_add_epi32(lane, _mm256_set1_epi32((int)v0));
  const __m256 lo = _mm256_and_ps(_mm256_cmp_ps(x.lo, best.lo, _CMP_GT_OQ), _mm256_castsi256_ps(in.lo));
  const __m256 hi = _mm256_and_ps(_mm256_cmp_ps(x.hi, best.hi, _CMP_GT_OQ), _mm256_castsi256_ps(in.hi));
  best = {_mm256_blendv_ps(best.lo, x.lo, lo), _mm256_blendv_ps(best.hi, x.hi, hi)};
  best_at = {_mm256_blendv_epi8(best_at.lo, base, _mm256_castps_si256(lo)),
             _mm256_blendv_epi8(best_at.hi, _mm256_add_epi32(base, _mm256_set1_epi32(8)), _mm256_castps_si256(hi))};
}

inline simd::vi no_index() { return simd::set1_bits(-1); }
inline void store_index(int32_t* p, simd::vi x) {
  _mm256_store_si256((__m256i*)p, x.lo), _mm256_store_si256((__m256i*)p + 1, x.hi);
}

#endif

// logp [B, V] fp32 (log-probabilities; -inf never drawn), seeds [B] int64 -> tokens [B] int64: per row
// argmax_v logp_v - ln E_v, i.e. argmax p_v / E_v with E_v = -ln U_v ~ Exp(1), which draws v with
// probability p_v (E_v floored at 2^-25, below). U_v = (bits + 0.5) / 2^24 from 24 bits of one 32-bit half of
// splitmix64(seed + (v / 2 + 1) * golden): element v takes the low half when v is even, the high half when odd.
at::Tensor race_sample(const at::Tensor& logp, const at::Tensor& seeds) {
  TORCH_CHECK(logp.scalar_type() == at::kFloat && logp.dim() == 2 && logp.is_contiguous(), "logp [B, V] fp32");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.numel() == logp.size(0), "seeds [B] int64");
  const int64_t B = logp.size(0), V = logp.size(1);
  auto tokens = at::empty({B}, seeds.options());
  const float* lp = logp.data_ptr<float>();
  const auto sc = seeds.contiguous();
  const int64_t* sd = sc.data_ptr<int64_t>();
  int64_t* td = tokens.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = lp + b * V;
      const uint64_t seed = static_cast<uint64_t>(sd[b]);
      simd::vf best = simd::set1(-std::numeric_limits<float>::infinity());
      simd::vi best_at = no_index();
      for (int64_t v = 0; v < V; v += 16) {
        const simd::vmask in = simd::prefix(V - v >= 16 ? 16 : (int)(V - v));
        // E >= 2^-25: fp32 rounds the top cell's U up to 1, where -ln U = 0 would make the token win
        // whatever its probability; 2^-25 is -ln U of that cell's exact U
        const simd::vf e = simd::max(simd::sub(simd::zero(), log_ps(uniform16(seed, v))), simd::set1(0x1p-25f));
        keep_better(simd::sub(simd::maskz_loadu(in, row + v), log_ps(e)), in, v, best, best_at);
      }
      alignas(64) float bv[16];
      alignas(64) int32_t bi[16];
      simd::store(bv, best);
      store_index(bi, best_at);
      int64_t token = 0;
      float top = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < 16; ++i)
        if (bi[i] >= 0 && (bv[i] > top || (bv[i] == top && bi[i] < token))) top = bv[i], token = bi[i];
      td[b] = token;
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparrow_cpu, m) {
  m.def("race_sample(Tensor logp, Tensor seeds) -> Tensor");
  m.impl("race_sample", c10::DispatchKey::CPU, TORCH_FN(race_sample));
}
