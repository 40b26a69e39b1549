// Paged decode attention on CPU: one new query token per sequence against its K/V, read in place
// from the paged pool by block table (no gather into a contiguous copy).
//
// Layout (see pdd/engine/kv_cache.py): blocks [NB+1, bs, 2, KV, D] contiguous float32;
// q [B, H, D] with H = KV * G, the G query heads of KV group k being heads k*G .. k*G+G-1;
// block_tables [B, MB] int64 (entries past a sequence's length are padding, never read);
// context_lens [B] int64 (tokens to attend, >= 1). Output [B, H, D] float32.
//
// One work item is a sequence (or, for a small batch, a run of its KV heads): its token rows are
// read in memory order, block by block, each K/V row once for the G query heads that share it.
// The context is streamed in tiles of whole blocks with an online softmax: per tile the scores,
// one max/rescale per query head, then the V sum.
// Registered as torch.ops.pdd.paged_decode (no pybind, so Python headers are not needed).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using namespace pdd_vec;

// Tokens per online-softmax tile (rounded to whole blocks): amortizes the per-tile rescale.
constexpr int64_t kTileTokens = 64;
// Token rows prefetched ahead of the scores pass (into L2): blocks sit at random places in the
// pool, so the hardware prefetcher loses the stream at every block boundary.
// (32 rows: measured 1.4x over none at 32 sequences x 200 tokens; 8 and 16 were in between.)
constexpr int64_t kAheadRows = 32;

struct Geometry {
  int64_t G, D, bs;
  int64_t heads;         // KV heads per work item (a divisor of KV)
  int64_t block_stride;  // floats per block: bs * 2 * KV * D
  int64_t token_stride;  // floats per token row: 2 * KV * D
  int64_t v_offset;      // K -> V of the same token and head: KV * D
  int64_t q_head_stride;
  float scale;
};

// One work item: a sequence's query rows r = hh * G + g (KV head hh of the item, g of its group)
// against its first ctx tokens. kv_base points at K of the item's first KV head in block 0.
// kD: the head dim when known at compile time (loops fully unrolled), 0 for any.
template <int64_t kD>
PDD_INLINE void attend(const float* q, const float* kv_base, const int64_t* table, int64_t ctx, const Geometry& geo,
                       float* out, float* scratch) {
  const int64_t G = geo.G, D = kD ? kD : geo.D, bs = geo.bs, heads = geo.heads, R = heads * G;
  const int64_t tile_blocks = std::max<int64_t>(1, kTileTokens / bs);
  const int64_t tile_len = tile_blocks * bs;
  float* scores = scratch;            // [R, tile_len]
  float* acc = scores + R * tile_len;  // [R, D]
  float* row_max = acc + R * D;       // [R]
  float* row_sum = row_max + R;       // [R]
  for (int64_t i = 0; i < R * D; ++i) acc[i] = 0.f;
  for (int64_t r = 0; r < R; ++r) {
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.f;
  }
  const int64_t num_blocks = (ctx + bs - 1) / bs;
  int64_t ahead_blk = 0, ahead_off = 0;  // the next token row to prefetch
  const int64_t ahead_end = std::min(ctx, kAheadRows);
  const auto prefetch_next = [&] {
    const float* row = kv_base + table[ahead_blk] * geo.block_stride + ahead_off * geo.token_stride;
    for (int64_t i = 0; i < heads * D; i += kLanes) {
      __builtin_prefetch(row + i, 0, 2);
      __builtin_prefetch(row + geo.v_offset + i, 0, 2);
    }
    if (++ahead_off == bs) ahead_off = 0, ++ahead_blk;
  };
  for (int64_t i = 0; i < ahead_end; ++i) prefetch_next();
  for (int64_t first = 0; first < num_blocks; first += tile_blocks) {
    const int64_t last = std::min(num_blocks, first + tile_blocks);
    const int64_t n = std::min(ctx, last * bs) - first * bs;  // tokens in this tile
    // Scores. Token rows are walked in memory order, block by block; each K row serves G heads.
    for (int64_t blk = first; blk < last; ++blk) {
      const float* block = kv_base + table[blk] * geo.block_stride;
      const int64_t t0 = (blk - first) * bs, count = std::min(bs, ctx - blk * bs);
      for (int64_t off = 0; off < count; ++off) {
        if (ahead_blk * bs + ahead_off < ctx) prefetch_next();
        const float* row = block + off * geo.token_stride;
        for (int64_t hh = 0; hh < heads; ++hh)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = hh * G + g;
            scores[r * tile_len + t0 + off] = dot(q + r * geo.q_head_stride, row + hh * D, D) * geo.scale;
          }
      }
    }
    // Online softmax: rescale what was accumulated so far to the new running max.
    for (int64_t r = 0; r < R; ++r) {
      float* sr = scores + r * tile_len;
      const int64_t full = n - n % kLanes;
      vec16 mv = splat(row_max[r]);
      for (int64_t t = 0; t < full; t += kLanes) {
        const vec16 v = load16(sr + t);
        mv = v > mv ? v : mv;
      }
      float m = hmax(mv);
      for (int64_t t = full; t < n; ++t) m = std::max(m, sr[t]);
      const float correction = std::exp(row_max[r] - m);  // 0 on the first tile (exp(-inf))
      vec16 sv = {};
      for (int64_t t = 0; t < full; t += kLanes) {
        const vec16 p = exp_nonpositive(load16(sr + t) - m);
        store16(sr + t, p);
        sv += p;
      }
      float sum = hsum(sv);
      if (full < n) {  // the tail through the same exp, padded
        vec16 x = splat(-87.3f);
        for (int64_t t = full; t < n; ++t) x[t - full] = sr[t] - m;
        const vec16 p = exp_nonpositive(x);
        for (int64_t t = full; t < n; ++t) sum += (sr[t] = p[t - full]);
      }
      row_sum[r] = row_sum[r] * correction + sum;
      row_max[r] = m;
      if (correction != 1.f)
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= correction;
    }
    // Weighted V sum, same walk; each V row serves G heads.
    for (int64_t blk = first; blk < last; ++blk) {
      const float* block = kv_base + table[blk] * geo.block_stride + geo.v_offset;
      const int64_t t0 = (blk - first) * bs, count = std::min(bs, ctx - blk * bs);
      for (int64_t off = 0; off < count; ++off) {
        const float* row = block + off * geo.token_stride;
        for (int64_t hh = 0; hh < heads; ++hh)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = hh * G + g;
            axpy(acc + r * D, scores[r * tile_len + t0 + off], row + hh * D, D);
          }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.f / row_sum[r];
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = acc[r * D + d] * inv;
  }
}

using AttendFn = void (*)(const float*, const float*, const int64_t*, int64_t, const Geometry&, float*, float*);
PDD_CLONES void attend_d64(const float* q, const float* kv, const int64_t* table, int64_t ctx, const Geometry& geo,
                           float* out, float* scratch) {
  attend<64>(q, kv, table, ctx, geo, out, scratch);
}
PDD_CLONES void attend_d128(const float* q, const float* kv, const int64_t* table, int64_t ctx,
                            const Geometry& geo, float* out, float* scratch) {
  attend<128>(q, kv, table, ctx, geo, out, scratch);
}
PDD_CLONES void attend_any(const float* q, const float* kv, const int64_t* table, int64_t ctx, const Geometry& geo,
                           float* out, float* scratch) {
  attend<0>(q, kv, table, ctx, geo, out, scratch);
}

}  // namespace

namespace pdd_ops {

at::Tensor paged_decode(const at::Tensor& q_in, const at::Tensor& blocks, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && blocks.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && blocks.scalar_type() == at::kFloat,
              "paged_decode: float32 q and blocks only");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode: int64 block_tables and context_lens");
  TORCH_CHECK(q_in.dim() == 3 && blocks.dim() == 5 && block_tables.dim() == 2 && context_lens.dim() == 1,
              "paged_decode: expected q [B, H, D], blocks [NB+1, bs, 2, KV, D], block_tables [B, MB], "
              "context_lens [B]");
  TORCH_CHECK(blocks.is_contiguous(), "paged_decode: blocks must be contiguous");
  TORCH_CHECK(blocks.size(2) == 2, "paged_decode: blocks dim 2 must be K/V");
  const int64_t B = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  const int64_t num_blocks = blocks.size(0), bs = blocks.size(1), KV = blocks.size(3);
  TORCH_CHECK(blocks.size(4) == D, "paged_decode: head dim of q and blocks differ");
  TORCH_CHECK(KV > 0 && H % KV == 0, "paged_decode: query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "paged_decode: batch sizes differ");
  // A strided q (a slice of the fused qkv output) is read in place; only D must be unit-stride.
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int64_t MB = tables.size(1);
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  // Validate every block id that will be read before any thread reads memory by it.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ctx = len_ptr[b];
    TORCH_CHECK(ctx >= 1 && ctx <= MB * bs, "paged_decode: context length ", ctx, " of sequence ", b,
                " is outside [1, ", MB * bs, "]");
    for (int64_t i = 0; i < (ctx + bs - 1) / bs; ++i) {
      const int64_t id = table_ptr[b * MB + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode: block id ", id, " out of range");
    }
  }
  at::Tensor out = at::empty({B, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t G = H / KV;
  // A work item is one sequence and a run of its KV heads. Whole sequences keep each item's reads
  // streaming through whole token rows [2, KV, D]; a small batch is split by heads so that every
  // thread gets work.
  const int64_t threads = at::get_num_threads();
  int64_t heads = KV;
  while (heads % 2 == 0 && B * (KV / heads) < 4 * threads) heads /= 2;
  const Geometry geo{G, D, bs, heads, bs * 2 * KV * D, 2 * KV * D, KV * D, q.stride(1), static_cast<float>(scale)};
  const float* q_ptr = q.data_ptr<float>();
  const float* kv_ptr = blocks.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t q_batch_stride = q.stride(0);
  const int64_t chunks = KV / heads;
  const AttendFn attend_fn = D == 64 ? attend_d64 : D == 128 ? attend_d128 : attend_any;

  const int64_t items = B * chunks;
  const int64_t tile_tokens = std::max<int64_t>(1, kTileTokens / bs) * bs;
  const int64_t rows = heads * G;
  const int64_t scratch_size = rows * tile_tokens + rows * D + 2 * rows;
  const auto attend_item = [&](int64_t i, float* scratch) {
    const int64_t b = i / chunks, h0 = (i % chunks) * heads;  // first KV head of the item
    attend_fn(q_ptr + b * q_batch_stride + h0 * G * geo.q_head_stride, kv_ptr + h0 * D, table_ptr + b * MB,
              len_ptr[b], geo, out_ptr + (b * H + h0 * G) * D, scratch);
  };
  // Items go to whichever thread is free (an atomic counter), longest context first so that the
  // last ones taken are short: on a host whose other processes wake on the engine's cores, a
  // preempted thread then holds up only the item in its hands, not a fixed half of the batch
  // (as panel_gemm's runs).
  std::vector<int64_t> order(items);
  for (int64_t i = 0; i < items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return len_ptr[a / chunks] > len_ptr[b / chunks]; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(1, std::min(threads, items)), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(scratch_size);
    for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < items;) attend_item(order[k], scratch.data());
  });
  return out;
}

}  // namespace pdd_ops

TORCH_LIBRARY_FRAGMENT(pdd, m) {
  m.def("paged_decode(Tensor q, Tensor blocks, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdd, CPU, m) { m.impl("paged_decode", &pdd_ops::paged_decode); }
