// What kiln's int8-activation products share (packed_q8.cpp, packed_q8_blocked.cpp): the weight and activation
// operands, x quantized per weight group to one or two int8 digits (the arithmetic kiln/kernels/native/reference.py
// states in torch), and the scalar dot product of one (row, output) pair that the plain tier and every tail run.
// Everything here has internal linkage: each tier's object keeps its own copy, compiled with its own flags.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "packed_operands.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t MAX_GROUP = 1024;

struct Weights {
  const uint8_t* codes;  // nibble pairs, or int8 codes read as bytes
  const float* scale;
  const float* offset;
  int64_t groups, group, code_bytes;
  bool nibbles;
};

struct Acts {  // x quantized per (row, group)
  const int8_t* q;  // [rows, in]
  const int8_t* q2; // [rows, in], the second digit (packed_linear_q8x2), else null
  const float* d;   // [rows, groups]
  const float* sum; // [rows, groups]
  int64_t in, groups;
};

// q = round(x * id) for n values, and with `q2`, the second digit round((x - q * d) * id * 128) (n: a multiple of
// the vector width where a vector tier runs; the scalar loop below is the same arithmetic, op by op).
void round_scaled(const float* x, int64_t n, float d, float id, int8_t* q, int8_t* q2) {
  int64_t i = 0;
  const float id2 = id * 128.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; i + 16 <= n; i += 16) {  // cvtps rounds half to even under the default MXCSR, as nearbyint does
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(r));
    if (q2) {
      const __m512 rest = _mm512_sub_ps(v, _mm512_mul_ps(_mm512_cvtepi32_ps(r), _mm512_set1_ps(d)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + i),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(rest, _mm512_set1_ps(id2)))));
    }
  }
#elif defined(__AVX2__)
  const auto narrow = [](__m256i v, int8_t* out) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(w, w));
  };
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(v, _mm256_set1_ps(id)));
    narrow(r, q + i);
    if (q2) {
      const __m256 rest = _mm256_sub_ps(v, _mm256_mul_ps(_mm256_cvtepi32_ps(r), _mm256_set1_ps(d)));
      narrow(_mm256_cvtps_epi32(_mm256_mul_ps(rest, _mm256_set1_ps(id2))), q2 + i);
    }
  }
#endif
  for (; i < n; ++i) {
    const float r = std::nearbyint(x[i] * id);
    q[i] = static_cast<int8_t>(r);
    if (q2) q2[i] = static_cast<int8_t>(std::nearbyint((x[i] - r * d) * id2));
  }
}

void quantize_row(const float* x, int64_t groups, int64_t group, int8_t* q, int8_t* q2, float* d, float* sum) {
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * group;
    float amax = 0.f, s = 0.f;
#pragma omp simd reduction(max : amax) reduction(+ : s)
    for (int64_t i = 0; i < group; ++i) {
      amax = std::max(amax, std::fabs(xg[i]));
      s += xg[i];
    }
    const float dg = amax / 127.f, id = dg >= FLT_MIN ? 1.f / dg : 0.f;  // a subnormal scale: the group is 0
    round_scaled(xg, group, dg, id, q + g * group, q2 ? q2 + g * group : nullptr);
    d[g] = q2 ? dg / 128.f : dg;  // the scale of the integer sums: 128 q + q2 with two digits
    sum[g] = s;
  }
}

// One (row, output) pair: the plain tier, and the vector tiers' tail. Not auto-vectorized: GCC 12 turns the int8
// loop into vpdpbusd, which reads the codes as unsigned (wrong for negative codes).
__attribute__((optimize("no-tree-vectorize"))) float dot_scalar(const Weights& w, const Acts& a, int64_t r, int64_t o) {
  float acc = 0.f;
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* c = w.codes + (o * w.groups + g) * w.code_bytes;
    const auto code_dot = [&](const int8_t* digits) {  // the group's codes . one digit of x
      const int8_t* q = digits + r * a.in + g * w.group;
      int32_t sum = 0;
      if (w.nibbles) {
        const int64_t half = w.code_bytes;
        for (int64_t i = 0; i < half; ++i) sum += int32_t(c[i] & 15) * q[i] + int32_t(c[i] >> 4) * q[half + i];
      } else {
        for (int64_t i = 0; i < w.group; ++i) sum += int32_t(static_cast<int8_t>(c[i])) * q[i];
      }
      return sum;
    };
    const int32_t isum = a.q2 ? 128 * code_dot(a.q) + code_dot(a.q2) : code_dot(a.q);
    const int64_t k = o * w.groups + g, rg = r * a.groups + g;
    acc = std::fma(float(isum), w.scale[k] * a.d[rg], acc);
    acc = std::fma(w.offset[k], a.sum[rg], acc);
  }
  return acc;
}

// The operands of an int8-activation product, checked (packed_operands.h, and the group size two digits allow).
PackedShape check_q8_operands(const char* name, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const at::Tensor& offset) {
  const PackedShape shape = check_packed_operands(name, x, codes, scale, offset);
  // 128 * 127 * 127 * group must fit the int32 sums of two digits
  TORCH_CHECK(shape.group <= MAX_GROUP, "kiln native ", name, ": groups of at most ", MAX_GROUP, " values, got ",
              shape.group);
  return shape;
}

Weights weights_of(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset, const PackedShape& s) {
  return {static_cast<const uint8_t*>(codes.data_ptr()), scale.data_ptr<float>(), offset.data_ptr<float>(), s.groups,
          s.group, s.code_bytes, s.nibbles};
}

// The operands of an int8-activation product (`name`: the op, for its errors), checked (check_q8_operands) and
// contiguous, with the weight's view over them (`weights`: valid while this holder lives; declared last, it is
// initialized from the tensors above it).
struct Q8Operands {
  Q8Operands(const char* name, const at::Tensor& x_in, const at::Tensor& codes_in, const at::Tensor& scale_in,
             const at::Tensor& offset_in)
      : shape(check_q8_operands(name, x_in, codes_in, scale_in, offset_in)), x(x_in.contiguous()),
        codes(codes_in.contiguous()), scale(scale_in.contiguous()), offset(offset_in.contiguous()),
        weights(weights_of(codes, scale, offset, shape)) {}

  const PackedShape shape;
  const at::Tensor x, codes, scale, offset;
  const Weights weights;
};

// x [rows, in] (contiguous float32) quantized per (row, group), rows in parallel; owns the digits and scales.
class QuantizedX {
 public:
  QuantizedX(const at::Tensor& x, const PackedShape& s, int digits)
      : rows_(x.size(0)), in_(x.size(1)), groups_(s.groups), q_(rows_ * in_), q2_(digits == 2 ? rows_ * in_ : 0),
        d_(rows_ * groups_), sum_(rows_ * groups_) {
    const float* xp = x.data_ptr<float>();
    int8_t* second = digits == 2 ? q2_.data() : nullptr;
    at::parallel_for(0, rows_, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        quantize_row(xp + r * in_, groups_, s.group, q_.data() + r * in_, second ? second + r * in_ : nullptr,
                     d_.data() + r * groups_, sum_.data() + r * groups_);
    });
  }
  Acts acts() const { return {q_.data(), q2_.empty() ? nullptr : q2_.data(), d_.data(), sum_.data(), in_, groups_}; }

 private:
  int64_t rows_, in_, groups_;
  std::vector<int8_t> q_, q2_;
  std::vector<float> d_, sum_;
};

}  // namespace
