// kiln's int8-activation packed product for a few rows on the CPU's matrix unit (AMX-INT8): the arithmetic of
// packed_q8.cpp (x quantized per weight group to one or two int8 digits, exact integer code sums, the same scales;
// kiln/kernels/native/reference.py), with the integer sums of every row and digit of a group done by one `tdpbssd`.
//
// Why: a speculative verification step multiplies 5 rows (one sequence, 4 drafts). With two digits the VNNI kernels
// do 2 x 5 dot products per code there and turn compute-bound from 4-5 rows (5 rows cost ~2.2x one row), while the
// weight read, the cost of one row, is the same. Here the rows' digits are the rows of one A tile (digit-major:
// M = digits x rows <= 16), the block's 16 outputs' codes of one group the B tile (K = the group, <= 64 bytes), so
// one tile multiply replaces the 2 x rows x group / 4 `vpdpbusd` of a group and block, and the vector units keep
// the codes' transposition and the float epilogue (once per row, group and 16 outputs, as in the VNNI kernels).
//
// Codes go into the B tile as the VNNI kernels transpose them (packed_q8_blocked.cpp): word v of each of the 16
// outputs (codes 4v .. 4v+3) in B's row v; nibbles (0..15) and int8 codes are both signed bytes to `tdpbssd`, so no
// shift is needed. Linux grants tile state to a process only after arch_prctl(ARCH_REQ_XCOMP_PERM): the op asks
// for it (once) and refuses to run without it; kiln.kernels.candidates times it only where a child process ran it
// correctly first (kiln.kernels.compute_forms), as a VM can list AMX and fault on it.

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

#if defined(__x86_64__) && defined(__linux__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t AMX_BLOCK = 16;     // outputs a tile holds: 16 int32 columns of C
constexpr int64_t AMX_MAX_ROWS = 16;  // rows of an A tile: digits x rows of x
constexpr int64_t AMX_MAX_K = 64;     // bytes of an A tile's row: the codes of one group at most
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

// Tile permission for this process (granted once; false where the kernel refuses it).
bool tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two sets of three tiles, 3s + 0: C [m, 16] int32; 3s + 1: A [m, k] int8; 3s + 2: B [k / 4, 64] int8.
__attribute__((target("amx-tile,amx-int8"))) void configure(int64_t m, int64_t k) {
  TileConfig cfg;
  for (int s = 0; s < 2; ++s) {
    cfg.rows[3 * s] = static_cast<uint8_t>(m), cfg.colsb[3 * s] = 64;
    cfg.rows[3 * s + 1] = static_cast<uint8_t>(m), cfg.colsb[3 * s + 1] = static_cast<uint16_t>(k);
    cfg.rows[3 * s + 2] = static_cast<uint8_t>(k / 4), cfg.colsb[3 * s + 2] = 64;
  }
  asm volatile("" ::: "memory");  // GCC 12 drops the stores into an ldtilecfg operand as dead without it
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void release() { _tile_release(); }

// The 4x4 transpose of 32-bit words within each 128-bit lane (packed_q8_blocked.cpp transpose_words).
inline void transpose4(const __m512i z[4], __m512i y[4]) {
  const __m512i a0 = _mm512_unpacklo_epi32(z[0], z[1]), a1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i a2 = _mm512_unpacklo_epi32(z[2], z[3]), a3 = _mm512_unpackhi_epi32(z[2], z[3]);
  y[0] = _mm512_unpacklo_epi64(a0, a2);
  y[1] = _mm512_unpackhi_epi64(a0, a2);
  y[2] = _mm512_unpacklo_epi64(a1, a3);
  y[3] = _mm512_unpackhi_epi64(a1, a3);
}

inline __m512i lanes4(const uint8_t* p, int64_t step) {  // 16 bytes at p, p + step, ... one per 128-bit lane
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + step)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * step)), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * step)), 3);
}

inline __m512 gather16(const float* base, int64_t stride) {  // base[j * stride] for each lane j
  const __m512i j = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_i32gather_ps(_mm512_mullo_epi32(j, _mm512_set1_epi32(static_cast<int32_t>(stride))), base, 4);
}

// Group g's codes of outputs o0 .. o0 + 15 as a B tile: row v holds word v (codes 4v .. 4v+3) of each output.
void codes_tile(const Weights& w, int64_t o0, int64_t g, int8_t* b) {
  const int64_t stride = w.groups * w.code_bytes;  // bytes from one output's codes to the next
  const uint8_t* src = w.codes + o0 * stride + g * w.code_bytes;
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t c = 0; c < w.code_bytes; c += 16) {
    __m512i z[4], y[4];
    for (int t = 0; t < 4; ++t) z[t] = lanes4(src + c + t * stride, 4 * stride);  // outputs t, t + 4, ...
    transpose4(z, y);
    for (int k = 0; k < 4; ++k) {
      const int64_t v = c / 4 + k;
      if (w.nibbles) {  // low nibbles: codes 4v.., high: G/2 + 4v..
        _mm512_store_si512(b + v * 64, _mm512_and_si512(y[k], low));
        _mm512_store_si512(b + (w.code_bytes / 4 + v) * 64, _mm512_and_si512(_mm512_srli_epi16(y[k], 4), low));
      } else {
        _mm512_store_si512(b + v * 64, y[k]);
      }
    }
  }
}

constexpr int64_t CHUNK = 8;  // groups whose codes are transposed, multiplied and scaled phase after phase

// Two tile sets (C, A, B), alternated group by group so that a group's multiply need not wait for the last one's
// store. Two functions, not a template: GCC's tile intrinsics are macros that paste the tile number as text.
__attribute__((target("amx-tile,amx-int8"))) inline void multiply0(const int8_t* a, int64_t in, const int8_t* b,
                                                                    int32_t* c) {
  _tile_loadd(2, b, 64);
  _tile_loadd(1, a, in);
  _tile_zero(0);
  _tile_dpbssd(0, 1, 2);
  _tile_stored(0, c, 64);
}

__attribute__((target("amx-tile,amx-int8"))) inline void multiply1(const int8_t* a, int64_t in, const int8_t* b,
                                                                    int32_t* c) {
  _tile_loadd(5, b, 64);
  _tile_loadd(4, a, in);
  _tile_zero(3);
  _tile_dpbssd(3, 4, 5);
  _tile_stored(3, c, 64);
}

// `rows` rows (digits x rows tile rows, digit-major in `q`: [digits * rows, in]) times outputs o0 .. o0 + 15, CHUNK
// groups at a time in three phases (the codes transposed, the tile products, the float epilogue): one group's chain
// of stores and tile loads would otherwise wait on the one before it.
void amx_block(const Weights& w, const int8_t* q, const float* d, const float* xsum, int64_t in, int64_t rows,
               int digits, int64_t o0, float* out, int64_t n) {
  alignas(64) int8_t b[CHUNK][AMX_MAX_K / 4 * 64];
  alignas(64) int32_t c[CHUNK][AMX_MAX_ROWS * AMX_BLOCK];
  __m512 f[AMX_MAX_ROWS];
  for (int64_t r = 0; r < rows; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < w.groups; g0 += CHUNK) {
    const int64_t count = std::min(CHUNK, w.groups - g0);
    for (int64_t i = 0; i < count; ++i) {  // the block PREFETCH_OUTPUTS ahead, a group's share of it at a time
      const int64_t g = g0 + i, ahead = o0 + PREFETCH_OUTPUTS, share = AMX_BLOCK * w.code_bytes;
      prefetch_lines(w.codes, ahead * w.groups * w.code_bytes + g * share, share);
      prefetch_lines(w.scale, (ahead * w.groups + g * AMX_BLOCK) * 4, AMX_BLOCK * 4);
      prefetch_lines(w.offset, (ahead * w.groups + g * AMX_BLOCK) * 4, AMX_BLOCK * 4);
      codes_tile(w, o0, g, b[i]);
    }
    for (int64_t i = 0; i < count; ++i) {
      if (i % 2 == 0)
        multiply0(q + (g0 + i) * w.group, in, b[i], c[i]);
      else
        multiply1(q + (g0 + i) * w.group, in, b[i], c[i]);
    }
    for (int64_t i = 0; i < count; ++i) {
      const int64_t g = g0 + i;
      const __m512 scale = gather16(w.scale + o0 * w.groups + g, w.groups);
      const __m512 offset = gather16(w.offset + o0 * w.groups + g, w.groups);
      for (int64_t r = 0; r < rows; ++r) {
        __m512i sums = _mm512_load_si512(c[i] + r * AMX_BLOCK);
        if (digits == 2)
          sums = _mm512_add_epi32(_mm512_slli_epi32(sums, 7), _mm512_load_si512(c[i] + (rows + r) * AMX_BLOCK));
        const int64_t rg = r * w.groups + g;
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, _mm512_set1_ps(d[rg])), f[r]);
        f[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[rg]), f[r]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(out + r * n + o0, f[r]);
}

// `rows` rows of x (at most AMX_MAX_ROWS / digits) times every output into `out` [rows, n].
void amx_rows(const Weights& w, const float* x, int64_t rows, int64_t in, int digits, float* out, int64_t n) {
  // x's digits in one [digits * rows, in] matrix (digit-major: an A tile's rows), scales and sums per (row, group)
  std::vector<int8_t> q(digits * rows * in);
  std::vector<float> d(rows * w.groups), xsum(rows * w.groups);
  for (int64_t r = 0; r < rows; ++r)
    quantize_row(x + r * in, w.groups, w.group, q.data() + r * in, digits == 2 ? q.data() + (rows + r) * in : nullptr,
                 d.data() + r * w.groups, xsum.data() + r * w.groups);
  const int64_t blocks = n / AMX_BLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    configure(digits * rows, w.group);
    for (int64_t i = b0; i < b1; ++i)
      amx_block(w, q.data(), d.data(), xsum.data(), in, rows, digits, i * AMX_BLOCK, out, n);
    release();
  });
  const Acts a{q.data(), digits == 2 ? q.data() + rows * in : nullptr, d.data(), xsum.data(), in, w.groups};
  for (int64_t r = 0; r < rows; ++r)  // outputs past the last whole block: one (row, output) at a time
    for (int64_t o = blocks * AMX_BLOCK; o < n; ++o) out[r * n + o] = dot_scalar(w, a, r, o);
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                      int digits) {
  const char* name = digits == 2 ? "packed_linear_q8x2_amx" : "packed_linear_q8_amx";
  const Q8Operands operands(name, x, codes, scale, offset);
  const PackedShape& shape = operands.shape;
  const at::Tensor& xc = operands.x;
  const Weights& w = operands.weights;
  TORCH_CHECK(shape.group <= AMX_MAX_K && shape.code_bytes % 16 == 0, "kiln native ", name,
              ": groups of at most ", AMX_MAX_K, " values in whole 16-byte runs of codes, got ", shape.group);
  TORCH_CHECK(tiles_granted(), "kiln native ", name, ": Linux refused this process the AMX tile state "
              "(arch_prctl ARCH_REQ_XCOMP_PERM)");
  const int64_t rows = xc.size(0), n = shape.n, in = xc.size(1), most = AMX_MAX_ROWS / digits;
  at::Tensor out = at::empty({rows, n}, xc.options());
  for (int64_t r0 = 0; r0 < rows; r0 += most)  // one A tile's rows at a time
    amx_rows(w, xc.data_ptr<float>() + r0 * in, std::min(most, rows - r0), in, digits, out.data_ptr<float>() + r0 * n,
             n);
  return out;
}

at::Tensor packed_linear_q8_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& offset) {
  return amx_linear(x, codes, scale, offset, 1);
}

at::Tensor packed_linear_q8x2_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                  const at::Tensor& offset) {
  return amx_linear(x, codes, scale, offset, 2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("packed_linear_q8_amx(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.impl("packed_linear_q8_amx", c10::DispatchKey::CPU, TORCH_FN(packed_linear_q8_amx));
  m.def("packed_linear_q8x2_amx(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.impl("packed_linear_q8x2_amx", c10::DispatchKey::CPU, TORCH_FN(packed_linear_q8x2_amx));
}
#endif
