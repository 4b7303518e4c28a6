// The row arithmetic of kiln's paged attention (paged_attention.cpp): a cache row's stored forms widened to float
// (float32, bfloat16, float16; int8 and float8_e4m3fn codes with a float32 scale after them), the exponential
// softmax uses, and the two inner products over a run of rows of one block: q . k for a group of query vectors and
// sum p v into their accumulators. The avx512 tier computes in zmm registers (16 floats), the avx2 tier in ymm.
//
// Included by one translation unit only: everything here has internal linkage.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KILN_ATTN_YMM 1
#endif

namespace {

struct Fp8E4M3 {  // a float8_e4m3fn code (the cache holds them as uint8)
  uint8_t x;
};

// A stored row's type: whether a float32 scale follows its D codes, and the factor the scale takes from the
// widening (fp8: widen gives the value / 256).
template <typename T>
struct Stored {
  static constexpr bool scaled = false;
  static constexpr float unit = 1.f;
};
template <>
struct Stored<int8_t> {
  static constexpr bool scaled = true;
  static constexpr float unit = 1.f;
};
template <>
struct Stored<Fp8E4M3> {
  static constexpr bool scaled = true;
  static constexpr float unit = 256.f;
};

// The scale of the row at `row` (D codes, then 4 bytes of float32), with its type's unit.
template <typename T>
inline float row_scale(const T* row, int64_t D) {
  float s;
  std::memcpy(&s, reinterpret_cast<const char*>(row + D), sizeof s);
  return s * Stored<T>::unit;
}

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  uint32_t bits = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(c10::Half v) { return static_cast<float>(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }
// e4m3 sign, exponent and mantissa moved into a half's (bias 7 -> 15): the code's value / 256, exactly, subnormals
// included (the cache never holds the NaN code: codes are clamped to +-448)
inline uint16_t fp8_half_bits(uint8_t b) { return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7)); }
inline float widen(Fp8E4M3 v) { return c10::detail::fp16_ieee_to_fp32_value(fp8_half_bits(v.x)); }

// exp(x) for x <= 0: 2^(x log2 e) = 2^k * 2^f with k = round(x log2 e), |f| <= 1/2, 2^f by its Taylor series to
// degree 7 (relative error < 1e-8 there); below -87 the result is 0, as expf's is within float range.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const int k = -static_cast<int>(0.5f - t);  // t <= 0: round half away from zero
  const float f = (t - static_cast<float>(k)) * 0.693147180559945309f;
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const uint32_t bits = static_cast<uint32_t>(k + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef KILN_ATTN_YMM
// exp_nonpositive for 8 values, op for op (GCC 12 leaves the scalar form's loop unvectorized: the exponential was
// about half of a one-row call's time on a 2-core EPYC).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256i k = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_set1_ps(0.5f), t)));
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, _mm256_cvtepi32_ps(k)), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(c));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(p, scale);
}
#endif

// s[j] = exp(s[j] - mx) for n scores; their sum.
inline float exponentiate(float* s, int64_t n, float mx) {
  float sum = 0.f;
  int64_t j = 0;
#ifdef KILN_ATTN_YMM
  __m256 sums = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(s + j, e);
    sums = _mm256_add_ps(sums, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sums);
  for (const float v : lanes) sum += v;
#endif
  for (; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - mx);
    sum += s[j];
  }
  return sum;
}

// The chunk's G running maxima, sums and weighted values: scores in `scores` (G x keys, scratch).
#ifdef KILN_ATTN_YMM
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // 8 bf16 widened: each the high half of its float
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#ifdef __F16C__
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const Fp8E4M3* p) {  // widen's bit move on 8 codes, then the halves' conversion
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_cvtph_ps(h);
}
#else
template <typename T>  // a tier without F16C: the scalar widening, 8 at a time
inline __m256 load8(const T* p) {
  alignas(32) float lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = widen(p[i]);
  return _mm256_load_ps(lanes);
}
#endif
#endif

#ifdef KILN_ATTN_YMM
// NG query heads against 4 keys k (rows of D values): 4 * NG independent accumulators, so the FMAs' latency is
// hidden (4 chains, one head at a time, waited on it: 2.5x slower here), each key vector read once for NG heads.
template <typename T, int NG>
inline void scores_of_4_keys(const float* q, const T* k, int64_t D, int64_t R, float scale, float* scores,
                             int64_t stride) {
  __m256 a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 k0 = load8(k + d), k1 = load8(k + R + d), k2 = load8(k + 2 * R + d), k3 = load8(k + 3 * R + d);
    for (int g = 0; g < NG; ++g) {
      const __m256 x = _mm256_loadu_ps(q + g * D + d);
      a[g][0] = _mm256_fmadd_ps(x, k0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(x, k1, a[g][1]);
      a[g][2] = _mm256_fmadd_ps(x, k2, a[g][2]);
      a[g][3] = _mm256_fmadd_ps(x, k3, a[g][3]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));  // k0..k3 x2
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(scores + g * stride, _mm_mul_ps(sum, _mm_set1_ps(scale)));
  }
}
#endif

#ifdef __AVX512F__
// The avx512 tier's forms: 16 values a register, each key (and value) vector read once for the GQA group.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const Fp8E4M3* p) {  // widen's bit move on 16 codes, then the halves' conversion
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_cvtph_ps(h);
}

inline __m256 fold(__m512 a) {  // the two 256-bit halves added
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// scores_of_4_keys with zmm accumulators (D a multiple of 16)
template <typename T, int NG>
inline void scores_of_4_keys_512(const float* q, const T* k, int64_t D, int64_t R, float scale, float* scores,
                                 int64_t stride) {
  __m512 a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 k0 = load16(k + d), k1 = load16(k + R + d), k2 = load16(k + 2 * R + d), k3 = load16(k + 3 * R + d);
    for (int g = 0; g < NG; ++g) {
      const __m512 x = _mm512_loadu_ps(q + g * D + d);
      a[g][0] = _mm512_fmadd_ps(x, k0, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(x, k1, a[g][1]);
      a[g][2] = _mm512_fmadd_ps(x, k2, a[g][2]);
      a[g][3] = _mm512_fmadd_ps(x, k3, a[g][3]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(fold(a[g][0]), fold(a[g][1])),
                                    _mm256_hadd_ps(fold(a[g][2]), fold(a[g][3])));
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(scores + g * stride, _mm_mul_ps(sum, _mm_set1_ps(scale)));
  }
}

// acc[g * 64 + d] += sum over j of p[g * stride + j] * v[j, d] for NG heads and `run` values v (rows of 64, R apart):
// each value row read once for the NG heads, the accumulators in 4 * NG registers over the run.
template <typename T, int NG>
inline void weigh_values_64(const float* p, int64_t stride, const T* v, int64_t R, int64_t run, float* acc) {
  __m512 a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < 4; ++i) a[g][i] = _mm512_loadu_ps(acc + g * 64 + 16 * i);
  for (int64_t j = 0; j < run; ++j) {
    const __m512 v0 = load16(v + j * R), v1 = load16(v + j * R + 16), v2 = load16(v + j * R + 32),
                 v3 = load16(v + j * R + 48);
    for (int g = 0; g < NG; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * stride + j]);
      a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);
      a[g][2] = _mm512_fmadd_ps(w, v2, a[g][2]);
      a[g][3] = _mm512_fmadd_ps(w, v3, a[g][3]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + g * 64 + 16 * i, a[g][i]);
}
#endif

// n stored rows (R elements apart) -> their values, n rows of D floats, each row's scale applied (an fp8 row's with
// its unit): what a block of many queries reads, widened once instead of once for every three of them.
template <typename T>
inline void widen_rows(const T* rows, int64_t n, int64_t D, int64_t R, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const T* row = rows + i * R;
    float scale = 1.f;
    if constexpr (Stored<T>::scaled) scale = row_scale(row, D);
    float* o = out + i * D;
    int64_t d = 0;
#ifdef KILN_ATTN_YMM
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(load8(row + d), _mm256_set1_ps(scale)));
#endif
    for (; d < D; ++d) o[d] = widen(row[d]) * scale;
  }
}

// scores[g * stride + j] = scale * (q_g . k_j) for `run` keys k (rows of D values, R apart) and G query heads q
// (rows of D).
template <typename T, int64_t DIM>
void key_scores(const float* q, const T* k, int64_t run, int64_t G, int64_t D, int64_t R, float scale, float* scores,
                int64_t stride) {
  int64_t j = 0;
#ifdef __AVX512F__
  if (D % 16 == 0) {  // 4 keys at a time, up to 4 heads together (16 accumulators of the 32 zmm registers)
    for (; j + 4 <= run; j += 4) {
      for (int64_t g = 0; g < G; g += 4) {
        const float* qg = q + g * D;
        float* sg = scores + g * stride + j;
        switch (std::min<int64_t>(4, G - g)) {
          case 4: scores_of_4_keys_512<T, 4>(qg, k + j * R, D, R, scale, sg, stride); break;
          case 3: scores_of_4_keys_512<T, 3>(qg, k + j * R, D, R, scale, sg, stride); break;
          case 2: scores_of_4_keys_512<T, 2>(qg, k + j * R, D, R, scale, sg, stride); break;
          default: scores_of_4_keys_512<T, 1>(qg, k + j * R, D, R, scale, sg, stride); break;
        }
      }
    }
  }
#endif
#ifdef KILN_ATTN_YMM
  if (D % 8 == 0) {  // 4 keys at a time, up to 3 heads together (12 accumulators of the 16 ymm registers)
    for (; j + 4 <= run; j += 4) {
      for (int64_t g = 0; g < G; g += 3) {
        const float* qg = q + g * D;
        float* sg = scores + g * stride + j;
        switch (std::min<int64_t>(3, G - g)) {
          case 3: scores_of_4_keys<T, 3>(qg, k + j * R, D, R, scale, sg, stride); break;
          case 2: scores_of_4_keys<T, 2>(qg, k + j * R, D, R, scale, sg, stride); break;
          default: scores_of_4_keys<T, 1>(qg, k + j * R, D, R, scale, sg, stride); break;
        }
      }
    }
  }
#endif
  for (; j < run; ++j) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      const T* kj = k + j * R;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < (DIM > 0 ? DIM : D); ++d) dot += qg[d] * widen(kj[d]);
      scores[g * stride + j] = dot * scale;
    }
  }
}

// acc[d] += sum over j of p[j] * v[j, d] for `run` values v (rows of D, R apart).
template <typename T, int64_t DIM>
void weigh_values(const float* p, const T* v, int64_t run, int64_t D, int64_t R, float* acc) {
#ifdef KILN_ATTN_YMM
  if (DIM == 64) {  // the accumulator stays in 8 registers over the run
    const T* vf = v;
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int64_t j = 0; j < run; ++j) {
      const __m256 w = _mm256_set1_ps(p[j]);
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(w, load8(vf + j * R + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
    return;
  }
#endif
  for (int64_t j = 0; j < run; ++j) {
    const float w = p[j];
    const T* vj = v + j * R;
#pragma omp simd
    for (int64_t d = 0; d < (DIM > 0 ? DIM : D); ++d) acc[d] += w * widen(vj[d]);
  }
}
}  // namespace
