// 16 floats as one vector, for the kernels of this folder: one AVX-512 register (two
// AVX2 ones, four NEON ones). GCC/Clang vector extensions: the compiler emits the
// machine's own instructions, no intrinsics. Loads and stores convert from and to the
// tensors' dtype (float32, or bfloat16 rounded to nearest even).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace outrider {

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef int8_t vb16 __attribute__((vector_size(16)));

inline vf16 splat(float x) { return vf16{} + x; }

// f(T{}) for T the C++ type of `dtype`: the two dtypes load and store convert (`op`
// names the caller in the error for any other).
template <typename F>
inline void dispatch(c10::ScalarType dtype, const char* op, F&& f) {
  if (dtype == c10::ScalarType::Float) {
    f(float{});
  } else if (dtype == c10::ScalarType::BFloat16) {
    f(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 only");
  }
}

template <typename T>
inline vf16 load(const T* p) {  // 16 values from p (unaligned) as floats
  if constexpr (std::is_same_v<T, float>) {
    vf16 x;
    std::memcpy(&x, p, sizeof(x));
    return x;
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    vh16 half;
    std::memcpy(&half, p, sizeof(half));
    const vu16 bits = __builtin_convertvector(half, vu16) << 16;
    vf16 x;
    std::memcpy(&x, &bits, sizeof(x));
    return x;
  }
}

// The bits of x rounded to bfloat16's 8-bit mantissa, to nearest even (x finite), in
// the high half of each lane.
inline vu16 bf16_bits(vf16 x) {
  vu16 bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
}

// x as T would store it, back in floats: rounded to bfloat16 for it, unchanged for float.
template <typename T>
inline vf16 rounded(vf16 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    const vu16 bits = bf16_bits(x);
    vf16 y;
    std::memcpy(&y, &bits, sizeof(y));
    return y;
  }
}

template <typename T>
inline void store(T* p, vf16 x) {  // 16 floats to p (unaligned) in T
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &x, sizeof(x));
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    const vh16 half = __builtin_convertvector(bf16_bits(x) >> 16, vh16);
    std::memcpy(p, &half, sizeof(half));
  }
}

// 1 / x: a vector division is the slowest arithmetic there is (16 cycles a vector on
// AVX-512), so where the CPU has its 14-bit estimate, that and one Newton step (~1e-7).
inline vf16 reciprocal(vf16 x) {
#if defined(__AVX512F__)
  const vf16 estimate = (vf16)_mm512_rcp14_ps((__m512)x);
  return estimate * (2.0f - x * estimate);
#else
  return 1.0f / x;
#endif
}

// The first n (< 16) values only: the rest of the vector is zero, nothing past p+n is
// read or written.
template <typename T>
inline vf16 load_n(const T* p, int64_t n) {
  T buffer[16] = {};
  std::memcpy(buffer, p, n * sizeof(T));
  return load(buffer);
}

template <typename T>
inline void store_n(T* p, vf16 x, int64_t n) {
  T buffer[16];
  store(buffer, x);
  std::memcpy(p, buffer, n * sizeof(T));
}

// exp(x), lane by lane: 2^n from the exponent bits times a degree-6 polynomial of the
// remainder in [-ln2/2, ln2/2] (relative error ~2e-7); x is clamped to [-87, 88].
inline vf16 vexp(vf16 x) {
  const vf16 lo = splat(-87.0f), hi = splat(88.0f), round = splat(12582912.0f);  // 1.5 * 2^23
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf16 n = (x * 1.44269504088896341f + round) - round;  // nearest integer
  const vf16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  vf16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// x with its two halves, quarters, ... swapped (a butterfly step of a reduction)
template <int kHalf>
inline vf16 swap_lanes(vf16 x) {
  vi16 index;
  for (int i = 0; i < 16; ++i) index[i] = i ^ kHalf;
#if defined(__clang__)
  vf16 y;
  for (int i = 0; i < 16; ++i) y[i] = x[index[i]];
  return y;
#else
  return __builtin_shuffle(x, index);
#endif
}

inline float lane_max(vf16 x) {
  auto max = [](vf16 a, vf16 b) { return a > b ? a : b; };
  x = max(x, swap_lanes<8>(x));
  x = max(x, swap_lanes<4>(x));
  x = max(x, swap_lanes<2>(x));
  return x[0] > x[1] ? x[0] : x[1];
}

inline float lane_sum(vf16 x) {
  x += swap_lanes<8>(x);
  x += swap_lanes<4>(x);
  x += swap_lanes<2>(x);
  return x[0] + x[1];
}

}  // namespace outrider
