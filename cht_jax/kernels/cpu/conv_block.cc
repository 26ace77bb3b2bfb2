// The generated CNN's block, conv -> ReLU -> 2x2 max-pool -> BatchNorm, fused
// for XLA:CPU (XLA FFI); built by library.py, called by conv_block.py.
//
// Layouts (row-major, leading batch dimensions B... on every operand):
//   x       [B..., N, H, W, Ci]     f32  input
//   kernel  [B..., K, K, Ci, Co]    f32  odd K, stride 1, 'SAME' zero padding
//   scale, bias [B..., Co]          f32  the norm's; attribute epsilon
//   pooled  [B..., N, H/2, W/2, Co] f32  max-pool(relu(conv(x, kernel)))
//   y       [B..., N, H/2, W/2, Co] f32  pooled normalised over N, H/2, W/2
// ChtConvBlockNormForward: x, kernel, scale, bias -> y.
// ChtConvBlockNormTrainForward: -> y, pooled, arg [B..., N, H/2, W/2, Co] s8
//   (the winning pooled position a * 2 + b, or -1 where pooled == 0), mean and
//   inv = 1/sqrt(var + eps) [B..., Co].
// ChtConvBlockNormBackward: those and dy -> dx, dkernel, dscale, dbias; the
// gradient goes to the first maximum of each window.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shape {
  int64_t batch, n, h, w, ci, co, k;
  int64_t hp() const { return h / 2; }
  int64_t wp() const { return w / 2; }
  // Elements of x, kernel and y (and arg) per batch element.
  int64_t x_size() const { return n * h * w * ci; }
  int64_t k_size() const { return k * k * ci * co; }
  int64_t y_size() const { return n * hp() * wp() * co; }
};

ffi::Error GetShape(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& kernel,
                    Shape* s) {
  auto xd = x.dimensions();
  auto kd = kernel.dimensions();
  if (xd.size() < 4 || kd.size() != xd.size()) {
    return ffi::Error::InvalidArgument(
        "fused_cpu: x must be [B..., N, H, W, Ci] and kernel [B..., K, K, Ci, Co] "
        "with the same leading dimensions");
  }
  size_t r = xd.size();
  s->batch = 1;
  for (size_t i = 0; i + 4 < r; ++i) {
    if (xd[i] != kd[i]) return ffi::Error::InvalidArgument("fused_cpu: batch mismatch");
    s->batch *= xd[i];
  }
  s->n = xd[r - 4], s->h = xd[r - 3], s->w = xd[r - 2], s->ci = xd[r - 1];
  s->k = kd[r - 4], s->co = kd[r - 1];
  if (kd[r - 3] != s->k || s->k % 2 != 1 || kd[r - 2] != s->ci) {
    return ffi::Error::InvalidArgument(
        "fused_cpu: kernel must be [K, K, Ci, Co] with odd K and x's Ci");
  }
  return ffi::Error::Success();
}

// Eight output channels per vector (GCC/Clang vector extensions, AVX2 or AVX-512).
typedef float v8 __attribute__((vector_size(32)));

inline v8 Load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }
inline v8 Splat(float f) { return v8{f, f, f, f, f, f, f, f}; }
inline float Sum(v8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// One image zero-padded by `pad` on both spatial sides, so loops need no bounds checks.
void PadImage(const float* image, int64_t h, int64_t w, int64_t c, int64_t pad,
              std::vector<float>* padded) {
  const int64_t wp = w + 2 * pad;
  padded->assign((h + 2 * pad) * wp * c, 0.0f);
  for (int64_t r = 0; r < h; ++r) {
    std::memcpy(padded->data() + ((r + pad) * wp + pad) * c, image + r * w * c,
                sizeof(float) * w * c);
  }
}

// The pooling windows (i, j) .. (i, j + J - 1) of image n: their 4 J conv
// outputs at once, as 4 J independent multiply-add chains for the FMA units.
template <int NV, int CI, int J>
inline void ForwardWindows(const Shape& s, const float* padded, const float* kernel, int64_t n,
                           int64_t i, int64_t j, float* y, int8_t* arg) {
  constexpr int64_t co = 8 * NV;
  const int64_t ci_n = CI > 0 ? CI : s.ci, k = s.k, w_padded = s.w + 2 * (s.k / 2);
  v8 acc[J][4][NV];
  for (int c = 0; c < J; ++c)
    for (int pos = 0; pos < 4; ++pos)
      for (int v = 0; v < NV; ++v) acc[c][pos][v] = Splat(0.0f);
  for (int64_t di = 0; di < k; ++di) {
    for (int64_t dj = 0; dj < k; ++dj) {
      const float* xp = padded + ((2 * i + di) * w_padded + 2 * j + dj) * ci_n;
      const float* kp = kernel + (di * k + dj) * ci_n * co;
      for (int64_t ci = 0; ci < ci_n; ++ci) {
        for (int v = 0; v < NV; ++v) {
          const v8 kv = Load(kp + ci * co + 8 * v);
          for (int c = 0; c < J; ++c) {
            for (int pos = 0; pos < 4; ++pos) {
              acc[c][pos][v] +=
                  Splat(xp[((pos / 2) * w_padded + 2 * c + pos % 2) * ci_n + ci]) * kv;
            }
          }
        }
      }
    }
  }
  // relu(max) == max(relu): start at 0 with no winner (-1); the first maximum wins.
  for (int c = 0; c < J; ++c) {
    const int64_t o = ((n * s.hp() + i) * s.wp() + j + c) * co;
    for (int v = 0; v < NV; ++v) {
      v8 best = Splat(0.0f), best_at = Splat(-1.0f);
      for (int pos = 0; pos < 4; ++pos) {
        auto won = acc[c][pos][v] > best;
        best = won ? acc[c][pos][v] : best;
        best_at = won ? Splat(static_cast<float>(pos)) : best_at;
      }
      Store(y + o + 8 * v, best);
      if (arg == nullptr) continue;  // Forward only: no winners kept.
      for (int lane = 0; lane < 8; ++lane) {
        arg[o + 8 * v + lane] = static_cast<int8_t>(best_at[lane]);
      }
    }
  }
}

// NV = C_out / 8 vectors of output channels; CI = C_in, or 0 to read it from
// the shape: compile-time constants unroll the loops into registers. Not
// inlined: inlined, GCC allocates the accumulators worse.
template <int NV, int CI>
__attribute__((noinline)) void Forward(const Shape& s, const float* x, const float* kernel,
                                       float* y, int8_t* arg) {
  // Two windows at a time where their 8 NV accumulators fit in the registers.
  constexpr int kColumns = NV <= 2 ? 2 : 1;
  const int64_t ci_n = CI > 0 ? CI : s.ci, pad = s.k / 2;
  std::vector<float> padded;
  for (int64_t n = 0; n < s.n; ++n) {
    PadImage(x + n * s.h * s.w * ci_n, s.h, s.w, ci_n, pad, &padded);
    for (int64_t i = 0; i < s.hp(); ++i) {
      int64_t j = 0;
      for (; j + kColumns <= s.wp(); j += kColumns) {
        ForwardWindows<NV, CI, kColumns>(s, padded.data(), kernel, n, i, j, y, arg);
      }
      for (; j < s.wp(); ++j) {
        ForwardWindows<NV, CI, 1>(s, padded.data(), kernel, n, i, j, y, arg);
      }
    }
  }
}

// The BatchNorm on y [rows, 8 NV] (rows = N * H/2 * W/2): cnn.batch_stat_norm.
// Sums over the rows of value(r, v), 8 columns, per vector v; 4 partial sums.
template <int NV, typename Fn>
inline void ColumnSums(int64_t rows, Fn value, v8* sums) {
  v8 part[4][NV];
  for (int p = 0; p < 4; ++p)
    for (int v = 0; v < NV; ++v) part[p][v] = Splat(0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int v = 0; v < NV; ++v) part[r % 4][v] += value(r, v);
  for (int v = 0; v < NV; ++v) sums[v] = (part[0][v] + part[1][v]) + (part[2][v] + part[3][v]);
}

template <int NV>
void BatchStats(int64_t rows, const float* y, float epsilon, v8* mean, v8* inv) {
  constexpr int64_t co = 8 * NV;
  ColumnSums<NV>(rows, [&](int64_t r, int v) { return Load(y + r * co + 8 * v); }, mean);
  for (int v = 0; v < NV; ++v) mean[v] /= Splat(float(rows));
  v8 var[NV];
  ColumnSums<NV>(rows, [&](int64_t r, int v) {
    const v8 d = Load(y + r * co + 8 * v) - mean[v];
    return d * d;
  }, var);
  for (int v = 0; v < NV; ++v)
    for (int lane = 0; lane < 8; ++lane)
      inv[v][lane] = 1.0f / std::sqrt(var[v][lane] / float(rows) + epsilon);
}

// out = (y - mean) * inv * scale + bias; out may be y.
template <int NV>
void Normalize(int64_t rows, const float* y, const v8* mean, const v8* inv, const float* scale,
               const float* bias, float* out) {
  constexpr int64_t co = 8 * NV;
  v8 multiplier[NV], offset[NV];
  for (int v = 0; v < NV; ++v) {
    multiplier[v] = inv[v] * Load(scale + 8 * v);
    offset[v] = Load(bias + 8 * v);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int v = 0; v < NV; ++v)
      Store(out + r * co + 8 * v, (Load(y + r * co + 8 * v) - mean[v]) * multiplier[v] + offset[v]);
}

// The norm's backward: d_out -> d_y, dscale = sum d_out * xhat, dbias = sum
// d_out, with xhat = (y - mean) * inv and M = rows:
// d_y = scale * inv / M * (M d_out - dbias - xhat dscale).
template <int NV>
void NormalizeBackward(int64_t rows, const float* y, const v8* mean, const v8* inv,
                       const float* scale, const float* d_out, float* d_y, float* dscale,
                       float* dbias) {
  constexpr int64_t co = 8 * NV;
  auto xhat = [&](int64_t r, int v) { return (Load(y + r * co + 8 * v) - mean[v]) * inv[v]; };
  v8 sum_d[NV], sum_d_xhat[NV];
  ColumnSums<NV>(rows, [&](int64_t r, int v) { return Load(d_out + r * co + 8 * v); }, sum_d);
  ColumnSums<NV>(rows, [&](int64_t r, int v) {
    return Load(d_out + r * co + 8 * v) * xhat(r, v);
  }, sum_d_xhat);
  const v8 m = Splat(float(rows));
  v8 factor[NV];
  for (int v = 0; v < NV; ++v) {
    Store(dbias + 8 * v, sum_d[v]);
    Store(dscale + 8 * v, sum_d_xhat[v]);
    factor[v] = Load(scale + 8 * v) * inv[v] / m;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int v = 0; v < NV; ++v)
      Store(d_y + r * co + 8 * v,
            factor[v] * (m * Load(d_out + r * co + 8 * v) - sum_d[v] - xhat(r, v) * sum_d_xhat[v]));
}

template <int NV, int CI>
void Backward(const Shape& s, const float* x, const float* kernel, const int8_t* arg,
              const float* dy, float* dx, float* dkernel) {
  constexpr int64_t co = 8 * NV;
  const int64_t ci_n = CI > 0 ? CI : s.ci, k = s.k, pad = s.k / 2, taps = k * k;
  const int64_t hp = s.hp(), wp = s.wp(), h_padded = s.h + 2 * pad, w_padded = s.w + 2 * pad;
  std::memset(dkernel, 0, sizeof(float) * taps * ci_n * co);
  // The kernel as [tap, C_out, C_in], for dx as vectors along C_in.
  const bool vector_dx = ci_n % 8 == 0;
  std::vector<float> kernel_t(vector_dx ? taps * co * ci_n : 0);
  if (vector_dx) {
    for (int64_t t = 0; t < taps; ++t)
      for (int64_t ci = 0; ci < ci_n; ++ci)
        for (int64_t c = 0; c < co; ++c)
          kernel_t[(t * co + c) * ci_n + ci] = kernel[(t * ci_n + ci) * co + c];
  }
  // dkernel's (tap, C_in) rows, F at a time (F sums in registers); each row's
  // offset in the padded input from the conv output's position. The last group repeats row 0.
  constexpr int F = 16 / NV;
  const int64_t rows = taps * ci_n, groups = (rows + F - 1) / F;
  std::vector<int64_t> row_offset(groups * F, 0);
  for (int64_t f = 0; f < rows; ++f) {
    const int64_t t = f / ci_n, ci = f % ci_n;
    row_offset[f] = ((t / k) * w_padded + t % k) * ci_n + ci;
  }
  std::vector<float> padded, grad;
  for (int64_t n = 0; n < s.n; ++n) {
    PadImage(x + n * s.h * s.w * ci_n, s.h, s.w, ci_n, pad, &padded);
    // The conv output's gradient, zero-padded like the input: dy at each window's
    // winner, else 0; 4 columns of slack for the dx loop's last group.
    grad.assign((h_padded * w_padded + 4) * co, 0.0f);
    for (int64_t i = 0; i < hp; ++i) {
      for (int64_t j = 0; j < wp; ++j) {
        const int64_t o = ((n * hp + i) * wp + j) * co;
        for (int64_t c = 0; c < co; ++c) {
          const int8_t pos = arg[o + c];
          if (pos < 0) continue;
          grad[((2 * i + pos / 2 + pad) * w_padded + 2 * j + pos % 2 + pad) * co + c] = dy[o + c];
        }
      }
    }
    // dkernel[tap, ci] += padded[r + di, c + dj, ci] * grad[r, c] over the
    // conv outputs (r, c) that a pooling window covers.
    for (int64_t group = 0; group < groups; ++group) {
      const int64_t* offset = row_offset.data() + group * F;
      v8 sum[F][NV];
      for (int f = 0; f < F; ++f)
        for (int v = 0; v < NV; ++v) sum[f][v] = Splat(0.0f);
      for (int64_t r = 0; r < 2 * hp; ++r) {
        for (int64_t c = 0; c < 2 * wp; ++c) {
          const float* gp = grad.data() + ((r + pad) * w_padded + c + pad) * co;
          const float* xp = padded.data() + (r * w_padded + c) * ci_n;
          for (int v = 0; v < NV; ++v) {
            const v8 gv = Load(gp + 8 * v);
            for (int f = 0; f < F; ++f) sum[f][v] += Splat(xp[offset[f]]) * gv;
          }
        }
      }
      for (int f = 0; f < F && group * F + f < rows; ++f) {
        float* dkp = dkernel + (group * F + f) * co;
        for (int v = 0; v < NV; ++v) Store(dkp + 8 * v, Load(dkp + 8 * v) + sum[f][v]);
      }
    }
    // dx[r, c] = sum over taps of grad[r - di + pad, c - dj + pad] . kernel[tap]^T
    // (grad's padded [r - di + 2 pad, c - dj + 2 pad]), 4 columns at a time.
    float* dxn = dx + n * s.h * s.w * ci_n;
    for (int64_t r = 0; r < s.h; ++r) {
      for (int64_t c0 = 0; c0 < s.w; c0 += 4) {
        const int64_t cols = s.w - c0 < 4 ? s.w - c0 : 4;
        for (int64_t cv = 0; cv < ci_n; cv += vector_dx ? 8 : 1) {
          v8 sum[4] = {Splat(0.0f), Splat(0.0f), Splat(0.0f), Splat(0.0f)};
          for (int64_t t = 0; t < taps; ++t) {
            const float* gp =
                grad.data() + ((r - t / k + 2 * pad) * w_padded + c0 - t % k + 2 * pad) * co;
            if (vector_dx) {
              const float* ktp = kernel_t.data() + t * co * ci_n + cv;
              for (int64_t o = 0; o < co; ++o) {
                const v8 kv = Load(ktp + o * ci_n);
                for (int col = 0; col < 4; ++col) sum[col] += Splat(gp[col * co + o]) * kv;
              }
            } else {
              const float* kp = kernel + (t * ci_n + cv) * co;
              for (int v = 0; v < NV; ++v) {
                const v8 kv = Load(kp + 8 * v);
                for (int col = 0; col < 4; ++col) sum[col] += Load(gp + col * co + 8 * v) * kv;
              }
            }
          }
          for (int col = 0; col < cols; ++col) {
            float* dxp = dxn + (r * s.w + c0 + col) * ci_n + cv;
            if (vector_dx) Store(dxp, sum[col]);
            else *dxp = Sum(sum[col]);
          }
        }
      }
    }
  }
}

// Calls fn(NV, CI) with compile-time C_out / 8, and C_in if 1 or 8, else 0 (run time).
template <typename Fn>
ffi::Error Dispatch(int64_t ci, int64_t co, Fn&& fn) {
  auto with_ci = [&](auto nv) {
    if (ci == 1) fn(nv, std::integral_constant<int, 1>());
    else if (ci == 8) fn(nv, std::integral_constant<int, 8>());
    else fn(nv, std::integral_constant<int, 0>());
  };
  switch (co) {
    case 8: with_ci(std::integral_constant<int, 1>()); break;
    case 16: with_ci(std::integral_constant<int, 2>()); break;
    case 32: with_ci(std::integral_constant<int, 4>()); break;
    case 64: with_ci(std::integral_constant<int, 8>()); break;
    default:
      return ffi::Error::InvalidArgument(
          "fused_cpu: C_out must be 8, 16, 32 or 64 (use conv_impl=patches)");
  }
  return ffi::Error::Success();
}

ffi::Error CheckNormShapes(const Shape& s, const ffi::Buffer<ffi::F32>& scale,
                           const ffi::Buffer<ffi::F32>& bias) {
  if (scale.element_count() != s.batch * s.co || bias.element_count() != s.batch * s.co) {
    return ffi::Error::InvalidArgument("fused_cpu: scale and bias must be [B..., Co]");
  }
  return ffi::Error::Success();
}

// One batch element's block (pooled) and norm (y). Forward only, arg, mean_out
// and inv_out are null and pooled is y (normalised in place).
template <int NV, int CI>
void BlockNormForward(const Shape& s, const float* x, const float* kernel, const float* scale,
                      const float* bias, float epsilon, float* pooled, float* y, int8_t* arg,
                      float* mean_out, float* inv_out) {
  Forward<NV, CI>(s, x, kernel, pooled, arg);
  const int64_t rows = s.y_size() / s.co;
  v8 mean[NV], inv[NV];
  BatchStats<NV>(rows, pooled, epsilon, mean, inv);
  Normalize<NV>(rows, pooled, mean, inv, scale, bias, y);
  if (mean_out == nullptr) return;
  for (int v = 0; v < NV; ++v) {
    Store(mean_out + 8 * v, mean[v]);
    Store(inv_out + 8 * v, inv[v]);
  }
}

// Forward only: no winners or statistics kept.
ffi::Error NormForwardImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> kernel,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias,
                           float epsilon, ffi::ResultBuffer<ffi::F32> y) {
  Shape s;
  if (auto e = GetShape(x, kernel, &s); e.failure()) return e;
  if (auto e = CheckNormShapes(s, scale, bias); e.failure()) return e;
  return Dispatch(s.ci, s.co, [&](auto nv, auto ci) {
    for (int64_t b = 0; b < s.batch; ++b) {
      float* yb = y->typed_data() + b * s.y_size();
      BlockNormForward<decltype(nv)::value, decltype(ci)::value>(
          s, x.typed_data() + b * s.x_size(), kernel.typed_data() + b * s.k_size(),
          scale.typed_data() + b * s.co, bias.typed_data() + b * s.co, epsilon, yb, yb,
          nullptr, nullptr, nullptr);
    }
  });
}

// For training: also what the backward pass needs (pooled, winners, mean, inv).
ffi::Error NormTrainForwardImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> kernel,
                                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias,
                                float epsilon, ffi::ResultBuffer<ffi::F32> y,
                                ffi::ResultBuffer<ffi::F32> pooled,
                                ffi::ResultBuffer<ffi::S8> arg,
                                ffi::ResultBuffer<ffi::F32> mean_out,
                                ffi::ResultBuffer<ffi::F32> inv_out) {
  Shape s;
  if (auto e = GetShape(x, kernel, &s); e.failure()) return e;
  if (auto e = CheckNormShapes(s, scale, bias); e.failure()) return e;
  return Dispatch(s.ci, s.co, [&](auto nv, auto ci) {
    for (int64_t b = 0; b < s.batch; ++b) {
      BlockNormForward<decltype(nv)::value, decltype(ci)::value>(
          s, x.typed_data() + b * s.x_size(), kernel.typed_data() + b * s.k_size(),
          scale.typed_data() + b * s.co, bias.typed_data() + b * s.co, epsilon,
          pooled->typed_data() + b * s.y_size(), y->typed_data() + b * s.y_size(),
          arg->typed_data() + b * s.y_size(), mean_out->typed_data() + b * s.co,
          inv_out->typed_data() + b * s.co);
    }
  });
}

ffi::Error NormBackwardImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> kernel,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> pooled,
                            ffi::Buffer<ffi::S8> arg, ffi::Buffer<ffi::F32> mean_in,
                            ffi::Buffer<ffi::F32> inv_in, ffi::Buffer<ffi::F32> dy,
                            ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dkernel,
                            ffi::ResultBuffer<ffi::F32> dscale,
                            ffi::ResultBuffer<ffi::F32> dbias) {
  Shape s;
  if (auto e = GetShape(x, kernel, &s); e.failure()) return e;
  if (auto e = CheckNormShapes(s, scale, scale); e.failure()) return e;
  return Dispatch(s.ci, s.co, [&](auto nv, auto ci) {
    constexpr int NV = decltype(nv)::value;
    const int64_t rows = s.y_size() / s.co;
    std::vector<float> d_pooled(s.y_size());
    for (int64_t b = 0; b < s.batch; ++b) {
      v8 mean[NV], inv[NV];
      for (int v = 0; v < NV; ++v) {
        mean[v] = Load(mean_in.typed_data() + b * s.co + 8 * v);
        inv[v] = Load(inv_in.typed_data() + b * s.co + 8 * v);
      }
      NormalizeBackward<NV>(rows, pooled.typed_data() + b * s.y_size(), mean, inv,
                            scale.typed_data() + b * s.co, dy.typed_data() + b * s.y_size(),
                            d_pooled.data(), dscale->typed_data() + b * s.co,
                            dbias->typed_data() + b * s.co);
      Backward<NV, decltype(ci)::value>(
          s, x.typed_data() + b * s.x_size(), kernel.typed_data() + b * s.k_size(),
          arg.typed_data() + b * s.y_size(), d_pooled.data(),
          dx->typed_data() + b * s.x_size(), dkernel->typed_data() + b * s.k_size());
    }
  });
}

}  // namespace

// The operands in the order of the Impl functions' parameters above.
using F32 = ffi::Buffer<ffi::F32>;
using S8 = ffi::Buffer<ffi::S8>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChtConvBlockNormForward, NormForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Attr<float>("epsilon")
                                  .Ret<F32>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChtConvBlockNormTrainForward, NormTrainForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Attr<float>("epsilon")
                                  .Ret<F32>().Ret<F32>().Ret<S8>().Ret<F32>().Ret<F32>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChtConvBlockNormBackward, NormBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Arg<S8>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Ret<F32>().Ret<F32>().Ret<F32>().Ret<F32>());
