// kiln's native paged attention: every query attends over its sequence's keys in the paged KV cache, reading the
// blocks where they lie (no gather into a contiguous copy, no score matrix padded to the longest sequence). Two ops
// share one walk:
// - paged_decode_attention, kiln.model.graph_attention's traced decode attention: row i has seq_lens[i] = L tokens
//   (its query is the last, at position L - 1; L < 1 counts as 1); rows over one block table at consecutive
//   lengths (a speculative verification's) attend as one block of queries;
// - paged_prefill_attention, a whole step's prompts and chunks of prompts (kiln.model.prefill_attention's grouped
//   form): sequence i's queries are q's rows [query_start[i], query_start[i + 1]), the last of its L = seq_lens[i]
//   tokens (a cached prefix, earlier chunks and this step's, all already in the cache), causal from its context.
// A query at position p sees key j iff j <= p and, with window W > 0, j > p - W; scores are (q . k) / sqrt(D),
// soft-capped as tanh(s / C) * C when C > 0, softmaxed over the visible keys, and weight the values.
//
// Query heads that share a KV head (GQA) are read together, and so are up to BLOCK_QUERIES query vectors of a
// prompt (consecutive tokens x the group's heads, a "query block"), so each key and value is loaded once for all of
// them: a prompt's attention is then a small matrix product per run of keys, not a row's dot products. Work is
// split over (query block, KV head, chunk of keys) so that short batches of long sequences still use every thread
// (flash-decoding): each chunk keeps its running max, its sum of exponentials and its weighted values, and a second
// pass merges the chunks of each block and head. Within a chunk a query block's keys are taken MAX_BLOCK_KEYS at a
// time (its scores stay in L2), the running sums rescaled as the max grows. The row arithmetic (stored forms, the
// exponential, the inner products per tier) is kv_rows.h's.
//
// q [tokens, H, D] float32; kv_cache [2, Hkv, blocks, block_size, R] in one of kiln's KV cache dtypes
// (kiln/model/kv_format.py): float32, bfloat16 or float16 rows of R = D values (widened as read), or int8 codes
// (int8) or float8_e4m3fn codes (held as uint8) with their float32 scale s after them, R = D + 4 bytes. A row of
// codes is never widened to values: its keys' scores are (q . codes) * s and its values weigh in with p * s, so the
// inner loops read raw codes (fp8 codes are widened to their value / 256 by moving their bits into a half's, and
// 256 joins s). block_table [n, >= ceil(L / block_size)] int64; seq_lens [n] int64; query_start [n + 1] int64
// -> [tokens, H * D] float32.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kv_rows.h"

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

namespace {

constexpr int64_t MIN_CHUNK = 64;         // keys: fewer per chunk costs more in merging than it gains in threads
constexpr int64_t ITEMS_PER_THREAD = 4;
constexpr int64_t MAX_HEAD_DIM = 512;
constexpr int64_t MAX_GROUP = 64;         // query heads per KV head
constexpr int64_t BLOCK_QUERIES = 64;     // query vectors (a prompt's tokens x the group's heads) read keys together
constexpr int64_t MAX_BLOCK_KEYS = 512;   // keys a multi-token query block scores at a time

struct Layout {
  int64_t heads, kv_heads, group, head_dim, row, blocks, block_size, table_width;  // row: elements of T a row
  int64_t window;
  float scale, softcap;
};

// `count` consecutive queries of sequence `seq`, q's rows from `token` on: the last sees the keys before `end` (its
// position + 1), each earlier one a key fewer. A decode row is a block of one.
struct QueryBlock {
  int64_t seq, token, count, end;
};

struct Chunk {  // one (query block, KV head) pair's keys [begin, end)
  int64_t block, head, begin, end;
};

struct Scratch {  // a thread's: a span's scores, rows widened to float, a block's queries transposed, row pointers
  std::vector<float> scores, rows, queries_t;
  std::vector<const float*> key_rows, value_rows;
};

// The keys [first, end) that query r of block b sees.
inline std::pair<int64_t, int64_t> visible(const Layout& s, const QueryBlock& b, int64_t r) {
  const int64_t end = b.end - (b.count - 1 - r);
  return {s.window > 0 ? std::max<int64_t>(0, end - s.window) : 0, end};
}

// acc[g] += the run's `run` values (rows of D, R apart) weighed by p[g * stride + j], for NQ queries g.
template <typename T, int64_t DIM>
void weigh_run(const float* p, int64_t stride, const T* v, int64_t run, int64_t NQ, int64_t D, int64_t R,
               float* acc) {
  int64_t g = 0;
#ifdef __AVX512F__
  for (; DIM == 64 && g < NQ; g += 4) {  // up to 4 queries a pass over the run's values
    switch (std::min<int64_t>(4, NQ - g)) {
      case 4: weigh_values_64<T, 4>(p + g * stride, stride, v, R, run, acc + g * D); break;
      case 3: weigh_values_64<T, 3>(p + g * stride, stride, v, R, run, acc + g * D); break;
      case 2: weigh_values_64<T, 2>(p + g * stride, stride, v, R, run, acc + g * D); break;
      default: weigh_values_64<T, 1>(p + g * stride, stride, v, R, run, acc + g * D); break;
    }
  }
#endif
  for (; g < NQ; ++g) weigh_values<T, DIM>(p + g * stride, v, run, D, R, acc + g * D);
}

// One chunk: its NQ = count x G query vectors `qv` (rows of D) over keys [c.begin, c.end) -> their running maxima
// m[NQ], sums l[NQ] and weighted values acc[NQ][D] (a query that sees none of the chunk's keys: -inf, 0, zeros).
// DIM > 0: the head dim as a constant (the common ones), so the loops over it unroll; 0: read from `s`.
template <typename T, int64_t DIM>
void attend_chunk(const Layout& s, const float* qv, const T* kv, const int64_t* blocks, const QueryBlock& b,
                  const Chunk& c, Scratch& scratch, float* m, float* l, float* acc) {
  const int64_t G = s.group, D = DIM > 0 ? DIM : s.head_dim, R = s.row, BS = s.block_size, NQ = b.count * G;
  const int64_t head_stride = s.blocks * BS * R;
  const T* keys = kv + c.head * head_stride;
  const T* values = kv + (s.kv_heads + c.head) * head_stride;
  // a decode row takes its chunk in one span (its numbers as before blocks of queries existed)
  const int64_t span = b.count > 1 ? MAX_BLOCK_KEYS : c.end - c.begin;
  // a block of queries reads a narrower cache's rows widened once per run (in registers, a decode row)
  const bool widening = !std::is_same_v<T, float> && b.count > 1;
  std::vector<float>& rows = scratch.rows;
  if (widening) rows.resize(BS * D);
  std::fill(m, m + NQ, -INFINITY);
  std::fill(l, l + NQ, 0.f);
  std::fill(acc, acc + NQ * D, 0.f);
  for (int64_t w0 = c.begin; w0 < c.end; w0 += span) {
    const int64_t w1 = std::min(c.end, w0 + span), len = w1 - w0;
    // where the run of keys (or values) from token t on lies in its block, and how many tokens it holds
    const auto run_at = [&](const T* base, int64_t t) {
      const int64_t first = t % BS;
      return std::make_pair(base + (blocks[t / BS] * BS + first) * R, std::min(BS - first, w1 - t));
    };
    // A block is a page or so of its own: the hardware prefetchers stop at its end, so the next run's lines are
    // asked for while this one is read (2.7x off the KV-streaming roofline at one row before, on a 2-core EPYC).
    const auto prefetch_run = [&](const T* base, int64_t t) {
      const auto [at, run] = run_at(base, t);
      const char* bytes = reinterpret_cast<const char*>(at);
      for (int64_t i = 0; i < run * R * int64_t(sizeof(T)); i += 64) __builtin_prefetch(bytes + i, 0, 3);
    };
    scratch.scores.resize(NQ * len);
    float* scores = scratch.scores.data();
    for (int64_t t = w0; t < w1;) {  // one block's run of keys at a time
      const auto [at, run] = run_at(keys, t);
      prefetch_run(t + run < w1 ? keys : values, t + run < w1 ? t + run : w0);  // the values come next
      if (widening) {
        widen_rows(at, run, D, R, rows.data());
        key_scores<float, DIM>(qv, rows.data(), run, NQ, D, D, s.scale, scores + (t - w0), len);
      } else {
        key_scores<T, DIM>(qv, at, run, NQ, D, R, s.scale, scores + (t - w0), len);
        if constexpr (Stored<T>::scaled)  // each key's scale
          for (int64_t j = 0; j < run; ++j) {
            const float ks = row_scale(at + j * R, D);
            for (int64_t g = 0; g < NQ; ++g) scores[g * len + (t - w0) + j] *= ks;
          }
      }
      t += run;
    }
    for (int64_t g = 0; g < NQ; ++g) {  // each query's visible scores exponentiated, the others weigh nothing
      float* sg = scores + g * len;
      const auto [first, end] = visible(s, b, g / G);
      const int64_t from = std::clamp<int64_t>(first - w0, 0, len), to = std::clamp<int64_t>(end - w0, 0, len);
      std::fill(sg, sg + from, 0.f);
      std::fill(sg + std::max(from, to), sg + len, 0.f);
      if (to <= from) continue;
      if (s.softcap > 0.f)
        for (int64_t j = from; j < to; ++j) sg[j] = std::tanh(sg[j] / s.softcap) * s.softcap;
      float mx = m[g];
#pragma omp simd reduction(max : mx)
      for (int64_t j = from; j < to; ++j) mx = std::max(mx, sg[j]);
      if (m[g] != -INFINITY && mx > m[g]) {  // the running sums rescaled to the new max
        const float alpha = exp_nonpositive(m[g] - mx);
        l[g] *= alpha;
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;
      }
      m[g] = mx;
      l[g] += exponentiate(sg + from, to - from, mx);
    }
    for (int64_t t = w0; t < w1;) {  // each block's values read once (from L1) for every query
      const auto [at, run] = run_at(values, t);
      if (t + run < w1) prefetch_run(values, t + run);
      float* p = scores + (t - w0);
      if (widening) {
        widen_rows(at, run, D, R, rows.data());
        weigh_run<float, DIM>(p, len, rows.data(), run, NQ, D, D, acc);
      } else {
        if constexpr (Stored<T>::scaled)  // each value's scale joins its weight (the sums l are taken already)
          for (int64_t j = 0; j < run; ++j) {
            const float vs = row_scale(at + j * R, D);
            for (int64_t g = 0; g < NQ; ++g) p[g * len + j] *= vs;
          }
        weigh_run<T, DIM>(p, len, at, run, NQ, D, R, acc);
      }
      t += run;
    }
  }
}

#ifdef KILN_ATTN_YMM
// The vector form of a block of queries (a prompt's tokens x the group's heads, D a multiple of 8): the products
// as an sgemm's microkernels instead of dot products. The block's queries are transposed once (qt[d][g], padded to
// a multiple of 8 with zeros), a span's scores kept keys-major (S[j][g]), so
// - q . k: 6 keys x 16 queries a tile, 12 accumulators, each key element broadcast against 16 queries;
// - the softmax runs across 8 queries a register, each with its own visible keys (a lane mask);
// - p v: 6 queries x 16 dims a tile, each value vector loaded once for the six, 16 keys at a time.

// S[j][g0 .. g0 + W) for the keys k[0 .. nk) (nk <= 6; the missing ones repeat the last), W = 8 * NW queries. Its
// loops are unrolled and not inlined, so GCC keeps the accumulators in registers (it spilled them every step).
template <int NW>
__attribute__((noinline)) void score_tile(const float* const* k, int64_t nk, const float* qt, int64_t NQP, int64_t D, float scale,
                       float* S) {
  __m256 a[6][NW];
#pragma GCC unroll 8
  for (int i = 0; i < 6; ++i)
#pragma GCC unroll 8
    for (int w = 0; w < NW; ++w) a[i][w] = _mm256_setzero_ps();
  const float* kp[6];
#pragma GCC unroll 8
  for (int i = 0; i < 6; ++i) kp[i] = k[std::min<int64_t>(i, nk - 1)];
  for (int64_t d = 0; d < D; ++d) {
    __m256 x[NW];
#pragma GCC unroll 8
    for (int w = 0; w < NW; ++w) x[w] = _mm256_loadu_ps(qt + d * NQP + 8 * w);
#pragma GCC unroll 8
    for (int i = 0; i < 6; ++i) {
      const __m256 key = _mm256_broadcast_ss(kp[i] + d);
#pragma GCC unroll 8
      for (int w = 0; w < NW; ++w) a[i][w] = _mm256_fmadd_ps(key, x[w], a[i][w]);
    }
  }
  const __m256 sv = _mm256_set1_ps(scale);
#pragma GCC unroll 8
  for (int i = 0; i < 6; ++i)  // a constant index: a runtime one would keep the accumulators in memory
#pragma GCC unroll 8
    for (int w = 0; w < NW; ++w)
      if (i < nk) _mm256_storeu_ps(S + i * NQP + 8 * w, _mm256_mul_ps(a[i][w], sv));
}

// acc[g0 + i][d0 .. d0 + 8 NV) += sum over j < len of S[j][g0 + i] * v[j][d0 ..], for NG queries i.
template <int NG, int NV>
inline void weigh_tile(const float* S, int64_t NQP, const float* const* v, int64_t len, int64_t d0, float* acc,
                       int64_t D) {
  __m256 a[NG][NV];
#pragma GCC unroll 8
  for (int i = 0; i < NG; ++i)
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) a[i][u] = _mm256_loadu_ps(acc + i * D + d0 + 8 * u);
  for (int64_t j = 0; j < len; ++j) {
    __m256 x[NV];
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) x[u] = _mm256_loadu_ps(v[j] + d0 + 8 * u);
#pragma GCC unroll 8
    for (int i = 0; i < NG; ++i) {
      const __m256 p = _mm256_broadcast_ss(S + j * NQP + i);
#pragma GCC unroll 8
      for (int u = 0; u < NV; ++u) a[i][u] = _mm256_fmadd_ps(p, x[u], a[i][u]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NG; ++i)
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc + i * D + d0 + 8 * u, a[i][u]);
}

// acc += S v over a span, 16 keys at a time (their value rows and scores stay in L1 for every tile of queries).
template <int NV>
void weigh_span(const float* S, int64_t NQP, int64_t NQ, const float* const* v, int64_t len, int64_t D, float* acc) {
  for (int64_t j = 0; j < len; j += 16) {
    const int64_t keys = std::min<int64_t>(16, len - j);
    for (int64_t g = 0; g < NQ; g += 6)
      for (int64_t d0 = 0; d0 < D; d0 += 8 * NV) {
        const float* Sg = S + j * NQP + g;
        float* ag = acc + g * D;
        switch (std::min<int64_t>(6, NQ - g)) {
          case 6: weigh_tile<6, NV>(Sg, NQP, v + j, keys, d0, ag, D); break;
          case 5: weigh_tile<5, NV>(Sg, NQP, v + j, keys, d0, ag, D); break;
          case 4: weigh_tile<4, NV>(Sg, NQP, v + j, keys, d0, ag, D); break;
          case 3: weigh_tile<3, NV>(Sg, NQP, v + j, keys, d0, ag, D); break;
          case 2: weigh_tile<2, NV>(Sg, NQP, v + j, keys, d0, ag, D); break;
          default: weigh_tile<1, NV>(Sg, NQP, v + j, keys, d0, ag, D); break;
        }
      }
  }
}

// The running max m, sum l and weighted values acc of 8 queries from g0 on over a span's scores S (keys-major, len
// keys from w0 on): each lane's visible keys exponentiated against its new max, the others set to 0; where the max
// grew, the lane's earlier sum and values rescaled.
inline void softmax_lanes(const Layout& s, const QueryBlock& b, int64_t g0, int64_t NQ, int64_t w0, int64_t len,
                          int64_t NQP, float* S, float* m, float* l, float* acc) {
  alignas(32) int32_t lo[8], hi[8];
  alignas(32) float old_max[8], new_max[8], sums[8];
  for (int i = 0; i < 8; ++i) {
    const int64_t g = g0 + i;
    lo[i] = hi[i] = 0;
    if (g < NQ) {
      const auto [first, end] = visible(s, b, g / s.group);
      lo[i] = static_cast<int32_t>(std::clamp<int64_t>(first - w0, 0, len));
      hi[i] = static_cast<int32_t>(std::clamp<int64_t>(end - w0, 0, len));
    }
    old_max[i] = g < NQ ? m[g] : -INFINITY;
  }
  const __m256i lo_v = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
  const __m256i hi_v = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  const auto seen = [&](int64_t j) {  // the lanes that see key j of the span
    const __m256i jv = _mm256_set1_epi32(static_cast<int32_t>(j));
    return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(lo_v, jv), _mm256_cmpgt_epi32(hi_v, jv)));
  };
  __m256 mx = _mm256_load_ps(old_max);
  for (int64_t j = 0; j < len; ++j)
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(S + j * NQP + g0), seen(j)));
  _mm256_store_ps(new_max, mx);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    float* row = S + j * NQP + g0;
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(row), mx));
    const __m256 kept = _mm256_and_ps(e, seen(j));  // unseen lanes (an empty lane's NaN too) weigh 0
    _mm256_storeu_ps(row, kept);
    total = _mm256_add_ps(total, kept);
  }
  _mm256_store_ps(sums, total);
  for (int i = 0; i < 8 && g0 + i < NQ; ++i) {
    const int64_t g = g0 + i;
    if (new_max[i] == -INFINITY) continue;  // nothing seen yet
    if (old_max[i] != -INFINITY && new_max[i] > old_max[i]) {
      const float alpha = exp_nonpositive(old_max[i] - new_max[i]);
      l[g] *= alpha;
      for (int64_t d = 0; d < s.head_dim; ++d) acc[g * s.head_dim + d] *= alpha;
    }
    m[g] = new_max[i];
    l[g] += sums[i];
  }
}

// attend_chunk for a block of queries in the vector form (see above).
template <typename T>
void attend_block_chunk(const Layout& s, const float* qv, const T* kv, const int64_t* blocks, const QueryBlock& b,
                        const Chunk& c, Scratch& scratch, float* m, float* l, float* acc) {
  const int64_t D = s.head_dim, R = s.row, BS = s.block_size, NQ = b.count * s.group, NQP = (NQ + 7) / 8 * 8;
  const int64_t head_stride = s.blocks * BS * R;
  const T* keys = kv + c.head * head_stride;
  const T* values = kv + (s.kv_heads + c.head) * head_stride;
  std::vector<float>& qt = scratch.queries_t;
  qt.assign(D * NQP, 0.f);
  for (int64_t g = 0; g < NQ; ++g)
    for (int64_t d = 0; d < D; ++d) qt[d * NQP + g] = qv[g * D + d];
  std::fill(m, m + NQ, -INFINITY);
  std::fill(l, l + NQ, 0.f);
  std::fill(acc, acc + NQ * D, 0.f);
  for (int64_t w0 = c.begin; w0 < c.end; w0 += MAX_BLOCK_KEYS) {
    const int64_t w1 = std::min(c.end, w0 + MAX_BLOCK_KEYS), len = w1 - w0;
    // the span's key and value rows as floats: in the cache (float32) or widened run by run (scale applied)
    std::vector<const float*>& krow = scratch.key_rows;
    std::vector<const float*>& vrow = scratch.value_rows;
    krow.resize(len);
    vrow.resize(len);
    if constexpr (!std::is_same_v<T, float>) {
      scratch.rows.resize(2 * len * D);
    }
    for (int64_t t = w0; t < w1;) {
      const int64_t first = t % BS, run = std::min(BS - first, w1 - t);
      const int64_t at = (blocks[t / BS] * BS + first) * R;
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t j = 0; j < run; ++j) {
          krow[t - w0 + j] = keys + at + j * R;
          vrow[t - w0 + j] = values + at + j * R;
        }
      } else {
        float* kw = scratch.rows.data() + (t - w0) * D;
        float* vw = scratch.rows.data() + (len + t - w0) * D;
        widen_rows(keys + at, run, D, R, kw);
        widen_rows(values + at, run, D, R, vw);
        for (int64_t j = 0; j < run; ++j) {
          krow[t - w0 + j] = kw + j * D;
          vrow[t - w0 + j] = vw + j * D;
        }
      }
      t += run;
    }
    scratch.scores.resize(len * NQP);
    float* S = scratch.scores.data();
    for (int64_t j = 0; j < len; j += 6) {
      const int64_t nk = std::min<int64_t>(6, len - j);
      int64_t g = 0;
      for (; g + 16 <= NQP; g += 16) score_tile<2>(krow.data() + j, nk, qt.data() + g, NQP, D, s.scale, S + j * NQP + g);
      if (g < NQP) score_tile<1>(krow.data() + j, nk, qt.data() + g, NQP, D, s.scale, S + j * NQP + g);
    }
    if (s.softcap > 0.f)
      for (int64_t i = 0; i < len * NQP; ++i) S[i] = std::tanh(S[i] / s.softcap) * s.softcap;
    for (int64_t g0 = 0; g0 < NQ; g0 += 8) softmax_lanes(s, b, g0, NQ, w0, len, NQP, S, m, l, acc);
    if (D % 16 == 0)
      weigh_span<2>(S, NQP, NQ, vrow.data(), len, D, acc);
    else
      weigh_span<1>(S, NQP, NQ, vrow.data(), len, D, acc);
  }
}
#endif

// The order chunks are handed to threads: longest first, dealt round-robin, so each thread's contiguous share of a
// prompt's triangle of work (short early blocks, long late ones) costs about the same.
std::vector<int64_t> balanced_order(const std::vector<Chunk>& chunks, const std::vector<QueryBlock>& blocks) {
  std::vector<int64_t> by_cost(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) by_cost[i] = static_cast<int64_t>(i);
  const auto cost = [&](int64_t i) { return (chunks[i].end - chunks[i].begin) * blocks[chunks[i].block].count; };
  std::stable_sort(by_cost.begin(), by_cost.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  const int64_t n = static_cast<int64_t>(chunks.size()), threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t share = (n + threads - 1) / threads;  // at::parallel_for's contiguous share per thread
  std::vector<std::pair<int64_t, int64_t>> placed(n);  // (where the k-th costliest goes, it): distinct places
  for (int64_t k = 0; k < n; ++k) placed[k] = {(k % threads) * share + k / threads, by_cost[k]};
  std::sort(placed.begin(), placed.end());
  std::vector<int64_t> order(n);
  for (int64_t k = 0; k < n; ++k) order[k] = placed[k].second;
  return order;
}

// Every block's queries over its keys -> out [tokens, H * D].
template <typename T>
void attend(const Layout& s, const float* q, const T* kv, const int64_t* table, const std::vector<QueryBlock>& qb,
            float* out) {
  const int64_t n = static_cast<int64_t>(qb.size()), G = s.group, D = s.head_dim;
  int64_t most_queries = 1;
  for (const QueryBlock& b : qb) most_queries = std::max(most_queries, b.count);
  // chunks per (block, KV head): enough items for every thread, none shorter than MIN_CHUNK keys
  const int64_t want = std::max<int64_t>(1, (ITEMS_PER_THREAD * at::get_num_threads() + n * s.kv_heads - 1) /
                                                (n * s.kv_heads));
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk(n + 1, 0);  // block i's chunks, per head: [first_chunk[i], first_chunk[i + 1])
  for (int64_t i = 0; i < n; ++i) {
    const int64_t begin = visible(s, qb[i], 0).first, keys = qb[i].end - begin;
    const int64_t most = std::min(want, std::max<int64_t>(1, keys / MIN_CHUNK)), step = (keys + most - 1) / most;
    const int64_t count = (keys + step - 1) / step;  // what the loop below makes (at most `most`)
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t a = begin; a < qb[i].end; a += step) chunks.push_back({i, h, a, std::min(qb[i].end, a + step)});
    first_chunk[i + 1] = first_chunk[i] + count;
  }
  std::vector<int64_t> order;
  if (most_queries > 1) order = balanced_order(chunks, qb);
  const int64_t per_chunk = most_queries * G * (2 + D);
  std::vector<float> partial(chunks.size() * per_chunk);  // per chunk: m[NQ], l[NQ], acc[NQ][D]
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t c0, int64_t c1) {
    Scratch scratch;
    std::vector<float> queries;
    for (int64_t k = c0; k < c1; ++k) {
      const int64_t c = order.empty() ? k : order[k];
      const Chunk& chunk = chunks[c];
      const QueryBlock& b = qb[chunk.block];
      const int64_t NQ = b.count * G;
      const float* qv = q + (b.token * s.heads + chunk.head * G) * D;  // a row's group of heads lies together
      if (b.count > 1) {  // the block's tokens' groups, gathered
        queries.resize(NQ * D);
        for (int64_t r = 0; r < b.count; ++r)
          std::memcpy(queries.data() + r * G * D, qv + r * s.heads * D, G * D * sizeof(float));
        qv = queries.data();
      }
      const int64_t* blocks = table + b.seq * s.table_width;
      float* p = partial.data() + c * per_chunk;
      float *m = p, *l = p + NQ, *acc = p + 2 * NQ;
#ifdef KILN_ATTN_YMM
      if (b.count > 1 && D % 8 == 0) {
        attend_block_chunk<T>(s, qv, kv, blocks, b, chunk, scratch, m, l, acc);
        continue;
      }
#endif
      if (D == 64)
        attend_chunk<T, 64>(s, qv, kv, blocks, b, chunk, scratch, m, l, acc);
      else if (D == 128)
        attend_chunk<T, 128>(s, qv, kv, blocks, b, chunk, scratch, m, l, acc);
      else
        attend_chunk<T, 0>(s, qv, kv, blocks, b, chunk, scratch, m, l, acc);
    }
  });
  // merge: chunk j of block i, head h is chunks[kv_heads * first_chunk[i] + h * count_i + j]
  at::parallel_for(0, n * s.kv_heads, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t i = p / s.kv_heads, h = p % s.kv_heads, count = first_chunk[i + 1] - first_chunk[i];
      const int64_t NQ = qb[i].count * G;
      const float* base = partial.data() + (s.kv_heads * first_chunk[i] + h * count) * per_chunk;
      for (int64_t g = 0; g < NQ; ++g) {
        float mx = -INFINITY;
        for (int64_t j = 0; j < count; ++j) mx = std::max(mx, base[j * per_chunk + g]);
        float* o = out + ((qb[i].token + g / G) * s.heads + h * G + g % G) * D;
        std::fill(o, o + D, 0.f);
        float total = 0.f;
        for (int64_t j = 0; j < count; ++j) {
          const float* c = base + j * per_chunk;
          if (c[NQ + g] == 0.f) continue;  // a chunk this query sees nothing of
          const float w = exp_nonpositive(c[g] - mx);
          total += w * c[NQ + g];
          const float* a = c + 2 * NQ + g * D;
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

// The layout of `q` over `kv_cache` (and their checks, in `op`'s words): the cache's geometry and dtype, q's heads.
Layout check_layout(const char* op, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                    int64_t sequences, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "kiln native ", op, ": q must be [tokens, heads, "
              "head_dim] float32");
  const at::ScalarType kv_type = kv_cache.scalar_type();
  const bool scaled = kv_type == at::kChar || kv_type == at::kByte;  // int8, fp8_e4m3: a float32 scale a row
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  (scaled || kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kHalf),
              "kiln native ", op, ": kv_cache must be [2, kv_heads, blocks, block_size, row] float32, bfloat16, "
              "float16, int8 or uint8 (fp8_e4m3 codes)");
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = kv_cache.size(1);
  const int64_t row = head_dim + (scaled ? int64_t(sizeof(float)) : 0);
  TORCH_CHECK(kv_cache.size(4) == row && head_dim <= MAX_HEAD_DIM && head_dim % 4 == 0, "kiln native ", op,
              ": the cache's rows of ", kv_cache.size(4), " must be q's head_dim ", head_dim,
              scaled ? " + 4 (the scale)" : "", " (a multiple of 4, at most ", MAX_HEAD_DIM, ")");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= MAX_GROUP, "kiln native ", op, ": ",
              heads, " query heads do not group over ", kv_heads, " KV heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == sequences && block_table.scalar_type() == at::kLong,
              "kiln native ", op, ": block_table must be [sequences, blocks] int64, one row per sequence");
  return Layout{heads, kv_heads, heads / kv_heads, head_dim, row, kv_cache.size(2), kv_cache.size(3),
                block_table.size(1), window, static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim))),
                static_cast<float>(softcap)};
}

// Every block a query block reads must lie in the cache.
void check_reads(const char* op, const Layout& s, const int64_t* table, const std::vector<QueryBlock>& qb) {
  for (const QueryBlock& b : qb) {
    const int64_t used = (b.end + s.block_size - 1) / s.block_size;
    TORCH_CHECK(used <= s.table_width, "kiln native ", op, ": sequence ", b.seq, " reads ", b.end, " tokens, its "
                "block table ", s.table_width, " blocks of ", s.block_size);
    for (int64_t k = visible(s, b, 0).first / s.block_size; k < used; ++k) {
      const int64_t block = table[b.seq * s.table_width + k];
      TORCH_CHECK(block >= 0 && block < s.blocks, "kiln native ", op, ": sequence ", b.seq, " reads block ", block,
                  " of a cache of ", s.blocks);
    }
  }
}

at::Tensor run(const char* op, const Layout& s, const at::Tensor& q, const at::Tensor& kv_cache,
               const at::Tensor& table, const std::vector<QueryBlock>& qb) {
  check_reads(op, s, table.data_ptr<int64_t>(), qb);
  const at::Tensor qc = q.contiguous(), kc = kv_cache.contiguous();
  at::Tensor out = at::empty({q.size(0), s.heads * s.head_dim}, qc.options());
  if (qb.empty()) return out;
  const float* qp = qc.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  float* op_out = out.data_ptr<float>();
  switch (kc.scalar_type()) {
    case at::kFloat: attend(s, qp, kc.data_ptr<float>(), tp, qb, op_out); break;
    case at::kBFloat16: attend(s, qp, kc.data_ptr<c10::BFloat16>(), tp, qb, op_out); break;
    case at::kHalf: attend(s, qp, kc.data_ptr<c10::Half>(), tp, qb, op_out); break;
    case at::kChar: attend(s, qp, kc.data_ptr<int8_t>(), tp, qb, op_out); break;
    default: attend(s, qp, reinterpret_cast<const Fp8E4M3*>(kc.data_ptr<uint8_t>()), tp, qb, op_out); break;
  }
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, int64_t window, double softcap) {
  const char* op = "paged_decode_attention";
  const int64_t n = q.size(0);
  const Layout s = check_layout(op, q, kv_cache, block_table, n, window, softcap);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == n && seq_lens.scalar_type() == at::kLong, "kiln native ",
              op, ": seq_lens must be [rows] int64, one per query");
  const at::Tensor lens = seq_lens.contiguous(), table = block_table.contiguous();
  const int64_t* L = lens.data_ptr<int64_t>();
  const int64_t* rows = table.data_ptr<int64_t>();
  const int64_t per_block = std::max<int64_t>(1, BLOCK_QUERIES / s.group), W = s.table_width;
  // Rows over one block table at consecutive lengths (a speculative verification's, one sequence's draft tokens)
  // attend as a block of queries, which reads the keys once for all of them: the same numbers a row at a time.
  std::vector<QueryBlock> qb;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = std::max<int64_t>(L[i], 1);
    QueryBlock* last = qb.empty() ? nullptr : &qb.back();
    if (last != nullptr && last->count < per_block && len == last->end + 1 &&
        std::equal(rows + i * W, rows + (i + 1) * W, rows + last->seq * W)) {
      ++last->count;
      last->end = len;
    } else {
      qb.push_back({i, i, 1, len});
    }
  }
  return run(op, s, q, kv_cache, table, qb);
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                   const at::Tensor& seq_lens, const at::Tensor& query_start, int64_t window,
                                   double softcap) {
  const char* op = "paged_prefill_attention";
  const int64_t n = seq_lens.dim() == 1 ? seq_lens.size(0) : -1;
  TORCH_CHECK(n >= 0 && seq_lens.scalar_type() == at::kLong && query_start.dim() == 1 &&
                  query_start.size(0) == n + 1 && query_start.scalar_type() == at::kLong,
              "kiln native ", op, ": seq_lens [sequences] and query_start [sequences + 1] must be int64");
  const Layout s = check_layout(op, q, kv_cache, block_table, n, window, softcap);
  const at::Tensor lens = seq_lens.contiguous(), starts = query_start.contiguous();
  const int64_t* L = lens.data_ptr<int64_t>();
  const int64_t* qs = starts.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[n] == q.size(0), "kiln native ", op, ": query_start must run from 0 to q's ",
              q.size(0), " tokens");
  const int64_t per_block = std::max<int64_t>(1, BLOCK_QUERIES / s.group);
  std::vector<QueryBlock> qb;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t queries = qs[i + 1] - qs[i];
    TORCH_CHECK(queries >= 0 && L[i] >= queries, "kiln native ", op, ": sequence ", i, " has ", queries,
                " queries of ", L[i], " tokens");
    for (int64_t r = 0; r < queries; r += per_block) {
      const int64_t count = std::min(per_block, queries - r);
      qb.push_back({i, qs[i] + r, count, L[i] - queries + r + count});
    }
  }
  return run(op, s, q, kv_cache, block_table.contiguous(), qb);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, int window, "
        "float softcap) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.def("paged_prefill_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor query_start, int window, float softcap) -> Tensor");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_attention));
}
