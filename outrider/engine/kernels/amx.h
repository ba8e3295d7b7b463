// AMX tile products, for the GEMMs of this folder (int4_gemm.cpp, int8_gemm.cpp): one
// tile configuration both use, and Linux's permission to use the tiles at all.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace outrider {

constexpr int kTileRows = 16;   // rows of x a tile product takes, at most
constexpr int kTileBytes = 64;  // bytes a tile row holds

// Linux lends a process AMX's tile registers only once asked (oneDNN asks too).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// Tiles 0-1: sums for two blocks of 16 outputs, [rows, 16] 32-bit; 2: x, [rows, 64
// bytes] (rows: 1 to 16); 3-4: the two blocks' weights, 16 rows of 64 bytes (4 bytes an
// output: a pair of bfloat16 inputs, or four int8 ones).
inline void configure_tiles(int64_t rows) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_a_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 5; ++t) {
    config.bytes_a_row[t] = kTileBytes;
    config.rows[t] = t < 3 ? rows : kTileRows;
  }
  _tile_loadconfig(&config);
}

}  // namespace outrider
#endif  // __AMX_TILE__
