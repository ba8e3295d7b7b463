// x [rows, in] bfloat16 @ a 4-bit weight [out, in]^T, for CPUs with AVX512-BF16: the
// levels of one group of 32 outputs (a slab) are turned into bfloat16 in L1, every row of
// x is multiplied by that slab (AMX tile products where the CPU has them, else
// VDPBF16PS), and only then is the next slab made. torch's CPU int4 kernel
// turns the weight into floats again for each block of rows and multiplies with vector
// FMAs, so a decode step of 16-64 rows ran slower than the bfloat16 weights it stands
// for (docs/DESIGN.md §8.11).
//
//   int4_gemm(x, packed, scale, scaled_zero?, group)
//     x            [rows, in] bfloat16, rows contiguous
//     packed       [out / 16, in / 4, 32] uint8 (int4_layout in quant/weight.py): for
//                  16 outputs and 4 inputs, byte j holds unsigned levels (the signed
//                  level + 8) of output j / 2: input j % 2 in its low nibble, input
//                  2 + j % 2 in its high one (VDPBF16PS's lanes: pairs of inputs)
//     scale        [out / 16, in / group, 16] float32: each group's scale
//     scaled_zero  [out / 16, in / group, 16] float32: scale * zero, or none (symmetric)
//   -> [rows, out] bfloat16: sum over groups of scale * (sum of x * level - zero * sum of
//      x), each group's sums in float32 (its bf16 products are exact)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "amx.h"
#define OUTRIDER_AMX 1
#endif

namespace {

constexpr int kBlock = 16;     // outputs a vector holds (float32 lanes)
constexpr int kSlab = 2;       // blocks a task's slab holds: 32 outputs
constexpr int kRowTile = 4;    // rows of x multiplied per pass over a slab
constexpr int kMaxGroup = 256;

void check(bool ok, const char* what) { TORCH_CHECK(ok, "outrider int4_gemm: ", what); }

// lane i -> bfloat16 of (i % 16) - 8: the signed level of unsigned level u = i
__m512i level_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) table[i] = c10::BFloat16(static_cast<float>((i & 15) - 8)).x;
  return _mm512_load_si512(table);
}

struct Weight {
  const uint8_t* packed;
  const float* scale;
  const float* scaled_zero;  // null: symmetric
  int64_t in, group;
};

// One group of `blocks` blocks from `block` on as bfloat16 pairs: slab[pair * kSlab + b]
// is VDPBF16PS's operand for inputs 2 * pair, 2 * pair + 1 of the group, block b.
template <int blocks>
inline void make_slab(const Weight& w, int64_t block, int64_t g, __m512i table, __m512i* slab) {
  const __m512i low = _mm512_set1_epi16(0x0F);
  const int64_t quads = w.group / 4, quads_a_block = w.in / 4;
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* source = w.packed + ((block + b) * quads_a_block + g * quads) * 32;
    for (int64_t q = 0; q < quads; ++q) {
      const __m512i u = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source + q * 32)));
      slab[(2 * q) * kSlab + b] = _mm512_permutexvar_epi16(_mm512_and_si512(u, low), table);
      slab[(2 * q + 1) * kSlab + b] = _mm512_permutexvar_epi16(_mm512_srli_epi16(u, 4), table);
    }
  }
}

// totals[r, b] += scale * sum_of(r, b) - scale * zero * x_sums[r, g], sum_of(r, b) being
// group g's sums of x[r] * level for block b (a float32 vector), for `rows` rows.
template <typename Sums>
inline void scale_into(const Weight& w, const float* x_sums, int64_t rows, int64_t block,
                       int blocks, int64_t g, Sums&& sum_of, float* totals) {
  const int64_t groups = w.in / w.group;
  for (int b = 0; b < blocks; ++b) {
    const int64_t at = ((block + b) * groups + g) * kBlock;
    const __m512 scale = _mm512_loadu_ps(w.scale + at);  // once: totals may alias it
    const __m512 scaled_zero = w.scaled_zero ? _mm512_loadu_ps(w.scaled_zero + at)
                                             : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      float* total = totals + (r * kSlab + b) * kBlock;
      __m512 t = _mm512_fmadd_ps(sum_of(r, b), scale, _mm512_loadu_ps(total));
      if (w.scaled_zero)
        t = _mm512_fnmadd_ps(_mm512_set1_ps(x_sums[r * groups + g]), scaled_zero, t);
      _mm512_storeu_ps(total, t);
    }
  }
}

// Group g's products for `rows` rows of x from `x` (stride w.in) by VDPBF16PS: each
// pair of x's inputs, in every lane, against the slab's pair for 16 outputs.
template <int rows, int blocks>
inline void multiply(const Weight& w, const c10::BFloat16* x, const float* x_sums,
                     int64_t block, int64_t g, const __m512i* slab, float* totals) {
  __m512 sums[rows][blocks];
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < blocks; ++b) sums[r][b] = _mm512_setzero_ps();
  const c10::BFloat16* first = x + g * w.group;
  for (int64_t p = 0; p < w.group / 2; ++p) {
    for (int r = 0; r < rows; ++r) {
      int32_t two;  // x[r, 2p], x[r, 2p + 1] of the group
      std::memcpy(&two, first + r * w.in + 2 * p, sizeof(two));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(two);
      for (int b = 0; b < blocks; ++b)
        sums[r][b] = _mm512_dpbf16_ps(sums[r][b], a, (__m512bh)slab[p * kSlab + b]);
    }
  }
  scale_into(w, x_sums, rows, block, blocks, g, [&](int64_t r, int b) { return sums[r][b]; },
             totals);
}

#if defined(OUTRIDER_AMX)
using outrider::amx_permitted;
using outrider::configure_tiles;
using outrider::kTileRows;
constexpr int kTileDepth = 32;  // inputs a tile product sums: 16 bfloat16 pairs

// As multiply, for 16 rows of x (padded: `rows` of them real) and a whole slab, by tile
// products; the sums go through `sums` [kSlab][16 rows][16] float32 to be scaled.
void multiply_tiles(const Weight& w, const c10::BFloat16* x, const float* x_sums, int64_t rows,
                    int64_t block, int64_t g, const __m512i* slab, float* sums, float* totals) {
  _tile_zero(0);
  _tile_zero(1);
  const c10::BFloat16* first = x + g * w.group;
  for (int64_t k = 0; k < w.group; k += kTileDepth) {
    const __m512i* pairs = slab + (k / 2) * kSlab;
    _tile_loadd(2, first + k, w.in * sizeof(c10::BFloat16));
    _tile_loadd(3, pairs, kSlab * sizeof(__m512i));
    _tile_loadd(4, pairs + 1, kSlab * sizeof(__m512i));
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, sums, kBlock * sizeof(float));
  _tile_stored(1, sums + kTileRows * kBlock, kBlock * sizeof(float));
  scale_into(w, x_sums, rows, block, kSlab, g, [&](int64_t r, int b) {
    return _mm512_loadu_ps(sums + (b * kTileRows + r) * kBlock);
  }, totals);
}
#endif  // OUTRIDER_AMX

// The rows of x a call multiplies, and how.
struct Rows {
  const c10::BFloat16* x;  // [count, in]; for tiles, padded to a multiple of 16 rows
  int64_t count;
  bool tiles;
  const float* sums;       // [count, groups]: each group's sum of x (zero points only)
};

// y[:, 16 * block ...] for `blocks` blocks: each group's slab made once and every row
// multiplied by it, the rows' sums kept in totals [count, kSlab * kBlock] float32.
template <int blocks>
void slab_product(const Weight& w, const Rows& rows, int64_t block, int64_t out,
                  float* totals, c10::BFloat16* y, __m512i table) {
  alignas(64) __m512i slab[kMaxGroup / 2 * kSlab];
  const int64_t m = rows.count, groups = w.in / w.group;
  std::fill(totals, totals + m * kSlab * kBlock, 0.0f);
  auto sums_at = [&](int64_t r) { return rows.sums ? rows.sums + r * groups : nullptr; };
  for (int64_t g = 0; g < groups; ++g) {
    make_slab<blocks>(w, block, g, table, slab);
    int64_t r = 0;
#if defined(OUTRIDER_AMX)
    if (blocks == kSlab && rows.tiles) {
      alignas(64) float sums[kSlab * kTileRows * kBlock];
      for (; r < m; r += kTileRows)
        multiply_tiles(w, rows.x + r * w.in, sums_at(r),
                       std::min<int64_t>(kTileRows, m - r), block, g, slab, sums,
                       totals + r * kSlab * kBlock);
    }
#endif
    for (; r + kRowTile <= m; r += kRowTile)
      multiply<kRowTile, blocks>(w, rows.x + r * w.in, sums_at(r), block, g, slab,
                                 totals + r * kSlab * kBlock);
    for (; r < m; ++r)
      multiply<1, blocks>(w, rows.x + r * w.in, sums_at(r), block, g, slab,
                          totals + r * kSlab * kBlock);
  }
  for (int64_t r = 0; r < m; ++r)
    for (int b = 0; b < blocks; ++b) {
      const __m256bh values =
          _mm512_cvtneps_pbh(_mm512_loadu_ps(totals + (r * kSlab + b) * kBlock));
      std::memcpy(y + r * out + (block + b) * kBlock, &values, sizeof(values));
    }
}

#if defined(OUTRIDER_AMX)
// x's rows for tile products: x itself where its rows fill whole tiles or one partial
// tile (the tiles are configured for its rows), else a copy padded with zero rows into
// `padded` (a tile load reads a tile's rows).
const c10::BFloat16* tile_rows(const at::Tensor& x, at::Tensor& padded) {
  const int64_t m = x.size(0);
  if (m % kTileRows == 0 || m < kTileRows) return x.data_ptr<c10::BFloat16>();
  padded = at::zeros({(m + kTileRows - 1) / kTileRows * kTileRows, x.size(1)}, x.options());
  padded.narrow(0, 0, m).copy_(x);
  return padded.data_ptr<c10::BFloat16>();
}
#endif

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const std::optional<at::Tensor>& scaled_zero, int64_t group) {
  check(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
        "x: [rows, in] bfloat16, contiguous");
  const int64_t m = x.size(0), in = x.size(1);
  check(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
            packed.size(1) * 4 == in && packed.size(2) == 32,
        "packed: [out / 16, in / 4, 32] uint8");
  check(group > 0 && group % 4 == 0 && group <= kMaxGroup && in % group == 0,
        "group: a multiple of 4 up to 256 that divides in");
  const int64_t blocks = packed.size(0), out = blocks * kBlock;
  auto per_group = [&](const at::Tensor& t) {
    return t.dim() == 3 && t.is_contiguous() && t.scalar_type() == at::kFloat &&
           t.size(0) == blocks && t.size(1) == in / group && t.size(2) == kBlock;
  };
  check(per_group(scale), "scale: [out / 16, in / group, 16] float32");
  check(!scaled_zero || per_group(*scaled_zero), "scaled_zero: like scale");
  const Weight w{packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                 scaled_zero ? scaled_zero->data_ptr<float>() : nullptr, in, group};
  at::Tensor y = at::empty({m, out}, x.options());
  at::Tensor padded, sums;
  Rows rows{x.data_ptr<c10::BFloat16>(), m, false, nullptr};
#if defined(OUTRIDER_AMX)
  // tiles from one row on: 1 x 5,632 x 1,024 takes 0.097 ms, 0.147 by vectors
  if (group % kTileDepth == 0 && amx_permitted()) rows = {tile_rows(x, padded), m, true, nullptr};
#endif
  if (scaled_zero) {  // once a call, not once a slab
    sums = x.view({m, in / group, group}).sum(-1, false, at::kFloat);  // [m, groups]
    rows.sums = sums.data_ptr<float>();
  }
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t slabs = (blocks + kSlab - 1) / kSlab;
  at::parallel_for(0, slabs, 1, [&](int64_t begin, int64_t end) {
#if defined(OUTRIDER_AMX)
    if (rows.tiles) configure_tiles(std::min<int64_t>(m, kTileRows));
#endif
    const __m512i table = level_table();
    std::vector<float> totals(m * kSlab * kBlock);
    for (int64_t s = begin; s < end; ++s) {
      if (s * kSlab + kSlab <= blocks) {
        slab_product<kSlab>(w, rows, s * kSlab, out, totals.data(), yp, table);
      } else {
        slab_product<1>(w, rows, s * kSlab, out, totals.data(), yp, table);
      }
    }
#if defined(OUTRIDER_AMX)
    if (rows.tiles) _tile_release();
#endif
  });
  return y;
}

}  // namespace
#endif

TORCH_LIBRARY_FRAGMENT(outrider_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor packed, Tensor scale, Tensor? scaled_zero, int group) -> Tensor");
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
TORCH_LIBRARY_IMPL(outrider_cpu, CPU, m) { m.impl("int4_gemm", &int4_gemm); }
#endif
