// kiln's int8-activation packed product for many rows: the arithmetic of packed_q8.cpp (the same quantized x, exact
// integer code sums, the same scales; kiln/kernels/native/reference.py), in another layout.
//
// packed_q8.cpp gives each output a 128-bit lane (4 outputs a zmm, 2 a ymm), so its float epilogue (convert, scale,
// offset) runs once per 4 (or 2) outputs, group and row, and costs as much as the dot products at many rows. Here
// the codes of BLOCK outputs (16 a zmm, 8 a ymm) are first transposed into a per-thread scratch, one 32-bit word (4
// codes) of each output per lane, the layout llama.cpp's repacked blocks have, without keeping a second copy of
// the weight: one broadcast of 4 activation bytes then feeds BLOCK outputs in a `vpdpbusd` (AVX-512 VNNI) or a
// `vpmaddubsw` + `vpmaddwd` (AVX2), and the epilogue runs once per BLOCK outputs. The transposition is about one
// pass over the block's codes, shared by every row. The `_streamed` forms transpose in registers instead, each
// 16-byte run of the block's codes as it is used, for up to ROW_BLOCK rows at a time (again for the next rows):
// no scratch written and read again, so they stream the weight at one or a few rows as packed_q8.cpp's kernel
// does (2 rows of 3072 x 576 4-bit: 46 us against its 60 and the scratch form's 73, on a 2-core Xeon), while the
// scratch form still wins at 32 rows and more. The kernel table times them all.
//
// int8 codes are made unsigned as code + 128 (xor 0x80), and 128 times the row's digit sums is taken off each
// group's integer sum again: AVX-512 VNNI only, as AVX2's vpmaddubsw would saturate its int16 pair sums on them
// (the AVX2 form takes nibble codes, 0..15, and refuses int8 ones). The plain tier defines no blocked ops.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "packed_operands.h"
#include "q8_activations.h"

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KILN_BLOCKED_ZMM 1
#elif defined(__AVX2__) && defined(__FMA__)
#define KILN_BLOCKED_YMM 1
#endif

#if defined(KILN_BLOCKED_ZMM) || defined(KILN_BLOCKED_YMM)
#include <immintrin.h>

namespace {

#ifdef KILN_BLOCKED_ZMM
using VI = __m512i;
using VF = __m512;
constexpr int64_t BLOCK = 16;  // outputs a block holds: one int32 lane each
constexpr int ROW_BLOCK = 8;   // rows that share one pass over a block's codes (2 x 8 accumulators, 8 sums)
constexpr bool INT8_CODES = true;  // vpdpbusd sums u8 x s8 in int32: int8 codes + 128 fit

inline VI load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
inline void store_i(int32_t* p, VI v) { _mm512_storeu_si512(p, v); }
inline VI lanes(const uint8_t* p, int64_t step) {  // 16 bytes at p, p + step, ... one per 128-bit lane
  VI v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + step)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * step)), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * step)), 3);
}
inline VI unpacklo32(VI a, VI b) { return _mm512_unpacklo_epi32(a, b); }
inline VI unpackhi32(VI a, VI b) { return _mm512_unpackhi_epi32(a, b); }
inline VI unpacklo64(VI a, VI b) { return _mm512_unpacklo_epi64(a, b); }
inline VI unpackhi64(VI a, VI b) { return _mm512_unpackhi_epi64(a, b); }
inline VI low_nibbles(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline VI high_nibbles(VI v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
inline VI unsigned_codes(VI v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline VI set1_i(int32_t v) { return _mm512_set1_epi32(v); }
inline VI zero_i() { return _mm512_setzero_si512(); }
inline VI dot(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline VI two_digits(VI high, VI low) { return _mm512_add_epi32(_mm512_slli_epi32(high, 7), low); }
inline VI sub_i(VI a, VI b) { return _mm512_sub_epi32(a, b); }
inline VF load_f(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF zero_f() { return _mm512_setzero_ps(); }
inline VF set1_f(float v) { return _mm512_set1_ps(v); }
inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF gather(const float* base, int64_t stride) {  // base[j * stride] for each lane j
  const VI j = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_i32gather_ps(_mm512_mullo_epi32(j, set1_i(static_cast<int32_t>(stride))), base, 4);
}
#else
using VI = __m256i;
using VF = __m256;
constexpr int64_t BLOCK = 8;
constexpr int ROW_BLOCK = 4;  // 16 ymm: 3 x 4 accumulators and sums, the codes, a broadcast
constexpr bool INT8_CODES = false;  // vpmaddubsw's int16 pair sums would saturate on int8 codes + 128

inline VI load_i(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store_i(int32_t* p, VI v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline VI lanes(const uint8_t* p, int64_t step) {
  return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + step), reinterpret_cast<const __m128i*>(p));
}
inline VI unpacklo32(VI a, VI b) { return _mm256_unpacklo_epi32(a, b); }
inline VI unpackhi32(VI a, VI b) { return _mm256_unpackhi_epi32(a, b); }
inline VI unpacklo64(VI a, VI b) { return _mm256_unpacklo_epi64(a, b); }
inline VI unpackhi64(VI a, VI b) { return _mm256_unpackhi_epi64(a, b); }
inline VI low_nibbles(VI v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline VI high_nibbles(VI v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
inline VI unsigned_codes(VI v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline VI set1_i(int32_t v) { return _mm256_set1_epi32(v); }
inline VI zero_i() { return _mm256_setzero_si256(); }
inline VI dot(VI acc, VI u, VI s) {  // codes 0..15 times digits |q| <= 128: pair sums fit int16
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline VI two_digits(VI high, VI low) { return _mm256_add_epi32(_mm256_slli_epi32(high, 7), low); }
inline VI sub_i(VI a, VI b) { return _mm256_sub_epi32(a, b); }
inline VF load_f(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF zero_f() { return _mm256_setzero_ps(); }
inline VF set1_f(float v) { return _mm256_set1_ps(v); }
inline VF to_float(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF gather(const float* base, int64_t stride) {
  const VI j = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  return _mm256_i32gather_ps(base, _mm256_mullo_epi32(j, set1_i(static_cast<int32_t>(stride))), 4);
}
#endif
// int8 codes + 128 (up to 255) times two digits: 128 * 255 * 127 * group must fit the int32 sums
constexpr int64_t MAX_SHIFTED_GROUP = 512;

// One block's operands, transposed: per group, the group's codes as G/4 vectors (vector v: codes 4v .. 4v+3 of
// each output, unsigned), and the BLOCK outputs' scales and offsets.
struct Block {
  std::vector<int32_t> codes;  // [groups][G / 4][BLOCK]
  std::vector<float> scale, offset;  // [groups][BLOCK]
  int64_t words;  // G / 4

  Block(int64_t groups, int64_t group) : codes(groups * group / 4 * BLOCK), scale(groups * BLOCK),
                                         offset(groups * BLOCK), words(group / 4) {}
};

// The 4x4 transpose of 32-bit words within each 128-bit lane across z[0..3]: z[t] lane L holds output t + 4L's 4
// words, y[w] element 4L + t its word w, so y[w] lists the block's outputs in order.
inline void transpose_words(const VI z[4], VI y[4]) {
  const VI a0 = unpacklo32(z[0], z[1]), a1 = unpackhi32(z[0], z[1]);
  const VI a2 = unpacklo32(z[2], z[3]), a3 = unpackhi32(z[2], z[3]);
  y[0] = unpacklo64(a0, a2);
  y[1] = unpackhi64(a0, a2);
  y[2] = unpacklo64(a1, a3);
  y[3] = unpackhi64(a1, a3);
}

// Outputs o0 .. o0 + BLOCK transposed into `b` (w.code_bytes a multiple of 16).
void transpose_block(const Weights& w, int64_t o0, Block& b) {
  const int64_t stride = w.groups * w.code_bytes;  // bytes from one output's codes to the next
  for (int64_t g = 0; g < w.groups; ++g) {
    int32_t* dst = b.codes.data() + g * b.words * BLOCK;
    for (int64_t c = 0; c < w.code_bytes; c += 16) {  // 16 bytes of each output: 4 words
      const uint8_t* src = w.codes + o0 * stride + g * w.code_bytes + c;
      VI z[4], y[4];
      for (int t = 0; t < 4; ++t) z[t] = lanes(src + t * stride, 4 * stride);  // outputs t, t + 4, ...
      transpose_words(z, y);
      for (int k = 0; k < 4; ++k) {
        const int64_t v = c / 4 + k;  // the word's codes: 4v .. 4v+3 (nibbles: low 4v.., high G/2 + 4v..)
        if (w.nibbles) {
          store_i(dst + v * BLOCK, low_nibbles(y[k]));
          store_i(dst + (w.code_bytes / 4 + v) * BLOCK, high_nibbles(y[k]));
        } else {
          store_i(dst + v * BLOCK, unsigned_codes(y[k]));
        }
      }
    }
    store_f(b.scale.data() + g * BLOCK, gather(w.scale + o0 * w.groups + g, w.groups));
    store_f(b.offset.data() + g * BLOCK, gather(w.offset + o0 * w.groups + g, w.groups));
  }
}

typedef int32_t __attribute__((may_alias, aligned(1))) word_alias;  // 4 activation bytes read as one int32
inline VI broadcast4(const int8_t* p) {  // 4 activation bytes in every lane: one broadcast load (no GPR round trip)
  return set1_i(*reinterpret_cast<const word_alias*>(p));
}

// A group's integer sums of R rows (r0 ..) added to their float outputs `f`: scaled by the weight's and the row's
// scales, plus the offsets times the row's sums; D digits of x, `shift` as in block_rows.
template <int R, int D>
inline void add_group(VF f[R], const VI acc[R], const VI acc2[R], VF scale, VF offset, const Acts& a,
                      const int32_t* shift, int64_t r0, int64_t g) {
  for (int r = 0; r < R; ++r) {
    const int64_t rg = (r0 + r) * a.groups + g;
    VI sums = D == 2 ? two_digits(acc[r], acc2[r]) : acc[r];
    if (shift) sums = sub_i(sums, set1_i(shift[rg]));
    f[r] = fmadd(to_float(sums), mul(scale, set1_f(a.d[rg])), f[r]);
    f[r] = fmadd(offset, set1_f(a.sum[rg]), f[r]);
  }
}

// R rows (r0 ..) times the block's BLOCK outputs, every group; D digits of x. `shift`: the int32 per (row, group) to
// take off the sums (128 x the digit sums, for int8 codes made unsigned), or null.
template <int R, int D>
void block_rows(const Block& b, const Acts& a, int64_t group, const int32_t* shift, int64_t r0, float* out,
                int64_t n) {
  VF f[R];
  for (int r = 0; r < R; ++r) f[r] = zero_f();
  for (int64_t g = 0; g < a.groups; ++g) {
    VI acc[R], acc2[R];
    for (int r = 0; r < R; ++r) acc[r] = acc2[r] = zero_i();
    const int32_t* codes = b.codes.data() + g * b.words * BLOCK;
    for (int64_t v = 0; v < b.words; ++v) {
      const VI c = load_i(codes + v * BLOCK);
      const int64_t at = r0 * a.in + g * group + 4 * v;
      for (int r = 0; r < R; ++r) {
        acc[r] = dot(acc[r], c, broadcast4(a.q + at + r * a.in));
        if (D == 2) acc2[r] = dot(acc2[r], c, broadcast4(a.q2 + at + r * a.in));
      }
    }
    add_group<R, D>(f, acc, acc2, load_f(b.scale.data() + g * BLOCK), load_f(b.offset.data() + g * BLOCK), a, shift,
                    r0, g);
  }
  for (int r = 0; r < R; ++r) store_f(out + (r0 + r) * n, f[r]);
}

// R rows (r0 ..) times BLOCK outputs (o0 ..) straight from the packed codes: each group's 16-byte runs of the
// BLOCK outputs are transposed in registers (transpose_words) and used at once, no scratch; D digits of x. At few
// rows this saves the scratch pass (written and read again) that `block_rows` amortizes over many.
template <int R, int D>
void stream_rows(const Weights& w, const Acts& a, const int32_t* shift, int64_t o0, int64_t r0, float* out,
                 int64_t n) {
  VF f[R];
  for (int r = 0; r < R; ++r) f[r] = zero_f();
  const int64_t stride = w.groups * w.code_bytes;  // bytes from one output's codes to the next
  for (int64_t g = 0; g < w.groups; ++g) {
    if constexpr (R <= 4) {  // few rows wait on memory: the block PREFETCH_OUTPUTS ahead, a group's share of it
      const int64_t ahead = o0 + PREFETCH_OUTPUTS, share = BLOCK * w.code_bytes;
      prefetch_lines(w.codes, ahead * stride + g * share, share);
      prefetch_lines(w.scale, (ahead * w.groups + g * BLOCK) * 4, BLOCK * 4);
      prefetch_lines(w.offset, (ahead * w.groups + g * BLOCK) * 4, BLOCK * 4);
    }
    VI acc[R], acc2[R];
    for (int r = 0; r < R; ++r) acc[r] = acc2[r] = zero_i();
    const uint8_t* src = w.codes + o0 * stride + g * w.code_bytes;
    const int64_t x0 = r0 * a.in + g * w.group;
    for (int64_t c = 0; c < w.code_bytes; c += 16) {
      VI z[4], y[4];
      for (int t = 0; t < 4; ++t) z[t] = lanes(src + c + t * stride, 4 * stride);
      transpose_words(z, y);
      for (int k = 0; k < 4; ++k) {
        const int64_t at = x0 + c + 4 * k;  // the word's codes: 4v .. 4v+3, v = c / 4 + k
        if (w.nibbles) {  // low nibbles: codes at, high: at + G/2
          const VI lo = low_nibbles(y[k]), hi = high_nibbles(y[k]);
          for (int r = 0; r < R; ++r) {
            acc[r] = dot(dot(acc[r], lo, broadcast4(a.q + at + r * a.in)), hi, broadcast4(a.q + at + w.code_bytes + r * a.in));
            if (D == 2)
              acc2[r] = dot(dot(acc2[r], lo, broadcast4(a.q2 + at + r * a.in)), hi,
                            broadcast4(a.q2 + at + w.code_bytes + r * a.in));
          }
        } else {
          const VI u = unsigned_codes(y[k]);
          for (int r = 0; r < R; ++r) {
            acc[r] = dot(acc[r], u, broadcast4(a.q + at + r * a.in));
            if (D == 2) acc2[r] = dot(acc2[r], u, broadcast4(a.q2 + at + r * a.in));
          }
        }
      }
    }
    add_group<R, D>(f, acc, acc2, gather(w.scale + o0 * w.groups + g, w.groups),
                    gather(w.offset + o0 * w.groups + g, w.groups), a, shift, r0, g);
  }
  for (int r = 0; r < R; ++r) store_f(out + (r0 + r) * n + o0, f[r]);
}

// `rows` rows in blocks of ROW_BLOCK, then the rest: run(std::integral_constant<int, R>, r0) for each block.
template <typename Run>
void in_row_blocks(int64_t rows, Run&& run) {
  int64_t r = 0;
  for (; r + ROW_BLOCK <= rows; r += ROW_BLOCK) run(std::integral_constant<int, ROW_BLOCK>{}, r);
  switch (rows - r) {
    case 7: run(std::integral_constant<int, 7>{}, r); break;
    case 6: run(std::integral_constant<int, 6>{}, r); break;
    case 5: run(std::integral_constant<int, 5>{}, r); break;
    case 4: run(std::integral_constant<int, 4>{}, r); break;
    case 3: run(std::integral_constant<int, 3>{}, r); break;
    case 2: run(std::integral_constant<int, 2>{}, r); break;
    case 1: run(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

template <int D>
void stream_all_rows(const Weights& w, const Acts& a, const int32_t* shift, int64_t o0, int64_t rows, float* out,
                     int64_t n) {
  in_row_blocks(rows, [&](auto size, int64_t r) { stream_rows<decltype(size)::value, D>(w, a, shift, o0, r, out, n); });
}

template <int D>
void block_all_rows(const Block& b, const Acts& a, int64_t group, const int32_t* shift, int64_t rows, float* out,
                    int64_t n) {
  in_row_blocks(rows, [&](auto size, int64_t r) { block_rows<decltype(size)::value, D>(b, a, group, shift, r, out, n); });
}

// 128 x (128 sum(q) + sum(q2)) per (row, group) (one digit: 128 sum(q)): what code + 128 adds to the sums.
std::vector<int32_t> digit_shifts(const Acts& a, int64_t rows, int64_t group) {
  std::vector<int32_t> shift(rows * a.groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < a.groups; ++g) {
      int32_t s = 0, s2 = 0;
      for (int64_t i = 0; i < group; ++i) {
        s += a.q[r * a.in + g * group + i];
        if (a.q2) s2 += a.q2[r * a.in + g * group + i];
      }
      shift[r * a.groups + g] = 128 * (a.q2 ? 128 * s + s2 : s);
    }
  return shift;
}

// `streamed`: the codes transposed in registers as they are used (stream_rows), else into a scratch per block first
at::Tensor blocked(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                   int digits, bool streamed) {
  const char* name = streamed ? (digits == 2 ? "packed_linear_q8x2_streamed" : "packed_linear_q8_streamed")
                              : (digits == 2 ? "packed_linear_q8x2_blocked" : "packed_linear_q8_blocked");
  const Q8Operands operands(name, x, codes, scale, offset);
  const PackedShape& shape = operands.shape;
  const at::Tensor& xc = operands.x;
  const Weights& w = operands.weights;
  const int64_t rows = xc.size(0), n = shape.n;
  TORCH_CHECK(shape.nibbles || INT8_CODES, "kiln native ", name, ": int8 codes need the AVX-512 VNNI tier (this "
              "tier's vpmaddubsw would saturate on them); nibble codes only here");
  TORCH_CHECK(shape.nibbles || digits == 1 || shape.group <= MAX_SHIFTED_GROUP, "kiln native ", name, ": int8 codes "
              "in groups of at most ", MAX_SHIFTED_GROUP, " values, got ", shape.group);
  const QuantizedX qx(xc, shape, digits);
  const Acts a = qx.acts();
  const std::vector<int32_t> shift = w.nibbles ? std::vector<int32_t>() : digit_shifts(a, rows, w.group);
  const int32_t* sp = shift.empty() ? nullptr : shift.data();
  at::Tensor out = at::empty({rows, n}, xc.options());
  float* op = out.data_ptr<float>();
  const bool vector = w.code_bytes % 16 == 0;  // whole 16-byte runs of codes per group: the transposition's unit
  const int64_t blocks = vector ? n / BLOCK : 0;
  if (streamed) {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t i = b0; i < b1; ++i) {
        if (digits == 2)
          stream_all_rows<2>(w, a, sp, i * BLOCK, rows, op, n);
        else
          stream_all_rows<1>(w, a, sp, i * BLOCK, rows, op, n);
      }
    });
  } else {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      Block block(w.groups, w.group);
      for (int64_t i = b0; i < b1; ++i) {
        transpose_block(w, i * BLOCK, block);
        if (digits == 2)
          block_all_rows<2>(block, a, w.group, sp, rows, op + i * BLOCK, n);
        else
          block_all_rows<1>(block, a, w.group, sp, rows, op + i * BLOCK, n);
      }
    });
  }
  // outputs past the last whole block (or every output, for codes in shorter runs): one (row, output) at a time
  at::parallel_for(blocks * BLOCK, n, 1, [&](int64_t o0, int64_t o1) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = o0; o < o1; ++o) op[r * n + o] = dot_scalar(w, a, r, o);
  });
  return out;
}

at::Tensor packed_linear_q8_blocked(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                    const at::Tensor& offset) {
  return blocked(x, codes, scale, offset, 1, false);
}

at::Tensor packed_linear_q8x2_blocked(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                      const at::Tensor& offset) {
  return blocked(x, codes, scale, offset, 2, false);
}

at::Tensor packed_linear_q8_streamed(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                     const at::Tensor& offset) {
  return blocked(x, codes, scale, offset, 1, true);
}

at::Tensor packed_linear_q8x2_streamed(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                       const at::Tensor& offset) {
  return blocked(x, codes, scale, offset, 2, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("packed_linear_q8_blocked(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.impl("packed_linear_q8_blocked", c10::DispatchKey::CPU, TORCH_FN(packed_linear_q8_blocked));
  m.def("packed_linear_q8x2_blocked(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.impl("packed_linear_q8x2_blocked", c10::DispatchKey::CPU, TORCH_FN(packed_linear_q8x2_blocked));
  m.def("packed_linear_q8_streamed(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.impl("packed_linear_q8_streamed", c10::DispatchKey::CPU, TORCH_FN(packed_linear_q8_streamed));
  m.def("packed_linear_q8x2_streamed(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.impl("packed_linear_q8x2_streamed", c10::DispatchKey::CPU, TORCH_FN(packed_linear_q8x2_streamed));
}
#endif
