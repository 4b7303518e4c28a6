// kiln's native packed product: out[r, o] = sum over k of x[r, k] * W[o, k], where W stays packed as kiln's layout
// (kiln/quant/linear.py): per group of G inputs, w = code * scale + offset; codes [out, groups, G/2] uint8 nibble
// pairs (byte i holds code i low and code i + G/2 high) or [out, groups, G] int8; scale, offset [out, groups, 1]
// float32. The weight is dequantized in registers, group by group, and never written out; activations stay
// float32 (the arithmetic of dequantize-then-fp32, summed in another order).
//
// This file is compiled once per ISA tier (kiln/kernels/native/build.py): the tier's flags select the vector path
// below, and KILN_TIER_NS names the op namespace, so tiers can be loaded side by side.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "packed_operands.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KILN_VECTOR 1
#endif

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

namespace {

constexpr int64_t OUT_CHUNK = 16;  // outputs a thread takes at a time: their packed rows stay in L1 across x's rows

struct Packed {
  const void* codes;
  const float* scale;
  const float* offset;
  int64_t groups, group, code_bytes;  // code_bytes: bytes of one group's codes
  bool nibbles;
};

// One (row, output) pair, scalar: the plain tier, and the vector tier's fallback for odd group sizes.
float dot_scalar(const Packed& w, int64_t o, const float* x) {
  float acc = 0.f;
  for (int64_t g = 0; g < w.groups; ++g) {
    const float s = w.scale[o * w.groups + g], m = w.offset[o * w.groups + g];
    const float* xg = x + g * w.group;
    float sum = 0.f;
    if (w.nibbles) {
      const uint8_t* c = static_cast<const uint8_t*>(w.codes) + (o * w.groups + g) * w.code_bytes;
      const int64_t half = w.code_bytes;
      for (int64_t i = 0; i < half; ++i) {
        sum += (float(c[i] & 15) * s + m) * xg[i];
        sum += (float(c[i] >> 4) * s + m) * xg[half + i];
      }
    } else {
      const int8_t* c = static_cast<const int8_t*>(w.codes) + (o * w.groups + g) * w.code_bytes;
      for (int64_t i = 0; i < w.group; ++i) sum += (float(c[i]) * s + m) * xg[i];
    }
    acc += sum;
  }
  return acc;
}

#ifdef KILN_VECTOR
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows of x times O outputs, two accumulators per pair (the low and high halves of a group, or alternate
// chunks of 8 int8 codes), so that R * O * 2 FMA chains are in flight.
template <int R, int O>
void tile_vector(const Packed& w, int64_t o0, const float* x, int64_t x_stride, float* out, int64_t out_stride) {
  __m256 acc[R][O][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < O; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const float* xg = x + g * w.group;
    // one or two rows wait on memory: prefetch the outputs PREFETCH_OUTPUTS ahead, a group's share of their
    // rows (every line once over the groups)
    if constexpr (R <= 2) {
      const int64_t ahead = o0 + PREFETCH_OUTPUTS, share = O * w.code_bytes, scales = (ahead * w.groups + g * O) * 4;
      prefetch_lines(w.codes, ahead * w.groups * w.code_bytes + g * share, share);
      prefetch_lines(w.scale, scales, O * 4);
      prefetch_lines(w.offset, scales, O * 4);
    }
    for (int j = 0; j < O; ++j) {
      const int64_t o = o0 + j;
      const __m256 s = _mm256_set1_ps(w.scale[o * w.groups + g]);
      const __m256 m = _mm256_set1_ps(w.offset[o * w.groups + g]);
      if (w.nibbles) {
        const uint8_t* c = static_cast<const uint8_t*>(w.codes) + (o * w.groups + g) * w.code_bytes;
        const int64_t half = w.code_bytes;
        for (int64_t i = 0; i < half; i += 8) {
          const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i)));
          const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15))), s, m);
          const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), s, m);
          for (int r = 0; r < R; ++r) {
            const float* xr = xg + r * x_stride;
            acc[r][j][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xr + i), acc[r][j][0]);
            acc[r][j][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xr + half + i), acc[r][j][1]);
          }
        }
      } else {
        const int8_t* c = static_cast<const int8_t*>(w.codes) + (o * w.groups + g) * w.code_bytes;
        for (int64_t i = 0; i < w.group; i += 16) {
          const __m128i q16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i));
          const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q16)), s, m);
          const __m256 b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q16, 8))), s, m);
          for (int r = 0; r < R; ++r) {
            const float* xr = xg + r * x_stride;
            acc[r][j][0] = _mm256_fmadd_ps(a, _mm256_loadu_ps(xr + i), acc[r][j][0]);
            acc[r][j][1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(xr + i + 8), acc[r][j][1]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < O; ++j) out[r * out_stride + o0 + j] = hsum(_mm256_add_ps(acc[r][j][0], acc[r][j][1]));
}

// Rows r0 .. r0+R over outputs [begin, end): O outputs at a time, then one at a time for the rest.
template <int R, int O>
void rows_vector(const Packed& w, int64_t begin, int64_t end, const float* x, int64_t in, float* out, int64_t n) {
  int64_t o = begin;
  for (; o + O <= end; o += O) tile_vector<R, O>(w, o, x, in, out, n);
  for (; o < end; ++o) tile_vector<R, 1>(w, o, x, in, out, n);
}
#endif

bool vector_fits(const Packed& w) {
  // nibbles: 8 bytes of codes (16 values) at a time; int8: 16 codes at a time
  return w.nibbles ? w.code_bytes % 8 == 0 : w.group % 16 == 0;
}

void outputs(const Packed& w, int64_t begin, int64_t end, const float* x, int64_t rows, int64_t in, float* out,
             int64_t n) {
#ifdef KILN_VECTOR
  if (vector_fits(w)) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) rows_vector<4, 1>(w, begin, end, x + r * in, in, out + r * n, n);
    switch (rows - r) {
      case 3: rows_vector<3, 1>(w, begin, end, x + r * in, in, out + r * n, n); break;
      case 2: rows_vector<2, 2>(w, begin, end, x + r * in, in, out + r * n, n); break;
      case 1: rows_vector<1, 4>(w, begin, end, x + r * in, in, out + r * n, n); break;
      default: break;
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = begin; o < end; ++o) out[r * n + o] = dot_scalar(w, o, x + r * in);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         const at::Tensor& offset) {
  const auto [nibbles, n, groups, code_bytes, group] = check_packed_operands("packed_linear", x, codes, scale, offset);
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scale.contiguous(), oc = offset.contiguous();
  const int64_t rows = xc.size(0), in = xc.size(1);
  at::Tensor out = at::empty({rows, n}, xc.options());
  const Packed w{cc.data_ptr(), sc.data_ptr<float>(), oc.data_ptr<float>(), groups, group, code_bytes, nibbles};
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (n + OUT_CHUNK - 1) / OUT_CHUNK, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) outputs(w, c * OUT_CHUNK, std::min(n, (c + 1) * OUT_CHUNK), xp, rows, in, op, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(KILN_TIER_NS, m) {
  m.def("packed_linear(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
}
