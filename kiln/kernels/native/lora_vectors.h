// The vector arithmetic of lora.cpp's kernel, for its tier: x . w over a row of A (`dot`, and four tokens by four A
// rows at once, `dot4x4`, or one token by four rows, `dot1x4`) and the expand's scaled rows of B added into the
// output (`expand` a block of columns across the rank's rows, `expand4` four tokens at once, `expand_rows` one token
// streaming four rows front to back). The AVX-512 tier writes them with intrinsics (bf16 widened in registers); the
// other tiers' loops keep LANES partial sums, so the compiler vectorizes them at the tier's width without reordering
// what the source does not (no -ffast-math). Included by lora.cpp alone, inside its anonymous namespace's reach.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t LANES = 16;
inline float widen(float v) { return v; }

inline float widen(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m = 0xFFFF) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load16(const at::BFloat16* p, __mmask16 m = 0xFFFF) {
  const __m256i half = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline __mmask16 lanes_below(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// x . w over n, four accumulators (a long shrink row is not one chain of dependent adds), reduced in registers
template <typename W>
inline float dot(const float* x, const W* w, int64_t n) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    for (int u = 0; u < 4; ++u) acc[u] = _mm512_fmadd_ps(load16(x + j + 16 * u), load16(w + j + 16 * u), acc[u]);
  }
  for (; j < n; j += 16) {
    const __mmask16 m = lanes_below(n - j);
    acc[0] = _mm512_fmadd_ps(load16(x + j, m), load16(w + j, m), acc[0]);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

// x[t] . w[r] over n for four tokens and four A rows: sixteen sums, each 16 values of x and of w loaded once
template <typename W>
inline void dot4x4(const float* const* x, const W* const* w, int64_t n, float out[4][4]) {
  __m512 acc[4][4];
  for (int t = 0; t < 4; ++t)
    for (int r = 0; r < 4; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes_below(n - j);
    __m512 weights[4];
    for (int r = 0; r < 4; ++r) weights[r] = load16(w[r] + j, m);
    for (int t = 0; t < 4; ++t) {
      const __m512 xs = load16(x[t] + j, m);
      for (int r = 0; r < 4; ++r) acc[t][r] = _mm512_fmadd_ps(xs, weights[r], acc[t][r]);
    }
  }
  for (int t = 0; t < 4; ++t)
    for (int r = 0; r < 4; ++r) out[t][r] = _mm512_reduce_add_ps(acc[t][r]);
}

// dst[first, last) += sum over r of coef[r] * rows[r * out + (first, last)], 64 columns held in registers across
// the rank's rows (one load and one store of dst a block)
template <typename W>
inline void expand(float* dst, const float* coef, const W* rows, int64_t out, int64_t rank, int64_t first,
                   int64_t last) {
  for (int64_t o = first; o < last; o += 64) {
    __mmask16 m[4];
    __m512 acc[4];
    for (int u = 0; u < 4; ++u) {
      m[u] = lanes_below(std::max<int64_t>(0, last - o - 16 * u));
      acc[u] = load16(dst + o + 16 * u, m[u]);
    }
    for (int64_t r = 0; r < rank; ++r) {
      const __m512 c = _mm512_set1_ps(coef[r]);
      const W* row = rows + r * out + o;
      for (int u = 0; u < 4; ++u) acc[u] = _mm512_fmadd_ps(c, load16(row + 16 * u, m[u]), acc[u]);
    }
    for (int u = 0; u < 4; ++u) _mm512_mask_storeu_ps(dst + o + 16 * u, m[u], acc[u]);
  }
}

// `expand` for four tokens of one slot at once (the same B rows): each 16 values of B loaded once for the four
template <typename W>
inline void expand4(float* const* dst, const float* const* coef, const W* rows, int64_t out, int64_t rank,
                    int64_t first, int64_t last) {
  for (int64_t o = first; o < last; o += 64) {
    __mmask16 m[4];
    __m512 acc[4][4];
    for (int u = 0; u < 4; ++u) {
      m[u] = lanes_below(std::max<int64_t>(0, last - o - 16 * u));
      for (int t = 0; t < 4; ++t) acc[t][u] = load16(dst[t] + o + 16 * u, m[u]);
    }
    for (int64_t r = 0; r < rank; ++r) {
      const W* row = rows + r * out + o;
      __m512 values[4];
      for (int u = 0; u < 4; ++u) values[u] = load16(row + 16 * u, m[u]);
      for (int t = 0; t < 4; ++t) {
        const __m512 c = _mm512_set1_ps(coef[t][r]);
        for (int u = 0; u < 4; ++u) acc[t][u] = _mm512_fmadd_ps(c, values[u], acc[t][u]);
      }
    }
    for (int t = 0; t < 4; ++t)
      for (int u = 0; u < 4; ++u) _mm512_mask_storeu_ps(dst[t] + o + 16 * u, m[u], acc[t][u]);
  }
}

// x . w[r] for one token and four A rows: each 16 values of x loaded once for the four
template <typename W>
inline void dot1x4(const float* x, const W* const* w, int64_t n, float out[4]) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes_below(n - j);
    const __m512 xs = load16(x + j, m);
    for (int r = 0; r < 4; ++r) acc[r] = _mm512_fmadd_ps(xs, load16(w[r] + j, m), acc[r]);
  }
  for (int r = 0; r < 4; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// `expand` for one token, B's rows streamed: four rows at a time, each read once front to back over the columns
// (four sequential streams the prefetchers follow, where `expand` walks `rank` rows a block of columns at a time)
template <typename W>
inline void expand_rows(float* dst, const float* coef, const W* rows, int64_t out, int64_t rank, int64_t first,
                        int64_t last) {
  int64_t r = 0;
  for (; r + 4 <= rank; r += 4) {
    __m512 c[4];
    const W* row[4];
    for (int q = 0; q < 4; ++q) {
      c[q] = _mm512_set1_ps(coef[r + q]);
      row[q] = rows + (r + q) * out;
    }
    for (int64_t o = first; o < last; o += 16) {
      const __mmask16 m = lanes_below(last - o);
      __m512 acc = load16(dst + o, m);
      for (int q = 0; q < 4; ++q) acc = _mm512_fmadd_ps(c[q], load16(row[q] + o, m), acc);
      _mm512_mask_storeu_ps(dst + o, m, acc);
    }
  }
  if (r < rank) expand(dst, coef + r, rows + r * out, out, rank - r, first, last);
}
#else
template <typename W>
inline float dot(const float* x, const W* w, int64_t n) {
  float sums[LANES] = {};
  const int64_t whole = n - n % LANES;
  for (int64_t j = 0; j < whole; j += LANES) {
    for (int64_t l = 0; l < LANES; ++l) sums[l] += x[j + l] * widen(w[j + l]);
  }
  // a tree over the lanes (halves added lane-wise), not a chain of LANES scalar adds
  for (int64_t half = LANES / 2; half > 0; half /= 2) {
    for (int64_t l = 0; l < half; ++l) sums[l] += sums[l + half];
  }
  float sum = sums[0];
  for (int64_t j = whole; j < n; ++j) sum += x[j] * widen(w[j]);
  return sum;
}

template <typename W>
inline void dot4x4(const float* const* x, const W* const* w, int64_t n, float out[4][4]) {
  for (int t = 0; t < 4; ++t)
    for (int r = 0; r < 4; ++r) out[t][r] = dot(x[t], w[r], n);
}

template <typename W>
inline void expand(float* dst, const float* coef, const W* rows, int64_t out, int64_t rank, int64_t first,
                   int64_t last) {
  for (int64_t r = 0; r < rank; ++r) {
    const float c = coef[r];
    const W* row = rows + r * out;
    for (int64_t o = first; o < last; ++o) dst[o] += c * widen(row[o]);
  }
}

template <typename W>
inline void expand4(float* const* dst, const float* const* coef, const W* rows, int64_t out, int64_t rank,
                    int64_t first, int64_t last) {
  for (int t = 0; t < 4; ++t) expand(dst[t], coef[t], rows, out, rank, first, last);
}

template <typename W>
inline void dot1x4(const float* x, const W* const* w, int64_t n, float out[4]) {
  for (int r = 0; r < 4; ++r) out[r] = dot(x, w[r], n);
}

template <typename W>
inline void expand_rows(float* dst, const float* coef, const W* rows, int64_t out, int64_t rank, int64_t first,
                        int64_t last) {
  expand(dst, coef, rows, out, rank, first, last);  // already row by row
}
#endif

}  // namespace
