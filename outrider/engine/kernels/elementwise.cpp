// The decoder's elementwise steps for CPUs, each one pass over its rows in fp32 whatever
// the model's dtype (rounded once, at the end), rows spread over the intra-op threads:
// eager PyTorch runs each as several ops, every one a pass over memory, a temporary and a
// dispatch, and on one thread at these sizes.
//
//   rms_norm(x, weight, eps, residual?)  residual += x first (in place) when given;
//                                        returns weight * normalise(the sum, or x)
//   silu_mul(gate_up)                    [n, 2i] -> silu(gate) * up, [n, i]
//   rope_(x, cos, sin)                   x [n, heads, dim] rotated in place (the
//                                        rotate-half layout), cos/sin [n, 1, dim]
//   quantize_rows(x, static_scale?)      x [n, k] -> (int8 levels [n, k], fp32 scale
//                                        [n, 1]): x / scale rounded to even, clamped
//                                        to -128..127; scale: the row's largest
//                                        magnitude / 127.5 (dynamic), or static_scale
//   scale_rows(sums, scale, like)        fp32 sums [n, m] * scale [n, 1], in like's dtype

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
#include <type_traits>

namespace {

using outrider::lane_sum;
using outrider::load;
using outrider::reciprocal;
using outrider::rounded;
using outrider::splat;
using outrider::store;
using outrider::vb16;
using outrider::vexp;
using outrider::vf16;
using outrider::vi16;

// Values a parallel task takes, at least. A task is worth a thread only when its work
// outweighs the wait at the region's end, which waits for its slowest thread: serving,
// the router shares the target's cores (and a second OpenMP pool once put the threads to
// sleep between regions, §8.4). With 4 rows a task these
// kernels took a sixth of a served 16-stream decode step of a 140M-parameter model
// (hidden 1,024) where they compute well under a millisecond; with this many values a
// task the step went 35.5-35.8 -> 31.1-33.7 ms (docs/DESIGN.md §8.4).
constexpr int64_t kTaskValues = 1 << 16;
constexpr int64_t kLanes = 16;

// Rows per parallel task for rows of `width` values.
inline int64_t grain(int64_t width) {
  return std::max<int64_t>(1, kTaskValues / std::max<int64_t>(width, 1));
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "outrider elementwise: ", what); }

template <typename F>
void dispatch(const at::Tensor& x, F&& f) {
  outrider::dispatch(x.scalar_type(), "outrider elementwise", f);
}

// f(i, n) over [0, size) in vectors of n = 16 values, the last one shorter.
template <typename F>
inline void by_vectors(int64_t size, F&& f) {
  for (int64_t i = 0; i < size; i += kLanes) f(i, std::min(kLanes, size - i));
}

template <typename T>
inline vf16 load_at(const T* p, int64_t n) {
  return n == kLanes ? load(p) : outrider::load_n(p, n);
}

template <typename T>
inline void store_at(T* p, vf16 x, int64_t n) {
  if (n == kLanes) {
    store(p, x);
  } else {
    outrider::store_n(p, x, n);
  }
}

// Rows of x (and residual) by their stride; the last dimension contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& residual) {
  check(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous(), "x: [rows, hidden]");
  check(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1), "weight");
  check(!residual || (residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                      residual->scalar_type() == x.scalar_type()),
        "residual: like x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty({rows, hidden}, x.options());
  dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* rp = residual ? residual->data_ptr<T>() : nullptr;
    T* op = out.data_ptr<T>();
    const int64_t x_row = x.stride(0), r_row = residual ? residual->stride(0) : 0;
    at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * x_row;
        T* rr = rp ? rp + r * r_row : nullptr;
        vf16 squares{};
        by_vectors(hidden, [&](int64_t i, int64_t n) {
          vf16 value = load_at(xr + i, n);
          if (rr) {  // the residual stream is kept in the model's dtype: rounded as stored
            value = rounded<T>(load_at(rr + i, n) + value);
            store_at(rr + i, value, n);
          }
          squares += value * value;
        });
        const vf16 scale = splat(1.0f / std::sqrt(lane_sum(squares) / hidden +
                                                 static_cast<float>(eps)));
        const T* source = rr ? rr : xr;
        T* orow = op + r * hidden;
        by_vectors(hidden, [&](int64_t i, int64_t n) {
          // as the reference: normalised in fp32, rounded to the model's dtype, weighted
          store_at(orow + i, load_at(wp + i, n) * rounded<T>(load_at(source + i, n) * scale), n);
        });
      }
    });
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
        "gate_up: [rows, 2 * inner]");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inner}, gate_up.options());
  dispatch(gate_up, [&](auto zero) {
    using T = decltype(zero);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t row = gate_up.stride(0);
    at::parallel_for(0, rows, grain(inner), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = gp + r * row;
        T* orow = op + r * inner;
        by_vectors(inner, [&](int64_t i, int64_t n) {
          const vf16 g = load_at(gate + i, n);
          store_at(orow + i, g * reciprocal(1.0f + vexp(-g)) * load_at(gate + inner + i, n), n);
        });
      }
    });
  });
  return out;
}

void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  check(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x: [rows, heads, dim]");
  check(cos.dim() == 3 && cos.size(0) == x.size(0) && cos.size(2) == x.size(2) &&
            cos.stride(2) == 1 && sin.sizes() == cos.sizes() && sin.stride(2) == 1 &&
            cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
        "cos, sin: [rows, 1, dim] in x's dtype");
  const int64_t rows = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    T* xp = x.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    at::parallel_for(0, rows, grain(heads * half * 2), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* c = cp + r * cos.stride(0);
        const T* s = sp + r * sin.stride(0);
        for (int64_t h = 0; h < heads; ++h) {
          T* v = xp + r * x.stride(0) + h * x.stride(1);
          by_vectors(half, [&](int64_t i, int64_t n) {
            const vf16 a = load_at(v + i, n), b = load_at(v + half + i, n);
            store_at(v + i, a * load_at(c + i, n) - b * load_at(s + i, n), n);
            store_at(v + half + i, b * load_at(c + half + i, n) + a * load_at(s + half + i, n), n);
          });
        }
      }
    });
  });
}

// The same arithmetic as quant/weight.py's torch path, to the bit: the scale divides
// (no reciprocal), and levels round half to even as torch.round does (by adding and
// taking away 1.5 * 2^23, exact for the clamped range), 16 at a time.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x,
                                                 std::optional<double> static_scale) {
  check(x.dim() == 2 && x.stride(1) == 1, "x: [rows, features]");
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor levels = at::empty({rows, width}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    int8_t* lp = levels.data_ptr<int8_t>();
    float* sp = scales.data_ptr<float>();
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * x.stride(0);
        float scale = static_cast<float>(static_scale.value_or(0.0));
        if (!static_scale) {
          vf16 largest{};
          by_vectors(width, [&](int64_t i, int64_t n) {
            const vf16 v = load_at(xr + i, n);
            const vf16 magnitude = v < 0 ? -v : v;
            largest = largest > magnitude ? largest : magnitude;
          });
          scale = std::max(outrider::lane_max(largest), 1e-12f) / 127.5f;
        }
        sp[r] = scale;
        int8_t* lr = lp + r * width;
        const vf16 divisor = splat(scale), low = splat(-128.0f), high = splat(127.0f);
        const vf16 to_even = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to even
        by_vectors(width, [&](int64_t i, int64_t n) {
          vf16 level = load_at(xr + i, n) / divisor;
          // clamped first, then rounded: the same level as rounding first
          level = level < low ? low : (level > high ? high : level);
          level = (level + to_even) - to_even;
          const vb16 bytes = __builtin_convertvector(__builtin_convertvector(level, vi16), vb16);
          std::memcpy(lr + i, &bytes, n);
        });
      }
    });
  });
  return {levels, scales};
}

at::Tensor scale_rows(const at::Tensor& sums, const at::Tensor& scale, const at::Tensor& like) {
  check(sums.dim() == 2 && sums.is_contiguous() && sums.scalar_type() == at::kFloat,
        "sums: [rows, out] float32");
  check(scale.is_contiguous() && scale.numel() == sums.size(0) &&
            scale.scalar_type() == at::kFloat, "scale: [rows, 1] float32");
  const int64_t rows = sums.size(0), width = sums.size(1);
  at::Tensor out = at::empty({rows, width}, like.options());
  dispatch(like, [&](auto zero) {
    using T = decltype(zero);
    const float* in = sums.data_ptr<float>();
    const float* sp = scale.data_ptr<float>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const vf16 factor = splat(sp[r]);
        by_vectors(width, [&](int64_t i, int64_t n) {
          store_at(op + r * width + i, load_at(in + r * width + i, n) * factor, n);
        });
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(outrider_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("quantize_rows(Tensor x, float? static_scale) -> (Tensor, Tensor)");
  m.def("scale_rows(Tensor sums, Tensor scale, Tensor like) -> Tensor");
}

TORCH_LIBRARY_IMPL(outrider_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_", &rope_);
  m.impl("quantize_rows", &quantize_rows);
  m.impl("scale_rows", &scale_rows);
}
