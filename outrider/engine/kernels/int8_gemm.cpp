// x's int8 levels [rows, in] @ an int8 weight [out, in]^T (W8A8), by AMX tile products
// (TDPBSSD: 16 rows x 16 outputs x 64 inputs an instruction, summed in int32), for
// CPUs with AMX-INT8. oneDNN's int8 linear, which serves the other CPUs, took longer
// than the 4-bit kernel at every row count and about as long as the bfloat16 weights at
// 16-32 rows (docs/DESIGN.md §8.11).
//
//   int8_gemm(levels, row_scale, packed, weight_scale, like)
//     levels        [rows, in] int8, rows contiguous; in: a multiple of 64
//     row_scale     [rows, 1] float32: each row's input scale
//     packed        [out / 16, in / 4, 64] int8 (int8_layout in quant/weight.py): for
//                   16 outputs and 4 inputs, byte 4 j + i is output j's weight at input i
//     weight_scale  [out] float32
//     like          a tensor in the output's dtype (float32 or bfloat16: vec.h's dispatch)
//   -> [rows, out]: float(integer sum) * weight_scale, then * row_scale, rounded once
//      to the dtype: oneDNN's int8 linear then scale_rows, in the same order

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include "amx.h"
#include "vec.h"

namespace {

using outrider::configure_tiles;
using outrider::kTileBytes;
using outrider::kTileRows;
using outrider::vf16;
using outrider::vi16;

constexpr int kBlock = 16;               // outputs a tile's row holds (int32 sums)
constexpr int kSlab = 2;                 // blocks a task's slab holds: 32 outputs
constexpr int kDepth = kTileBytes;       // inputs a tile product sums: 64 int8

void check(bool ok, const char* what) { TORCH_CHECK(ok, "outrider int8_gemm: ", what); }

struct Product {
  const int8_t* levels;      // [rows, in]
  const float* row_scale;    // [rows]
  const int8_t* packed;      // [out / 16, in / 4, 64]
  const float* weight_scale; // [out]
  int64_t rows, in, out;
};

// y[r, 16 * block ...] = float(tile sums) * weight scale * row scale, rows first + i
// for i in [skip, tile_rows) of a tile whose sums were stored in `sums`.
template <typename T>
void scale_out(const Product& p, const int32_t (*sums)[kTileRows][kBlock], int64_t block,
               int blocks, int64_t first, int64_t skip, int64_t tile_rows, T* y) {
  for (int b = 0; b < blocks; ++b) {
    const vf16 weight_scale = outrider::load(p.weight_scale + (block + b) * kBlock);
    for (int64_t i = skip; i < tile_rows; ++i) {
      vi16 sum;
      std::memcpy(&sum, sums[b][i], sizeof(sum));
      const vf16 value = __builtin_convertvector(sum, vf16) * weight_scale;
      outrider::store(y + (first + i) * p.out + (block + b) * kBlock,
                      value * outrider::splat(p.row_scale[first + i]));
    }
  }
}

// Outputs 16 * block ... of every row: the slab's weights are read once from memory and
// then from cache for each tile of rows. A last tile that the rows do not fill starts
// 16 rows from the end (rows are independent: its repeated rows' sums are the same) so
// that no load reads past x and no tile is configured twice.
template <typename T>
void slab_product(const Product& p, int64_t block, int blocks, T* y) {
  alignas(64) int32_t sums[kSlab][kTileRows][kBlock];
  const int64_t tile_rows = std::min<int64_t>(p.rows, kTileRows);
  const int64_t block_bytes = p.in * kBlock;  // one block's packed weights
  const int8_t* weights = p.packed + block * block_bytes;
  for (int64_t r = 0; r < p.rows; r += kTileRows) {
    const int64_t first = std::min(r, p.rows - tile_rows);
    const int8_t* x = p.levels + first * p.in;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < p.in; k += kDepth) {
      _tile_loadd(2, x + k, p.in);
      _tile_loadd(3, weights + k * kBlock, kTileBytes);
      _tile_dpbssd(0, 2, 3);
      if (blocks == kSlab) {
        _tile_loadd(4, weights + block_bytes + k * kBlock, kTileBytes);
        _tile_dpbssd(1, 2, 4);
      }
    }
    _tile_stored(0, sums[0], kBlock * sizeof(int32_t));
    if (blocks == kSlab) _tile_stored(1, sums[1], kBlock * sizeof(int32_t));
    scale_out(p, sums, block, blocks, first, r - first, tile_rows, y);
  }
}

at::Tensor int8_gemm(const at::Tensor& levels, const at::Tensor& row_scale,
                     const at::Tensor& packed, const at::Tensor& weight_scale,
                     const at::Tensor& like) {
  check(levels.dim() == 2 && levels.is_contiguous() && levels.scalar_type() == at::kChar &&
            levels.size(1) % kDepth == 0,
        "levels: [rows, in] int8, contiguous, in a multiple of 64");
  const int64_t m = levels.size(0), in = levels.size(1);
  check(row_scale.is_contiguous() && row_scale.numel() == m &&
            row_scale.scalar_type() == at::kFloat, "row_scale: [rows, 1] float32");
  check(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
            packed.size(1) * 4 == in && packed.size(2) == kTileBytes,
        "packed: [out / 16, in / 4, 64] int8");
  const int64_t blocks = packed.size(0), out = blocks * kBlock;
  check(weight_scale.is_contiguous() && weight_scale.numel() == out &&
            weight_scale.scalar_type() == at::kFloat, "weight_scale: [out] float32");
  check(outrider::amx_permitted(), "AMX tiles not permitted by the kernel");
  const Product p{levels.data_ptr<int8_t>(), row_scale.data_ptr<float>(),
                  packed.data_ptr<int8_t>(), weight_scale.data_ptr<float>(), m, in, out};
  at::Tensor y = at::empty({m, out}, like.options());
  if (m == 0) return y;  // (tiles of no rows are not a configuration)
  const int64_t slabs = (blocks + kSlab - 1) / kSlab;
  outrider::dispatch(like.scalar_type(), "outrider int8_gemm: like", [&](auto zero) {
    using T = decltype(zero);
    T* out_rows = y.data_ptr<T>();
    at::parallel_for(0, slabs, 1, [&](int64_t begin, int64_t end) {
      configure_tiles(std::min<int64_t>(m, kTileRows));
      for (int64_t s = begin; s < end; ++s) {
        const int blocks_here = static_cast<int>(std::min<int64_t>(kSlab, blocks - s * kSlab));
        slab_product(p, s * kSlab, blocks_here, out_rows);
      }
      _tile_release();
    });
  });
  return y;
}

}  // namespace
#endif

TORCH_LIBRARY_FRAGMENT(outrider_cpu, m) {
  m.def("int8_gemm(Tensor levels, Tensor row_scale, Tensor packed, Tensor weight_scale, "
        "Tensor like) -> Tensor");
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
TORCH_LIBRARY_IMPL(outrider_cpu, CPU, m) { m.impl("int8_gemm", &int8_gemm); }
#endif
