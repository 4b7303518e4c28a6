// kiln's native packed product with int8 activations: out[r, o] = sum over groups g of
//   scale[o, g] * d[r, g] * sum_i code[o, g, i] * q[r, g, i]  +  offset[o, g] * xsum[r, g]
// where each row of x is quantized per weight group (the group's G inputs): d = max|x| / 127, q = round(x / d)
// (x times 1/d, rounded half to even, as llama.cpp's q8 blocks), xsum = the float sum of the group's x. The code
// sums are integer dot products: AVX-512 VNNI `vpdpbusd` (u8 x s8 -> s32) or AVX2 `vpmaddubsw` + `vpmaddwd`.
// `packed_linear_q8x2` adds a second int8 digit: the residual x - q * d quantized with d / 128, so x is
// d / 128 * (128 q + q2) (about 15 bits) and the code sums are 128 * (codes . q) + (codes . q2), still exact.
// Codes are kiln's packed layout as they are (kiln/quant/linear.py): [out, groups, G/2] nibble pairs (byte i holds
// code i low and code i + G/2 high, values 0..15) or [out, groups, G] int8 (signed: |code| times x with x's sign
// flipped where the code is negative, so the unsigned operand stays within vpmaddubsw's range).
//
// A vector holds one 128-bit lane per output (4 outputs in a zmm, 2 in a ymm): each lane multiplies 16 codes of
// its output by the same 16 activations, so a group's codes are read once for every row of x.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "packed_operands.h"
#include "q8_activations.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KILN_Q8_ZMM 1
#elif defined(__AVX2__) && defined(__FMA__)
#define KILN_Q8_YMM 1
#endif

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

namespace {

constexpr int64_t OUT_CHUNK = 16;  // outputs a thread takes at a time
#if defined(KILN_Q8_ZMM) || defined(KILN_Q8_YMM)
#ifdef KILN_Q8_ZMM
using VI = __m512i;
using VF = __m512;
constexpr int OUTS = 4;  // outputs per vector: one 128-bit lane each
using Sign = __mmask64;

inline VI zero_i() { return _mm512_setzero_si512(); }
inline VF zero_f() { return _mm512_setzero_ps(); }
inline VI load_lanes(const uint8_t* p, int64_t stride) {  // 16 bytes of each of OUTS outputs
  VI v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * stride)), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * stride)), 3);
}
inline VI broadcast16(const int8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VI low_nibbles(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline VI high_nibbles(VI v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
inline VI dot_u8s8(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline VI dot_pair(VI acc, VI u, VI s, VI u2, VI s2) { return dot_u8s8(dot_u8s8(acc, u, s), u2, s2); }
inline VI magnitude(VI w) { return _mm512_abs_epi8(w); }
inline VI two_digits(VI high, VI low) { return _mm512_add_epi32(_mm512_slli_epi32(high, 7), low); }
inline Sign sign_of(VI w) { return _mm512_movepi8_mask(w); }
inline VI with_sign(VI x, Sign negative) { return _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x); }
inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF set1(float v) { return _mm512_set1_ps(v); }
inline VF spread(const float* p, int64_t stride) {  // output j's value in all 4 lanes of its part
  const __m128 v = _mm_set_ps(p[3 * stride], p[2 * stride], p[stride], p[0]);
  return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_castps128_ps512(v));
}
inline VF first_lanes(const float* p, int64_t stride) {  // output j's value in the first lane of its part, 0 elsewhere
  const __m128 v = _mm_set_ps(p[3 * stride], p[2 * stride], p[stride], p[0]);
  return _mm512_maskz_permutexvar_ps(0x1111, _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                     _mm512_castps128_ps512(v));
}
inline void store_sums(VF v, float* out) {  // each part's 4 lanes summed, one float per output
  const __m128 a = _mm512_castps512_ps128(v), b = _mm512_extractf32x4_ps(v, 1);
  const __m128 c = _mm512_extractf32x4_ps(v, 2), d = _mm512_extractf32x4_ps(v, 3);
  _mm_storeu_ps(out, _mm_hadd_ps(_mm_hadd_ps(a, b), _mm_hadd_ps(c, d)));
}
#else
using VI = __m256i;
using VF = __m256;
constexpr int OUTS = 2;
using Sign = __m256i;

inline VI zero_i() { return _mm256_setzero_si256(); }
inline VF zero_f() { return _mm256_setzero_ps(); }
inline VI load_lanes(const uint8_t* p, int64_t stride) {
  return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + stride), reinterpret_cast<const __m128i*>(p));
}
inline VI broadcast16(const int8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VI low_nibbles(VI v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline VI high_nibbles(VI v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
inline VI dot_u8s8(VI acc, VI u, VI s) {  // pairs of u8 x s8 products fit in int16: |u| <= 128, |s| <= 127
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
// two nibble-code dot products (codes <= 15): each pair sum is at most 2 * 15 * 127, so the two add in int16 before
// one widening multiply
inline VI dot_pair(VI acc, VI u, VI s, VI u2, VI s2) {
  const VI pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(u2, s2));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline VI magnitude(VI w) { return _mm256_abs_epi8(w); }
inline VI two_digits(VI high, VI low) { return _mm256_add_epi32(_mm256_slli_epi32(high, 7), low); }
inline Sign sign_of(VI w) { return w; }
inline VI with_sign(VI x, Sign w) { return _mm256_sign_epi8(x, w); }
inline VF to_float(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF set1(float v) { return _mm256_set1_ps(v); }
inline VF spread(const float* p, int64_t stride) { return _mm256_set_m128(_mm_set1_ps(p[stride]), _mm_set1_ps(p[0])); }
inline VF first_lanes(const float* p, int64_t stride) { return _mm256_set_ps(0, 0, 0, p[stride], 0, 0, 0, p[0]); }
inline void store_sums(VF v, float* out) {
  const __m256 h = _mm256_hadd_ps(v, v), s = _mm256_hadd_ps(h, h);
  out[0] = _mm256_cvtss_f32(s);
  out[1] = _mm_cvtss_f32(_mm256_extractf128_ps(s, 1));
}
#endif

// R rows of x times T vectors of OUTS outputs (o0 .. o0 + T * OUTS), every group; D digits of x (1 or 2).
template <int R, int T, int D>
void tile(const Weights& w, const Acts& a, int64_t r0, int64_t o0, float* out, int64_t n) {
  VF f[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) f[r][t] = zero_f();
  const int64_t stride = w.groups * w.code_bytes;  // bytes from one output's codes to the next
  for (int64_t g = 0; g < w.groups; ++g) {
    VI acc[R][T], acc2[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = acc2[r][t] = zero_i();
    const uint8_t* cg = w.codes + (o0 * w.groups + g) * w.code_bytes;
    // one or two rows wait on memory: prefetch the outputs PREFETCH_OUTPUTS ahead, a group's share of their
    // rows (every line once over the groups)
    if constexpr (R <= 2) {
      const int64_t ahead = o0 + PREFETCH_OUTPUTS;
      const int64_t share = T * OUTS * w.code_bytes, scales = (ahead * w.groups + g * T * OUTS) * 4;
      prefetch_lines(w.codes, ahead * stride + g * share, share);
      prefetch_lines(w.scale, scales, T * OUTS * 4);
      prefetch_lines(w.offset, scales, T * OUTS * 4);
    }
    const int8_t* qg = a.q + r0 * a.in + g * w.group;
    const int8_t* qg2 = D == 2 ? a.q2 + r0 * a.in + g * w.group : nullptr;
    for (int64_t c = 0; c < w.code_bytes; c += 16) {
      if (w.nibbles) {  // bytes c .. c+15: codes c .. c+15 (low) and half + c .. (high)
        VI lo[T], hi[T];
        for (int t = 0; t < T; ++t) {
          const VI v = load_lanes(cg + t * OUTS * stride + c, stride);
          lo[t] = low_nibbles(v);
          hi[t] = high_nibbles(v);
        }
        for (int r = 0; r < R; ++r) {
          const VI xl = broadcast16(qg + r * a.in + c), xh = broadcast16(qg + r * a.in + w.code_bytes + c);
          for (int t = 0; t < T; ++t) acc[r][t] = dot_pair(acc[r][t], lo[t], xl, hi[t], xh);
          if (D == 2) {
            const VI yl = broadcast16(qg2 + r * a.in + c), yh = broadcast16(qg2 + r * a.in + w.code_bytes + c);
            for (int t = 0; t < T; ++t) acc2[r][t] = dot_pair(acc2[r][t], lo[t], yl, hi[t], yh);
          }
        }
      } else {
        VI u[T];
        Sign s[T];
        for (int t = 0; t < T; ++t) {
          const VI v = load_lanes(cg + t * OUTS * stride + c, stride);
          u[t] = magnitude(v);
          s[t] = sign_of(v);
        }
        for (int r = 0; r < R; ++r) {
          const VI x = broadcast16(qg + r * a.in + c);
          for (int t = 0; t < T; ++t) acc[r][t] = dot_u8s8(acc[r][t], u[t], with_sign(x, s[t]));
          if (D == 2) {
            const VI y = broadcast16(qg2 + r * a.in + c);
            for (int t = 0; t < T; ++t) acc2[r][t] = dot_u8s8(acc2[r][t], u[t], with_sign(y, s[t]));
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const int64_t k = (o0 + t * OUTS) * w.groups + g;
      const VF sc = spread(w.scale + k, w.groups), off = first_lanes(w.offset + k, w.groups);
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (r0 + r) * a.groups + g;
        const VI sums = D == 2 ? two_digits(acc[r][t], acc2[r][t]) : acc[r][t];
        f[r][t] = fmadd(to_float(sums), mul(sc, set1(a.d[rg])), f[r][t]);
        f[r][t] = fmadd(off, set1(a.sum[rg]), f[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) store_sums(f[r][t], out + (r0 + r) * n + o0 + t * OUTS);
}

// Rows r0 .. r0+R over outputs [begin, end): T vectors at a time, then one, then the scalar tail.
template <int R, int T, int D>
void rows_tiles(const Weights& w, const Acts& a, int64_t r0, int64_t begin, int64_t end, float* out, int64_t n) {
  int64_t o = begin;
  for (; o + T * OUTS <= end; o += T * OUTS) tile<R, T, D>(w, a, r0, o, out, n);
  for (; o + OUTS <= end; o += OUTS) tile<R, 1, D>(w, a, r0, o, out, n);
  for (; o < end; ++o)
    for (int r = 0; r < R; ++r) out[(r0 + r) * n + o] = dot_scalar(w, a, r0 + r, o);
}

// Blocks of rows that share one unpacking of a tile's codes, sized to the tier's registers (32 zmm, 16 ymm).
template <int D>
void outputs_vector(const Weights& w, const Acts& a, int64_t rows, int64_t begin, int64_t end, float* out, int64_t n) {
  int64_t r = 0;
#ifdef KILN_Q8_ZMM
  for (; r + 8 <= rows; r += 8) rows_tiles<8, 1, D>(w, a, r, begin, end, out, n);
  switch (rows - r) {
    case 7: rows_tiles<7, 1, D>(w, a, r, begin, end, out, n); break;
    case 6: rows_tiles<6, 1, D>(w, a, r, begin, end, out, n); break;
    case 5: rows_tiles<5, 1, D>(w, a, r, begin, end, out, n); break;
    case 4: rows_tiles<4, 1, D>(w, a, r, begin, end, out, n); break;
    case 3: rows_tiles<3, 2, D>(w, a, r, begin, end, out, n); break;
    case 2: rows_tiles<2, 2, D>(w, a, r, begin, end, out, n); break;
    case 1: rows_tiles<1, 4, D>(w, a, r, begin, end, out, n); break;
    default: break;
  }
#else
  for (; r + 4 <= rows; r += 4) rows_tiles<4, 1, D>(w, a, r, begin, end, out, n);
  switch (rows - r) {
    case 3: rows_tiles<3, 1, D>(w, a, r, begin, end, out, n); break;
    case 2: rows_tiles<2, 2, D>(w, a, r, begin, end, out, n); break;
    case 1: rows_tiles<1, 2, D>(w, a, r, begin, end, out, n); break;
    default: break;
  }
#endif
}
#endif

void outputs(const Weights& w, const Acts& a, int64_t rows, int64_t begin, int64_t end, float* out, int64_t n) {
#if defined(KILN_Q8_ZMM) || defined(KILN_Q8_YMM)
  if (w.code_bytes % 16 == 0) {
    if (a.q2)
      outputs_vector<2>(w, a, rows, begin, end, out, n);
    else
      outputs_vector<1>(w, a, rows, begin, end, out, n);
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = begin; o < end; ++o) out[r * n + o] = dot_scalar(w, a, r, o);
}

at::Tensor product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                   int digits) {
  const char* name = digits == 2 ? "packed_linear_q8x2" : "packed_linear_q8";
  const Q8Operands operands(name, x, codes, scale, offset);
  const PackedShape& shape = operands.shape;
  const at::Tensor& xc = operands.x;
  const Weights& w = operands.weights;
  const int64_t rows = xc.size(0), n = shape.n;
  const QuantizedX qx(xc, shape, digits);
  at::Tensor out = at::empty({rows, n}, xc.options());
  const Acts a = qx.acts();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (n + OUT_CHUNK - 1) / OUT_CHUNK, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) outputs(w, a, rows, c * OUT_CHUNK, std::min(n, (c + 1) * OUT_CHUNK), op, n);
  });
  return out;
}

at::Tensor packed_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const at::Tensor& offset) {
  return product(x, codes, scale, offset, 1);
}

at::Tensor packed_linear_q8x2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const at::Tensor& offset) {
  return product(x, codes, scale, offset, 2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("packed_linear_q8(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.impl("packed_linear_q8", c10::DispatchKey::CPU, TORCH_FN(packed_linear_q8));
  m.def("packed_linear_q8x2(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.impl("packed_linear_q8x2", c10::DispatchKey::CPU, TORCH_FN(packed_linear_q8x2));
}
