// Paged attention over a ragged batch, for CPUs: one call per layer for every sequence of
// the step (decode rows, verification rows, prefill chunks). It writes the step's new keys
// and values to their cache slots, then reads the cache blocks in place through the
// block table.
//
// Cache layout: keys [blocks, kv_heads, head_dim, block_size] (each block transposed, so
// 16 consecutive keys of one dimension are one vector), values [slots, kv_heads,
// head_dim]. A row's scores for a tile of 16 keys are then one vector built by head_dim
// FMAs, and its weighted values are FMAs on value rows: no horizontal sums.
//
// Work is split into (sequence, KV head, up to kQueryTile queries) items spread over the
// intra-op threads. An item stacks the query heads that share its KV head into rows,
// attends kRows rows at a time to each key tile (so each tile is read once per kRows
// rows) and keeps an online softmax per row. Which keys a row sees is computed from
// positions: causal, a sliding window, and for token trees its ancestor bitmask (bit d:
// the key d positions before its own). Nothing is padded and no mask tensor exists.
//
// Built on first use by outrider/engine/kernels/__init__.py (torch's extension tooling).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using outrider::lane_max;
using outrider::lane_sum;
using outrider::load;
using outrider::splat;
using outrider::vexp;
using outrider::vf16;
using outrider::vi16;

constexpr int64_t kQueryTile = 16;  // queries per work item
constexpr int64_t kTile = 16;       // keys per online-softmax step: one vf16 of scores
constexpr int kRows = 8;            // rows attended together (at most)
constexpr float kNoScore = -1e30f;  // a key a row does not see (finite, so no inf arithmetic)

struct Layout {
  int64_t heads, kv_heads, head_dim, group, block_size;
  int64_t q_row, q_head;  // q strides (token, head); head_dim is contiguous
  int64_t window;         // 0: none
  float scale;
  float softcap;          // scores become softcap * tanh(score / softcap); 0: none
};

struct Item {
  int32_t seq, kv_head, first_query, num_queries;
};

// A tile of 16 keys as float: dimension d of key p at k[d * k_stride + p], dimension d of
// value p at v[p * v_stride + d]. Either the cache itself (float32 blocks of a multiple of
// 16 positions) or the thread's converted copy.
struct Tile {
  const float* k;
  int64_t k_stride;
  const float* v;
  int64_t v_stride;
};

// One thread's scratch, reused across its items. Rows of head_dim are padded with zeros
// to whole vf16s (`dims` floats).
struct Scratch {
  std::vector<vf16> qs, acc, kt, vt;  // [rows, dims/16], [rows, dims/16], [dims], [16, dims/16]
  std::vector<vf16> l;                // running sum of each row, lane by lane
  std::vector<float> m;               // running max of each row
  std::vector<int64_t> lo, hi;        // keys [lo, hi) each row may see
  float* lanes(std::vector<vf16>& v) { return reinterpret_cast<float*>(v.data()); }
};

struct Cache {
  const void* k;
  const void* v;
  const int32_t* block_table;  // this sequence's
};

template <typename T>
Tile load_tile(int64_t t0, int64_t count, int64_t kv_head, const Cache& c, const Layout& L,
               Scratch& w) {
  const int64_t D = L.head_dim, B = L.block_size, dims = w.kt.size();
  const T* k = static_cast<const T*>(c.k);
  const T* v = static_cast<const T*>(c.v);
  const int64_t v_row = L.kv_heads * D;
  if (B % kTile == 0) {  // the tile lies inside one block
    const int64_t block = c.block_table[t0 / B], offset = t0 % B;
    const T* kb = k + ((block * L.kv_heads + kv_head) * D) * B + offset;
    const T* vb = v + (block * B + offset) * v_row + kv_head * D;
    if constexpr (std::is_same_v<T, float>) {
      if (D % kTile == 0) return {kb, B, vb, v_row};
    }
    float* kt = w.lanes(w.kt);
    float* vt = w.lanes(w.vt);
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t p = 0; p < kTile; ++p) kt[d * kTile + p] = static_cast<float>(kb[d * B + p]);
    }
    for (int64_t p = 0; p < count; ++p) {
      for (int64_t d = 0; d < D; ++d) vt[p * dims + d] = static_cast<float>(vb[p * v_row + d]);
    }
    return {kt, kTile, vt, dims};
  }
  float* kt = w.lanes(w.kt);  // small blocks: key by key
  float* vt = w.lanes(w.vt);
  for (int64_t p = 0; p < count; ++p) {
    const int64_t pos = t0 + p, block = c.block_table[pos / B], offset = pos % B;
    const T* kp = k + ((block * L.kv_heads + kv_head) * D) * B + offset;
    const T* vp = v + (block * B + offset) * v_row + kv_head * D;
    for (int64_t d = 0; d < D; ++d) {
      kt[d * kTile + p] = static_cast<float>(kp[d * B]);
      vt[p * dims + d] = static_cast<float>(vp[d]);
    }
  }
  return {kt, kTile, vt, dims};
}

// Which of a tile's 16 keys a row sees: [from, to) of the tile, and in a token tree only
// its ancestors and itself among the 64 positions before it (bit d of `tree`: the key d
// positions before the row's own, `at`); keys further back are its context.
inline vi16 seen_keys(int64_t from, int64_t to, int64_t t0, int64_t at, int64_t tree) {
  const vi16 index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  vi16 seen = (index >= static_cast<int32_t>(from)) & (index < static_cast<int32_t>(to));
  if (tree != -1) {
    for (int p = 0; p < 16; ++p) {
      const int64_t d = at - (t0 + p);
      if (d >= 0 && d < 64 && !((tree >> d) & 1)) seen[p] = 0;
    }
  }
  return seen;
}

// cap * tanh(s / cap) (Gemma 2's logit soft-capping), as 1 - 2 / (e^2x + 1)
inline vf16 soft_capped(vf16 s, float cap) {
  const vf16 e = vexp(s * (2.0f / cap));
  return (1.0f - 2.0f / (e + 1.0f)) * cap;
}

// acc of rows [r0, r0 + kN), chunks [c, c + kC) of head_dim: rescaled by the rows'
// corrections, plus the tile's values weighted by e.
template <int kN, int kC>
inline void add_values(int64_t r0, int64_t c, int64_t first, int64_t last, const vf16* e,
                       const float* correction, const Tile& tile, int64_t chunks,
                       Scratch& w) {
  vf16 a[kC][kN];
  for (int j = 0; j < kC; ++j) {
    for (int k = 0; k < kN; ++k) a[j][k] = w.acc[(r0 + k) * chunks + c + j] * correction[k];
  }
  for (int64_t p = first; p < last; ++p) {
    for (int j = 0; j < kC; ++j) {
      const vf16 v = load(tile.v + p * tile.v_stride + (c + j) * kTile);
      for (int k = 0; k < kN; ++k) a[j][k] += e[k][p] * v;
    }
  }
  for (int j = 0; j < kC; ++j) {
    for (int k = 0; k < kN; ++k) w.acc[(r0 + k) * chunks + c + j] = a[j][k];
  }
}

// The online-softmax step of rows [r0, r0 + kN) over one key tile: scores, running max
// and sum, and the weighted values added to acc. The rows share every key and value load,
// and their kN independent sums keep the FMA units busy.
template <int kN>
void attend_tile(int64_t r0, int64_t t0, int64_t count, const Tile& tile,
                 int64_t head_dim, int64_t group, int64_t first_token,
                 const int64_t* tree_masks, float softcap, Scratch& w) {
  int64_t from[kN], to[kN], first = kTile, last = 0;
  for (int k = 0; k < kN; ++k) {
    from[k] = std::max(w.lo[r0 + k], t0) - t0;
    to[k] = std::min(w.hi[r0 + k], t0 + count) - t0;
    if (from[k] < to[k]) {
      first = std::min(first, from[k]);
      last = std::max(last, to[k]);
    }
  }
  if (first >= last) return;
  const int64_t chunks = static_cast<int64_t>(w.kt.size()) / kTile, dims = chunks * kTile;
  const float* qs = w.lanes(w.qs) + r0 * dims;
  // kN rows are kN chains of dependent FMAs; fewer than 4 cannot hide an FMA's latency,
  // so each row then sums kSplit interleaved parts of head_dim apart
  constexpr int kSplit = kN >= 4 ? 1 : (kN == 1 ? 4 : 2);
  vf16 part[kSplit][kN] = {};
  int64_t d = 0;
  for (; d + kSplit <= head_dim; d += kSplit) {
    for (int j = 0; j < kSplit; ++j) {
      const vf16 kd = load(tile.k + (d + j) * tile.k_stride);
      for (int k = 0; k < kN; ++k) part[j][k] += qs[k * dims + d + j] * kd;
    }
  }
  for (; d < head_dim; ++d) {
    const vf16 kd = load(tile.k + d * tile.k_stride);
    for (int k = 0; k < kN; ++k) part[0][k] += qs[k * dims + d] * kd;
  }
  vf16 s[kN];
  for (int k = 0; k < kN; ++k) {
    s[k] = part[0][k];
    for (int j = 1; j < kSplit; ++j) s[k] += part[j][k];
    if (softcap > 0.0f) s[k] = soft_capped(s[k], softcap);
  }
  vf16 e[kN];
  float correction[kN];
  for (int k = 0; k < kN; ++k) {
    const int64_t r = r0 + k;
    const int64_t tree = tree_masks ? tree_masks[first_token + r / group] : -1;
    const vi16 seen = seen_keys(from[k], to[k], t0, w.hi[r] - 1, tree);
    const float tile_max = lane_max(seen ? s[k] : splat(kNoScore));
    const float new_max = std::max(w.m[r], tile_max);
    correction[k] = new_max == w.m[r] ? 1.0f : std::exp(w.m[r] - new_max);
    e[k] = seen ? vexp(s[k] - new_max) : vf16{};
    w.l[r] = w.l[r] * correction[k] + e[k];
    w.m[r] = new_max;
  }
  // likewise, few rows take kSplit chunks of head_dim at once
  int64_t c = 0;
  for (; c + kSplit <= chunks; c += kSplit) {
    add_values<kN, kSplit>(r0, c, first, last, e, correction, tile, chunks, w);
  }
  for (; c < chunks; ++c) add_values<kN, 1>(r0, c, first, last, e, correction, tile, chunks, w);
}

// Rows [r0, r0 + n) for n <= kRows, with the row count known to the compiler.
void attend_rows(int n, int64_t r0, int64_t t0, int64_t count,
                 const Tile& tile, int64_t head_dim, int64_t group, int64_t first_token,
                 const int64_t* tree_masks, float softcap, Scratch& w) {
  static constexpr decltype(&attend_tile<1>) by_rows[kRows] = {
      attend_tile<1>, attend_tile<2>, attend_tile<3>, attend_tile<4>,
      attend_tile<5>, attend_tile<6>, attend_tile<7>, attend_tile<8>};
  by_rows[n - 1](r0, t0, count, tile, head_dim, group, first_token, tree_masks, softcap, w);
}

// One item: rows r = query * group + g of its queries' heads kv_head * group + g.
template <typename T>
void attend_item(const Item& it, const T* q, const Cache& cache, T* out,
                 const int32_t* query_start, const int32_t* context_lens,
                 const int64_t* tree_masks, const Layout& L, Scratch& w) {
  const int64_t D = L.head_dim, G = L.group;
  const int64_t chunks = (D + kTile - 1) / kTile, dims = chunks * kTile;
  const int64_t rows = it.num_queries * G;
  const int64_t q_len = query_start[it.seq + 1] - query_start[it.seq];
  const int64_t cached = context_lens[it.seq] - q_len;
  const int64_t first_token = query_start[it.seq] + it.first_query;

  w.qs.assign(rows * chunks, vf16{});
  w.acc.assign(rows * chunks, vf16{});
  w.kt.assign(dims, vf16{});
  w.vt.assign(kTile * chunks, vf16{});
  w.m.assign(rows, kNoScore);
  w.l.assign(rows, vf16{});
  w.lo.resize(rows);
  w.hi.resize(rows);
  float* qs = w.lanes(w.qs);
  for (int64_t qi = 0; qi < it.num_queries; ++qi) {
    const int64_t pos = cached + it.first_query + qi;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = qi * G + g;
      const T* src = q + (first_token + qi) * L.q_row + (it.kv_head * G + g) * L.q_head;
      for (int64_t d = 0; d < D; ++d) qs[r * dims + d] = static_cast<float>(src[d]) * L.scale;
      w.lo[r] = L.window > 0 ? std::max<int64_t>(0, pos - L.window + 1) : 0;
      w.hi[r] = pos + 1;  // causal
    }
  }
  const int64_t first_key = *std::min_element(w.lo.begin(), w.lo.end());
  const int64_t end_key = *std::max_element(w.hi.begin(), w.hi.end());

  for (int64_t t0 = first_key / kTile * kTile; t0 < end_key; t0 += kTile) {
    const int64_t count = std::min(kTile, end_key - t0);
    const Tile tile = load_tile<T>(t0, count, it.kv_head, cache, L, w);
    // rows in blocks of at most kRows, as even as can be (25: 7 6 6 6, not 8 8 8 1: a
    // block of few rows waits on the latency of its few FMA chains)
    const int64_t blocks = (rows + kRows - 1) / kRows;
    for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
      const int n = static_cast<int>((rows - r0) / (blocks - b));
      attend_rows(n, r0, t0, count, tile, D, G, first_token, tree_masks, L.softcap, w);
      r0 += n;
    }
  }
  const float* acc = w.lanes(w.acc);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qi = r / G, g = r % G;
    T* dst = out + (first_token + qi) * L.heads * D + (it.kv_head * G + g) * D;
    const float sum = lane_sum(w.l[r]);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * dims + d] * inv);
  }
}

std::vector<Item> work_items(const int32_t* query_start, int64_t num_seqs, int64_t kv_heads) {
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start[s + 1] - query_start[s];
    for (int64_t first = 0; first < q_len; first += kQueryTile) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h),
                         static_cast<int32_t>(first),
                         static_cast<int32_t>(std::min(kQueryTile, q_len - first))});
      }
    }
  }
  return items;
}

// The step's new keys and values into their slots (keys transposed within their block).
template <typename T>
void write_new_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                  at::Tensor& v_cache, const int64_t* slots, const Layout& L) {
  const int64_t D = L.head_dim, B = L.block_size;
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  for (int64_t t = 0; t < k.size(0); ++t) {
    const int64_t block = slots[t] / B, offset = slots[t] % B;
    for (int64_t h = 0; h < L.kv_heads; ++h) {
      const T* kt = k.data_ptr<T>() + t * k.stride(0) + h * k.stride(1);
      T* kb = kc + ((block * L.kv_heads + h) * D) * B + offset;
      for (int64_t d = 0; d < D; ++d) kb[d * B] = kt[d];
      std::memcpy(vc + (slots[t] * L.kv_heads + h) * D,
                  v.data_ptr<T>() + t * v.stride(0) + h * v.stride(1), D * sizeof(T));
    }
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
         at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& query_start,
         const at::Tensor& context_lens, const at::Tensor& block_tables,
         const std::optional<at::Tensor>& tree_masks, at::Tensor& out, const Layout& L) {
  write_new_kv<T>(k, v, k_cache, v_cache, slot_mapping.data_ptr<int64_t>(), L);
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* trees = tree_masks ? tree_masks->data_ptr<int64_t>() : nullptr;
  const int64_t table_width = block_tables.size(1);
  const std::vector<Item> items = work_items(starts, context_lens.size(0), L.kv_heads);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const Cache cache{k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                        tables + it.seq * table_width};
      attend_item<T>(it, qp, cache, op, starts, ctx, trees, L, scratch);
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "outrider paged_attention: ", what); }

// q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] (the step's new keys
// and values); k_cache: [blocks, kv_heads, head_dim, block_size]; v_cache: [blocks *
// block_size, kv_heads, head_dim]; slot_mapping: [tokens] int64; query_start: [seqs + 1]
// int32 (each sequence's first row, then the total); context_lens: [seqs] int32 (cached +
// new positions); block_tables: [seqs, width] int32; tree_masks: [tokens] int64 or none
// (-1: causal; else bit d says whether the key d positions back is seen, d < 64);
// softcap: scores capped to (-softcap, softcap) by tanh before the softmax (0: none).
// Returns [tokens, heads * head_dim].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor k_cache, at::Tensor v_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& query_start,
                           const at::Tensor& context_lens, const at::Tensor& block_tables,
                           const std::optional<at::Tensor>& tree_masks, int64_t window,
                           double scale, double softcap) {
  check(q.device().is_cpu(), "CPU tensors only");
  check(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v: [tokens, heads, head_dim]");
  check(k_cache.dim() == 4 && v_cache.dim() == 3, "cache shapes");
  check(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_dim not contiguous");
  check(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches not contiguous");
  check(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
            k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
        "dtypes differ");
  check(slot_mapping.scalar_type() == at::kLong && query_start.scalar_type() == at::kInt &&
            context_lens.scalar_type() == at::kInt && block_tables.scalar_type() == at::kInt,
        "metadata dtypes");
  check(block_tables.is_contiguous() && slot_mapping.is_contiguous() &&
            query_start.is_contiguous() && context_lens.is_contiguous(),
        "metadata layout");
  check(!tree_masks || (tree_masks->scalar_type() == at::kLong && tree_masks->is_contiguous()),
        "tree_masks: int64");
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1), head_dim = q.size(2);
  check(heads % kv_heads == 0 && k_cache.size(2) == head_dim, "heads and kv_heads");
  at::Tensor out = at::empty({q.size(0), heads * head_dim}, q.options());
  const Layout L{heads,       kv_heads,    head_dim, heads / kv_heads, k_cache.size(3),
                 q.stride(0), q.stride(1), window,   static_cast<float>(scale),
                 static_cast<float>(softcap)};
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k, v, k_cache, v_cache, slot_mapping, query_start, context_lens,
               block_tables, tree_masks, out, L);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q, k, v, k_cache, v_cache, slot_mapping, query_start, context_lens,
                       block_tables, tree_masks, out, L);
  } else {
    check(false, "float32 or bfloat16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(outrider_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor query_start, Tensor context_lens, Tensor block_tables, "
      "Tensor? tree_masks, int window, float scale, float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(outrider_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
