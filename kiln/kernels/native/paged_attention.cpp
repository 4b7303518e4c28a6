// kiln's native paged decode attention: each query row attends over its sequence's keys in the paged KV cache,
// reading the blocks where they lie (no gather into a contiguous copy, no score matrix padded to the longest
// sequence). The semantics are kiln.model.graph_attention's traced decode attention:
//   row i has seq_lens[i] = L tokens (its query is the last, at position L - 1; L < 1 counts as 1); it sees key j iff
//   j < L and, with window W > 0, j > L - 1 - W; scores are (q . k) / sqrt(D), soft-capped as tanh(s / C) * C when
//   C > 0, softmaxed over the visible keys, and weight the values.
// Query heads that share a KV head (GQA) are read together, so each key and value is loaded once per row. The
// avx512 tier computes in zmm registers (16 floats), up to four heads of a group per pass over a run of keys or
// values; the avx2 tier in ymm.
//
// Work is split over (row, KV head, chunk of keys) so that short batches of long sequences still use every thread
// (flash-decoding): each chunk keeps its running max, its sum of exponentials and its weighted values, and a
// second pass merges the chunks of each row and head. The exponential is a polynomial the compiler vectorizes
// (relative error below 1e-7 on the range softmax uses).
//
// q [n, H, D] float32; kv_cache [2, Hkv, blocks, block_size, R] in one of kiln's KV cache dtypes
// (kiln/model/kv_format.py): float32, bfloat16 or float16 rows of R = D values (widened as read), or int8 codes
// (int8) or float8_e4m3fn codes (held as uint8) with their float32 scale s after them, R = D + 4 bytes. A row of
// codes is never widened to values: its keys' scores are (q . codes) * s and its values weigh in with p * s, so the
// inner loops read raw codes (fp8 codes are widened to their value / 256 by moving their bits into a half's, and
// 256 joins s). block_table [n, >= ceil(L / block_size)] int64; seq_lens [n] int64 -> [n, H * D] float32.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KILN_ATTN_YMM 1
#endif

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

namespace {

constexpr int64_t MIN_CHUNK = 64;    // keys: fewer per chunk costs more in merging than it gains in threads
constexpr int64_t ITEMS_PER_THREAD = 4;
constexpr int64_t MAX_HEAD_DIM = 512;
constexpr int64_t MAX_GROUP = 64;    // query heads per KV head

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

struct Layout {
  int64_t heads, kv_heads, group, head_dim, row, blocks, block_size, table_width;  // row: elements of T a row
  int64_t window;
  float scale, softcap;
};

struct Chunk {  // one (row, KV head) pair's keys [begin, end)
  int64_t row, head, begin, end;
};

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

// DIM > 0: the head dim as a constant (the common ones), so the loops over it unroll; 0: read from `s`.
template <typename T, int64_t DIM>
void attend_chunk(const Layout& s, const float* q, const T* kv, const int64_t* table, const Chunk& c, float* scores,
                  float* m, float* l, float* acc) {
  const int64_t G = s.group, D = DIM > 0 ? DIM : s.head_dim, R = s.row, BS = s.block_size, len = c.end - c.begin;
  const float* qh = q + (c.row * s.heads + c.head * G) * D;
  const int64_t head_stride = s.blocks * BS * R;
  const T* keys = kv + c.head * head_stride;
  const T* values = kv + (s.kv_heads + c.head) * head_stride;
  const int64_t* blocks = table + c.row * s.table_width;
  // where the run of keys (or values) from token t on lies in its block, and how many tokens it holds
  const auto run_at = [&](const T* base, int64_t t) {
    const int64_t first = t % BS;
    return std::make_pair(base + (blocks[t / BS] * BS + first) * R, std::min(BS - first, c.end - t));
  };
  // A block is a page or so of its own: the hardware prefetchers stop at its end, so the next run's lines are asked
  // for while this one is read (2.7x off the KV-streaming roofline at one row before, on a 2-core EPYC).
  const auto prefetch_run = [&](const T* base, int64_t t) {
    const auto [at, run] = run_at(base, t);
    const char* bytes = reinterpret_cast<const char*>(at);
    for (int64_t b = 0; b < run * R * int64_t(sizeof(T)); b += 64) __builtin_prefetch(bytes + b, 0, 3);
  };
  for (int64_t t = c.begin; t < c.end;) {  // one block's run of keys at a time
    const auto [at, run] = run_at(keys, t);
    if (t + run < c.end)
      prefetch_run(keys, t + run);
    else
      prefetch_run(values, c.begin);  // the values come next
    key_scores<T, DIM>(qh, at, run, G, D, R, s.scale, scores + (t - c.begin), len);
    if constexpr (Stored<T>::scaled)  // each key's scale
      for (int64_t j = 0; j < run; ++j) {
        const float ks = row_scale(at + j * R, D);
        for (int64_t g = 0; g < G; ++g) scores[g * len + (t - c.begin) + j] *= ks;
      }
    t += run;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * len;
    if (s.softcap > 0.f)
      for (int64_t j = 0; j < len; ++j) sg[j] = std::tanh(sg[j] / s.softcap) * s.softcap;
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < len; ++j) mx = std::max(mx, sg[j]);
    m[g] = mx;
    l[g] = exponentiate(sg, len, mx);
    std::fill(acc + g * D, acc + (g + 1) * D, 0.f);
  }
  for (int64_t t = c.begin; t < c.end;) {  // each block's values read once (from L1) for every head
    const auto [at, run] = run_at(values, t);
    if (t + run < c.end) prefetch_run(values, t + run);
    float* p = scores + (t - c.begin);
    if constexpr (Stored<T>::scaled)  // each value's scale joins its weight (the sums l are taken already)
      for (int64_t j = 0; j < run; ++j) {
        const float vs = row_scale(at + j * R, D);
        for (int64_t g = 0; g < G; ++g) p[g * len + j] *= vs;
      }
    int64_t g = 0;
#ifdef __AVX512F__
    for (; DIM == 64 && g < G; g += 4) {  // up to 4 heads a pass over the run's values
      switch (std::min<int64_t>(4, G - g)) {
        case 4: weigh_values_64<T, 4>(p + g * len, len, at, R, run, acc + g * D); break;
        case 3: weigh_values_64<T, 3>(p + g * len, len, at, R, run, acc + g * D); break;
        case 2: weigh_values_64<T, 2>(p + g * len, len, at, R, run, acc + g * D); break;
        default: weigh_values_64<T, 1>(p + g * len, len, at, R, run, acc + g * D); break;
      }
    }
#endif
    for (; g < G; ++g) weigh_values<T, DIM>(p + g * len, at, run, D, R, acc + g * D);
    t += run;
  }
}

template <typename T>
void decode(const Layout& s, const float* q, const T* kv, const int64_t* table, const int64_t* seq_lens, int64_t n,
            float* out) {
  // chunks per (row, KV head): enough items for every thread, none shorter than MIN_CHUNK keys
  const int64_t want = std::max<int64_t>(1, (ITEMS_PER_THREAD * at::get_num_threads() + n * s.kv_heads - 1) /
                                                (n * s.kv_heads));
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk(n + 1, 0);  // row i's chunks, per head: [first_chunk[i], first_chunk[i + 1])
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = std::max<int64_t>(seq_lens[i], 1);
    const int64_t begin = s.window > 0 ? std::max<int64_t>(0, len - s.window) : 0, keys = len - begin;
    const int64_t most = std::min(want, std::max<int64_t>(1, keys / MIN_CHUNK)), step = (keys + most - 1) / most;
    const int64_t count = (keys + step - 1) / step;  // what the loop below makes (at most `most`)
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t a = begin; a < len; a += step) chunks.push_back({i, h, a, std::min(len, a + step)});
    first_chunk[i + 1] = first_chunk[i] + count;
  }
  const int64_t G = s.group, D = s.head_dim, per_chunk = G * (2 + D);
  std::vector<float> partial(chunks.size() * per_chunk);  // per chunk: m[G], l[G], acc[G][D]
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> scores;
    for (int64_t c = c0; c < c1; ++c) {
      const Chunk& chunk = chunks[c];
      scores.resize(G * (chunk.end - chunk.begin));
      float* p = partial.data() + c * per_chunk;
      float *m = p, *l = p + G, *acc = p + 2 * G;
      if (D == 64)
        attend_chunk<T, 64>(s, q, kv, table, chunk, scores.data(), m, l, acc);
      else if (D == 128)
        attend_chunk<T, 128>(s, q, kv, table, chunk, scores.data(), m, l, acc);
      else
        attend_chunk<T, 0>(s, q, kv, table, chunk, scores.data(), m, l, acc);
    }
  });
  // merge: chunk j of row i, head h is chunks[kv_heads * first_chunk[i] + h * count_i + j]
  at::parallel_for(0, n * s.kv_heads, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t i = p / s.kv_heads, h = p % s.kv_heads, count = first_chunk[i + 1] - first_chunk[i];
      const float* base = partial.data() + (s.kv_heads * first_chunk[i] + h * count) * per_chunk;
      for (int64_t g = 0; g < G; ++g) {
        float mx = -INFINITY;
        for (int64_t j = 0; j < count; ++j) mx = std::max(mx, base[j * per_chunk + g]);
        float* o = out + (i * s.heads + h * G + g) * D;
        std::fill(o, o + D, 0.f);
        float total = 0.f;
        for (int64_t j = 0; j < count; ++j) {
          const float* c = base + j * per_chunk;
          const float w = exp_nonpositive(c[g] - mx);
          total += w * c[G + g];
          const float* a = c + 2 * G + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "kiln native paged_decode_attention: q must be "
              "[rows, heads, head_dim] float32");
  const at::ScalarType kv_type = kv_cache.scalar_type();
  const bool scaled = kv_type == at::kChar || kv_type == at::kByte;  // int8, fp8_e4m3: a float32 scale a row
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  (scaled || kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kHalf),
              "kiln native paged_decode_attention: kv_cache must be [2, kv_heads, blocks, block_size, row] float32, "
              "bfloat16, float16, int8 or uint8 (fp8_e4m3 codes)");
  const int64_t n = q.size(0), heads = q.size(1), head_dim = q.size(2), kv_heads = kv_cache.size(1);
  const int64_t row = head_dim + (scaled ? int64_t(sizeof(float)) : 0);
  TORCH_CHECK(kv_cache.size(4) == row && head_dim <= MAX_HEAD_DIM && head_dim % 4 == 0, "kiln native "
              "paged_decode_attention: the cache's rows of ", kv_cache.size(4), " must be q's head_dim ", head_dim,
              scaled ? " + 4 (the scale)" : "", " (a multiple of 4, at most ", MAX_HEAD_DIM, ")");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= MAX_GROUP, "kiln native "
              "paged_decode_attention: ", heads, " query heads do not group over ", kv_heads, " KV heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == n && block_table.scalar_type() == at::kLong &&
                  seq_lens.dim() == 1 && seq_lens.size(0) == n && seq_lens.scalar_type() == at::kLong,
              "kiln native paged_decode_attention: block_table [rows, blocks] and seq_lens [rows] int64, one row per "
              "query");
  const at::Tensor qc = q.contiguous(), kc = kv_cache.contiguous(), tc = block_table.contiguous();
  const at::Tensor lc = seq_lens.contiguous();
  const int64_t block_size = kc.size(3), blocks = kc.size(2), width = tc.size(1);
  const int64_t* lens = lc.data_ptr<int64_t>();
  const int64_t* table = tc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {  // every block a row reads must lie in the cache
    const int64_t len = std::max<int64_t>(lens[i], 1), used = (len + block_size - 1) / block_size;
    TORCH_CHECK(used <= width, "kiln native paged_decode_attention: row ", i, " has ", len, " tokens, its block table ",
                width, " blocks of ", block_size);
    for (int64_t b = window > 0 ? std::max<int64_t>(0, len - window) / block_size : 0; b < used; ++b)
      TORCH_CHECK(table[i * width + b] >= 0 && table[i * width + b] < blocks, "kiln native paged_decode_attention: "
                  "row ", i, " reads block ", table[i * width + b], " of a cache of ", blocks);
  }
  const Layout s{heads, kv_heads, heads / kv_heads, head_dim, row, blocks, block_size, width, window,
                 static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim))), static_cast<float>(softcap)};
  at::Tensor out = at::empty({n, heads * head_dim}, qc.options());
  if (n == 0) return out;
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (kv_type) {
    case at::kFloat: decode(s, qp, kc.data_ptr<float>(), table, lens, n, op); break;
    case at::kBFloat16: decode(s, qp, kc.data_ptr<c10::BFloat16>(), table, lens, n, op); break;
    case at::kHalf: decode(s, qp, kc.data_ptr<c10::Half>(), table, lens, n, op); break;
    case at::kChar: decode(s, qp, kc.data_ptr<int8_t>(), table, lens, n, op); break;
    default: decode(s, qp, reinterpret_cast<const Fp8E4M3*>(kc.data_ptr<uint8_t>()), table, lens, n, op); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, int window, "
        "float softcap) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}
