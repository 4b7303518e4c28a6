// kiln's int8-activation packed product for one or a few rows, with x's digits widened to one int16 per value: the
// arithmetic of packed_q8.cpp (the same quantized x, exact integer code sums, the same scales;
// kiln/kernels/native/reference.py), multiplied by AVX2's `vpmaddwd` (int16 x int16 -> int32 pairs).
//
// With two digits x is d / 128 * (128 q + q2), |q| <= 127 and |q2| <= 64, so 128 q + q2 fits an int16 and one
// `vpmaddwd` of the codes against it gives 128 (codes . q) + (codes . q2) exactly: the two-digit sum in half the
// multiplies of packed_q8.cpp's AVX2 form (two `vpmaddubsw` a digit, a `vpmaddwd` to widen them). One digit is q
// itself. A 16-byte run of one output's codes widens with one `vpmovzxbw` (nibble pairs: the low codes are the
// bytes & 15, the high ones the bytes >> 4; int8 codes: `vpmovsxbw`, their sign kept), so each output's codes are
// read in order, once per row block, with no lane work across outputs: each output's partial sums stay in one
// vector until its last group (the per-group float epilogue is one convert and one multiply-add), and the scales
// times x's scales, and the offsets' dot with x's group sums, are vectors over the groups of an output.
//
// Bounds: a lane sums group / 8 products of |code| <= 128 and |digit| <= 128 * 127 + 64, under 2^31 for groups up
// to packed_q8.cpp's MAX_GROUP of 1024. The plain tier defines no wide ops.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "packed_operands.h"
#include "q8_activations.h"

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t OUT_CHUNK = 16;        // outputs a thread takes at a time
constexpr int64_t WIDE_PREFETCH = 8;     // outputs ahead whose packed rows are prefetched (one or two rows of x)
constexpr int64_t ROW_BLOCK = 4;         // rows that share one widening of an output's codes

// x's digits as one int16 per value, [rows, in]: 128 q + q2 with two digits, q with one.
std::vector<int16_t> widened(const Acts& a, int64_t rows) {
  std::vector<int16_t> wide(rows * a.in);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * a.in; i < r1 * a.in; ++i)
      wide[i] = static_cast<int16_t>(a.q2 ? 128 * int32_t(a.q[i]) + a.q2[i] : a.q[i]);
  });
  return wide;
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

inline __m256i madd(__m256i codes, const int16_t* x) {
  return _mm256_madd_epi16(codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// The integer sums of one group of one output's codes against R rows of wide digits (`x`: row r0's digits of the
// group; rows `in` apart), 8 int32 partial sums a row; `code_bytes`: the group's bytes of codes (16 per run).
template <int R, bool NIBBLES>
inline void group_sums(const uint8_t* codes, int64_t code_bytes, const int16_t* x, int64_t in, __m256i (&acc)[R]) {
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  for (int64_t c = 0; c < code_bytes; c += 16) {
    const __m128i run = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c));
    if constexpr (NIBBLES) {  // bytes c .. c+15: codes c .. c+15 (low) and code_bytes + c .. (high)
      const __m256i bytes = _mm256_cvtepu8_epi16(run);
      const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(15)), high = _mm256_srli_epi16(bytes, 4);
      for (int r = 0; r < R; ++r) {
        const int16_t* xr = x + r * in;
        acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(madd(low, xr + c), madd(high, xr + code_bytes + c)));
      }
    } else {
      const __m256i codes16 = _mm256_cvtepi8_epi16(run);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_add_epi32(acc[r], madd(codes16, x + r * in + c));
    }
  }
}

// Per row of the block, each group's scale times x's scale (`sd`, [R][groups]) and the offsets' dot with x's group
// sums (`off`), for output o.
template <int R>
void output_scales(const Weights& w, const Acts& a, int64_t r0, int64_t o, float* sd, float (&off)[R]) {
  const float* scale = w.scale + o * w.groups;
  const float* offset = w.offset + o * w.groups;
  for (int r = 0; r < R; ++r) {
    const float* d = a.d + (r0 + r) * a.groups;
    const float* sum = a.sum + (r0 + r) * a.groups;
    float* sdr = sd + r * w.groups;
    __m256 dot = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= w.groups; g += 8) {
      _mm256_storeu_ps(sdr + g, _mm256_mul_ps(_mm256_loadu_ps(scale + g), _mm256_loadu_ps(d + g)));
      dot = _mm256_fmadd_ps(_mm256_loadu_ps(offset + g), _mm256_loadu_ps(sum + g), dot);
    }
    off[r] = horizontal_sum(dot);
    for (; g < w.groups; ++g) {
      sdr[g] = scale[g] * d[g];
      off[r] = std::fma(offset[g], sum[g], off[r]);
    }
  }
}

// Rows r0 .. r0 + R over outputs [begin, end). One row keeps two chains of float sums (even and odd groups), so the
// multiply-add's latency is hidden; more rows are independent chains of their own.
template <int R, bool NIBBLES, int RUNS>
void rows_outputs(const Weights& w, const Acts& a, const int16_t* wide, int64_t r0, int64_t begin, int64_t end,
                  float* sd, float* out, int64_t n) {
  // a group's codes in RUNS runs of 16 bytes where the caller knows it (groups of 32 nibbles: 1), else read here
  const int64_t code_bytes = RUNS > 0 ? RUNS * 16 : w.code_bytes;
  constexpr int CHAINS = R == 1 ? 2 : 1;
  const int64_t row_bytes = w.groups * w.code_bytes;
  for (int64_t o = begin; o < end; ++o) {
    if constexpr (R <= 2) {
      prefetch_lines(w.codes, (o + WIDE_PREFETCH) * row_bytes, row_bytes);
      prefetch_lines(w.scale, (o + WIDE_PREFETCH) * w.groups * 4, w.groups * 4);
      prefetch_lines(w.offset, (o + WIDE_PREFETCH) * w.groups * 4, w.groups * 4);
    }
    float off[R];
    output_scales<R>(w, a, r0, o, sd, off);
    __m256 f[CHAINS][R];
    for (int k = 0; k < CHAINS; ++k)
      for (int r = 0; r < R; ++r) f[k][r] = _mm256_setzero_ps();
    const uint8_t* codes = w.codes + o * row_bytes;
    const int16_t* x = wide + r0 * a.in;
    int64_t g = 0;
    for (; g + CHAINS <= w.groups; g += CHAINS) {
      __m256i acc[CHAINS][R];
      for (int k = 0; k < CHAINS; ++k)
        group_sums<R, NIBBLES>(codes + (g + k) * code_bytes, code_bytes, x + (g + k) * w.group, a.in, acc[k]);
      for (int k = 0; k < CHAINS; ++k)
        for (int r = 0; r < R; ++r)
          f[k][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[k][r]), _mm256_broadcast_ss(sd + r * w.groups + g + k),
                                    f[k][r]);
    }
    if (g < w.groups) {  // an odd group count's last group (one row's two chains)
      __m256i acc[R];
      group_sums<R, NIBBLES>(codes + g * code_bytes, code_bytes, x + g * w.group, a.in, acc);
      for (int r = 0; r < R; ++r)
        f[0][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_broadcast_ss(sd + r * w.groups + g), f[0][r]);
    }
    for (int r = 0; r < R; ++r) {
      __m256 sums = f[0][r];
      for (int k = 1; k < CHAINS; ++k) sums = _mm256_add_ps(sums, f[k][r]);
      out[(r0 + r) * n + o] = horizontal_sum(sums) + off[r];
    }
  }
}

template <bool NIBBLES, int RUNS>
void chunk_rows(const Weights& w, const Acts& a, const int16_t* wide, int64_t rows, int64_t begin, int64_t end,
                float* sd, float* out, int64_t n) {
  int64_t r = 0;
  for (; r + ROW_BLOCK <= rows; r += ROW_BLOCK)
    rows_outputs<ROW_BLOCK, NIBBLES, RUNS>(w, a, wide, r, begin, end, sd, out, n);
  switch (rows - r) {
    case 3: rows_outputs<3, NIBBLES, RUNS>(w, a, wide, r, begin, end, sd, out, n); break;
    case 2: rows_outputs<2, NIBBLES, RUNS>(w, a, wide, r, begin, end, sd, out, n); break;
    case 1: rows_outputs<1, NIBBLES, RUNS>(w, a, wide, r, begin, end, sd, out, n); break;
    default: break;
  }
}

// The outputs [begin, end) of every row, specialized for the common groups: 32 nibbles or 32 int8 codes (Q4 and Q8
// blocks of GGUF files) make one or two 16-byte runs.
void chunk_outputs(const Weights& w, const Acts& a, const int16_t* wide, int64_t rows, int64_t begin, int64_t end,
                   float* sd, float* out, int64_t n) {
  if (w.nibbles && w.code_bytes == 16)
    chunk_rows<true, 1>(w, a, wide, rows, begin, end, sd, out, n);
  else if (w.nibbles)
    chunk_rows<true, 0>(w, a, wide, rows, begin, end, sd, out, n);
  else if (w.code_bytes == 32)
    chunk_rows<false, 2>(w, a, wide, rows, begin, end, sd, out, n);
  else
    chunk_rows<false, 0>(w, a, wide, rows, begin, end, sd, out, n);
}

at::Tensor wide_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& offset, int digits) {
  const char* name = digits == 2 ? "packed_linear_q8x2_wide" : "packed_linear_q8_wide";
  const Q8Operands operands(name, x, codes, scale, offset);
  const PackedShape& shape = operands.shape;
  const at::Tensor& xc = operands.x;
  const Weights& w = operands.weights;
  const int64_t rows = xc.size(0), n = shape.n;
  const QuantizedX qx(xc, shape, digits);
  at::Tensor out = at::empty({rows, n}, xc.options());
  const Acts a = qx.acts();
  float* op = out.data_ptr<float>();
  if (w.code_bytes % 16 != 0) {  // codes in shorter runs: one (row, output) at a time, the same arithmetic
    at::parallel_for(0, n, 1, [&](int64_t o0, int64_t o1) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t o = o0; o < o1; ++o) op[r * n + o] = dot_scalar(w, a, r, o);
    });
    return out;
  }
  const std::vector<int16_t> wide = widened(a, rows);
  at::parallel_for(0, (n + OUT_CHUNK - 1) / OUT_CHUNK, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> sd(ROW_BLOCK * w.groups);
    for (int64_t c = c0; c < c1; ++c)
      chunk_outputs(w, a, wide.data(), rows, c * OUT_CHUNK, std::min(n, (c + 1) * OUT_CHUNK), sd.data(), op, n);
  });
  return out;
}

at::Tensor packed_linear_q8_wide(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                 const at::Tensor& offset) {
  return wide_product(x, codes, scale, offset, 1);
}

at::Tensor packed_linear_q8x2_wide(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                   const at::Tensor& offset) {
  return wide_product(x, codes, scale, offset, 2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("packed_linear_q8_wide(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.impl("packed_linear_q8_wide", c10::DispatchKey::CPU, TORCH_FN(packed_linear_q8_wide));
  m.def("packed_linear_q8x2_wide(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.impl("packed_linear_q8x2_wide", c10::DispatchKey::CPU, TORCH_FN(packed_linear_q8x2_wide));
}
#endif
