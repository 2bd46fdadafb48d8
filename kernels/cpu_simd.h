// The vector operations the CPU kernels are written in: 16 fp32 lanes (vf), 512 bits of integers (vi), 32
// bf16 values (vbh, pairs per fp32 lane) and a 16-lane mask (vmask). With AVX512-BF16 each is one
// instruction (the wrappers only rename the intrinsics); with AVX2 and FMA a vector is two 256-bit halves,
// a mask is a lane mask per half, and the bf16 dot product is two FMAs on the widened even and odd values
// (each product of two bf16 values is exact in fp32, so a pair sums as vdpbf16ps sums it: odd, then even).
// Masks are prefixes of the lanes (the first n): the masked bf16 loads and stores of AVX2 rely on it.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define SPARROW_SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define SPARROW_SIMD_AVX512 0
#else
#error "the CPU kernels need AVX512-BF16, or AVX2 and FMA"
#endif

namespace simd {

#if SPARROW_SIMD_AVX512

using vf = __m512;
using vi = __m512i;
using vbh = __m512bh;
using vmask = __mmask16;

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf loadu(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const float* p) { return _mm512_load_ps(p); }
inline void storeu(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline void store(float* p, vf x) { _mm512_store_ps(p, x); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(vf x) { return _mm512_reduce_add_ps(x); }
inline float reduce_max(vf x) { return _mm512_reduce_max_ps(x); }

inline vmask prefix(int n) { return (__mmask16)((1u << n) - 1); }  // the first n lanes, 0 <= n <= 16
inline vmask all() { return (__mmask16)0xffff; }
inline vf maskz_loadu(vmask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void mask_storeu(float* p, vmask m, vf x) { _mm512_mask_storeu_ps(p, m, x); }
inline vf mask_max(vf src, vmask m, vf a, vf b) { return _mm512_mask_max_ps(src, m, a, b); }
inline vf maskz_mov(vmask m, vf x) { return _mm512_maskz_mov_ps(m, x); }

// integers and bits
inline vi loadu_bits(const void* p) { return _mm512_loadu_si512(p); }
inline vi set1_bits(int32_t x) { return _mm512_set1_epi32(x); }
inline vf as_f32(vi x) { return _mm512_castsi512_ps(x); }
inline vbh as_bh(vi x) { return (__m512bh)x; }

// bf16
inline vf widen_bf16(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }
inline vf load_bf16(const void* p) { return widen_bf16(_mm256_loadu_si256((const __m256i*)p)); }
inline vf maskz_load_bf16(vmask m, const void* p) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
inline __m256i to_bf16(vf x) { return (__m256i)_mm512_cvtneps_pbh(x); }  // rounded to nearest even
inline void mask_store_bf16(void* p, vmask m, vf x) { _mm256_mask_storeu_epi16(p, m, to_bf16(x)); }
inline vbh pack_bf16(vf hi, vf lo) { return _mm512_cvtne2ps_pbh(hi, lo); }  // lo's 16 values, then hi's
inline vf dpbf16(vf acc, vbh a, vbh b) { return _mm512_dpbf16_ps(acc, a, b); }

inline vf round_nearest(vf x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vf scale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n a whole number

// 16 vectors -> one whose lane j is the sum of v[j]'s lanes (pairs, then quads, then 128-bit lanes combined)
inline vf sum_lanes16(const vf (&v)[16]) {
  __m512 a[8], b[4], c[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

#else  // AVX2 and FMA: two 256-bit halves

struct vf { __m256 lo, hi; };
struct vi { __m256i lo, hi; };
struct vbh { __m256i lo, hi; };  // 32 bf16 values: lo holds the pairs of fp32 lanes 0-7
struct vmask { __m256i lo, hi; };  // all ones in a lane that is on

inline vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
inline vf loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf load(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline void storeu(float* p, vf x) { _mm256_storeu_ps(p, x.lo), _mm256_storeu_ps(p + 8, x.hi); }
inline void store(float* p, vf x) { _mm256_store_ps(p, x.lo), _mm256_store_ps(p + 8, x.hi); }
inline vf add(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf sub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf mul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf div(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf max(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float reduce8_add(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_add(vf x) { return reduce8_add(_mm256_add_ps(x.lo, x.hi)); }
inline float reduce_max(vf x) {
  const __m256 m = _mm256_max_ps(x.lo, x.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline vmask prefix(int n) {  // the first n lanes, 0 <= n <= 16
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), nv = _mm256_set1_epi32(n);
  return {_mm256_cmpgt_epi32(nv, idx), _mm256_cmpgt_epi32(nv, _mm256_add_epi32(idx, _mm256_set1_epi32(8)))};
}
inline vmask all() { const __m256i v = _mm256_set1_epi32(-1); return {v, v}; }
inline int lanes_on(vmask m) {
  return __builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(m.lo))) +
         __builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(m.hi)));
}
inline vf maskz_loadu(vmask m, const float* p) { return {_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi)}; }
inline void mask_storeu(float* p, vmask m, vf x) { _mm256_maskstore_ps(p, m.lo, x.lo), _mm256_maskstore_ps(p + 8, m.hi, x.hi); }
inline vf mask_max(vf src, vmask m, vf a, vf b) {
  return {_mm256_blendv_ps(src.lo, _mm256_max_ps(a.lo, b.lo), _mm256_castsi256_ps(m.lo)),
          _mm256_blendv_ps(src.hi, _mm256_max_ps(a.hi, b.hi), _mm256_castsi256_ps(m.hi))};
}
inline vf maskz_mov(vmask m, vf x) {
  return {_mm256_and_ps(x.lo, _mm256_castsi256_ps(m.lo)), _mm256_and_ps(x.hi, _mm256_castsi256_ps(m.hi))};
}

inline vi loadu_bits(const void* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)p + 1)};
}
inline vi set1_bits(int32_t x) { const __m256i v = _mm256_set1_epi32(x); return {v, v}; }
inline vf as_f32(vi x) { return {_mm256_castsi256_ps(x.lo), _mm256_castsi256_ps(x.hi)}; }
inline vbh as_bh(vi x) { return {x.lo, x.hi}; }

inline __m256 widen8(__m128i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)); }
inline vf widen_bf16(__m256i x) { return {widen8(_mm256_castsi256_si128(x)), widen8(_mm256_extracti128_si256(x, 1))}; }
inline vf load_bf16(const void* p) { return widen_bf16(_mm256_loadu_si256((const __m256i*)p)); }
inline vf maskz_load_bf16(vmask m, const void* p) {
  const int n = lanes_on(m);
  if (n == 16) return load_bf16(p);
  alignas(32) uint16_t buf[16] = {};
  std::memcpy(buf, p, n * sizeof(uint16_t));
  return load_bf16(buf);
}
inline __m256i round8_bf16(__m256 x) {  // 8 fp32 -> their bf16 bits in 32-bit lanes, nearest even; NaN -> 0x7fc0
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}
inline __m256i to_bf16(vf x) {  // 16 bf16 values, lanes in order
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(round8_bf16(x.lo), round8_bf16(x.hi)), 0xD8);
}
inline void mask_store_bf16(void* p, vmask m, vf x) {
  alignas(32) uint16_t buf[16];
  _mm256_store_si256((__m256i*)buf, to_bf16(x));
  std::memcpy(p, buf, lanes_on(m) * sizeof(uint16_t));
}
inline vbh pack_bf16(vf hi, vf lo) { return {to_bf16(lo), to_bf16(hi)}; }
// the odd (high) and even (low) bf16 value of each pair of 8, widened to fp32
inline __m256 odd8(__m256i x) { return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000))); }
inline __m256 even8(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
inline vf odd_bf16(vi x) { return {odd8(x.lo), odd8(x.hi)}; }
inline vf even_bf16(vi x) { return {even8(x.lo), even8(x.hi)}; }
inline __m256 dp8(__m256 acc, __m256i a, __m256i b) {
  return _mm256_fmadd_ps(even8(a), even8(b), _mm256_fmadd_ps(odd8(a), odd8(b), acc));
}
inline vf dpbf16(vf acc, vbh a, vbh b) { return {dp8(acc.lo, a.lo, b.lo), dp8(acc.hi, a.hi, b.hi)}; }

inline vf round_nearest(vf x) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, mode), _mm256_round_ps(x.hi, mode)};
}
inline __m256 scale8_pow2(__m256 p, __m256 n) {  // n into the exponent field: for -126 <= n <= 127
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)));
}
inline vf scale_pow2(vf p, vf n) { return {scale8_pow2(p.lo, n.lo), scale8_pow2(p.hi, n.hi)}; }

inline __m256 sum_lanes8(const __m256* v) {  // lane j: the sum of v[j]'s 8 lanes
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
inline vf sum_lanes16(const vf (&v)[16]) {
  __m256 h[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) h[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {sum_lanes8(h), sum_lanes8(h + 8)};
}

#endif

// e^x for x <= 0, relative error below 1e-6 for x > -80 (x below -87 gives ~0)
inline vf exp_le0(vf x) {
  x = max(x, set1(-87.f));
  const vf t = mul(x, set1(1.44269504088896341f));
  const vf n = round_nearest(t);
  const vf f = mul(sub(t, n), set1(0.69314718055994531f));
  vf p = set1(1.f / 5040);  // e^f for |f| <= ln2 / 2: Taylor to degree 7
  p = fmadd(p, f, set1(1.f / 720));
  p = fmadd(p, f, set1(1.f / 120));
  p = fmadd(p, f, set1(1.f / 24));
  p = fmadd(p, f, set1(1.f / 6));
  p = fmadd(p, f, set1(0.5f));
  p = fmadd(p, f, set1(1.f));
  p = fmadd(p, f, set1(1.f));
  return scale_pow2(p, n);
}

}  // namespace simd
