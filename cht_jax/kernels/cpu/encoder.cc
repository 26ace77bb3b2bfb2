// The HyperTransformer's encoder (transformer.Encoder), forward only, as one
// XLA:CPU call per stack of layers (XLA FFI); built by library.py, called by
// encoder.py. Rows are split between the caller and a helper (threads.h).
//
// Math (post-LayerNorm, as transformer.py):
//   x = LN(x + (softmax(q_h k_h^T / sqrt(d)) v_h)_h Wo + bo)
//   x = LN(x + act(x Wi + bi) Wf + bf)
// Operands, row-major: tokens [B..., L, E] (the output alike), then 16 per
// layer: query, key, value, output (kernel [in, out], bias [out] each),
// attention_norm (scale, bias [E]), ffn_inner, ffn_output, ffn_norm. A
// parameter with size-1 leading dimensions is shared across the batch.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kParamsPerLayer = 16;
constexpr float kLayerNormEpsilon = 1e-6f;  // transformer.LAYER_NORM_EPSILON
enum Activation { kRelu = 0, kGelu = 1, kLeakyRelu = 2 };

// C[M, N] = A[M, K] B[K, N] (+ bias[N]); leading dimensions lda, ldb, ldc.
#if defined(__AVX512F__)
// Register block of MR rows x NV vectors of 16 columns; the last vector masked.
template <int MR, int NV>
void GemmBlock(int64_t k_size, const float* a, int64_t lda, const float* b, int64_t ldb,
               const float* bias, float* c, int64_t ldc, __mmask16 last) {
  // Fully unrolled, so that the accumulators live in registers.
  __m512 acc[MR][NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const __mmask16 m = v == NV - 1 ? last : 0xFFFF;
    const __m512 init = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[r][v] = init;
  }
  for (int64_t k = 0; k < k_size; ++k) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      bv[v] = _mm512_maskz_loadu_ps(v == NV - 1 ? last : 0xFFFF, b + k * ldb + 16 * v);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      _mm512_mask_storeu_ps(c + r * ldc + 16 * v, v == NV - 1 ? last : 0xFFFF, acc[r][v]);
    }
  }
}

template <int NV>
void GemmColumns(int64_t m, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                 const float* bias, float* c, int64_t ldc, __mmask16 last) {
  constexpr int kRows = 6;  // 6 x 4 accumulators + 4 of B: 28 of the 32 registers.
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    GemmBlock<kRows, NV>(k, a + i * lda, lda, b, ldb, bias, c + i * ldc, ldc, last);
  }
  a += i * lda, c += i * ldc;
  switch (m - i) {
    case 5: GemmBlock<5, NV>(k, a, lda, b, ldb, bias, c, ldc, last); break;
    case 4: GemmBlock<4, NV>(k, a, lda, b, ldb, bias, c, ldc, last); break;
    case 3: GemmBlock<3, NV>(k, a, lda, b, ldb, bias, c, ldc, last); break;
    case 2: GemmBlock<2, NV>(k, a, lda, b, ldb, bias, c, ldc, last); break;
    case 1: GemmBlock<1, NV>(k, a, lda, b, ldb, bias, c, ldc, last); break;
  }
}

void Gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, const float* bias, float* c, int64_t ldc) {
  // Panels of 64 columns: B's panel (k x 64) stays in L1 across the rows.
  for (int64_t j = 0; j < n; j += 64) {
    const int64_t width = n - j < 64 ? n - j : 64;
    const int nv = static_cast<int>((width + 15) / 16);
    const __mmask16 last = static_cast<__mmask16>((1u << (width - 16 * (nv - 1))) - 1);
    const float* bias_j = bias ? bias + j : nullptr;
    switch (nv) {
      case 4: GemmColumns<4>(m, k, a, lda, b + j, ldb, bias_j, c + j, ldc, last); break;
      case 3: GemmColumns<3>(m, k, a, lda, b + j, ldb, bias_j, c + j, ldc, last); break;
      case 2: GemmColumns<2>(m, k, a, lda, b + j, ldb, bias_j, c + j, ldc, last); break;
      case 1: GemmColumns<1>(m, k, a, lda, b + j, ldb, bias_j, c + j, ldc, last); break;
    }
  }
}
#else
void Gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, const float* bias, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) ci[j] = bias ? bias[j] : 0.f;
    for (int64_t p = 0; p < k; ++p) {
      const float aip = a[i * lda + p];
      const float* bp = b + p * ldb;
      for (int64_t j = 0; j < n; ++j) ci[j] += aip * bp[j];
    }
  }
}
#endif

#if defined(__AVX512F__)
// Chunks of 16 columns of a row of n: the lanes of chunk j that exist.
inline __mmask16 ChunkMask(int64_t n, int64_t j) {
  return n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
}

// exp(x), Cephes' single-precision polynomial (about 1 ulp), for 16 lanes.
inline __m512 Exp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// Softmax of each row of s [m, n] (stride ld), in place, after dividing by `scale`.
void SoftmaxRows(int64_t m, int64_t n, float* s, int64_t ld, float scale) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < m; ++i) {
    float* row = s + i * ld;
    __m512 max = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 mask = ChunkMask(n, j);
      const __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(mask, row + j), scale_v);
      _mm512_mask_storeu_ps(row + j, mask, v);
      max = _mm512_mask_max_ps(max, mask, max, v);
    }
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(max));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 mask = ChunkMask(n, j);
      const __m512 e = Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + j), row_max));
      _mm512_mask_storeu_ps(row + j, mask, e);
      sum = _mm512_mask_add_ps(sum, mask, sum, e);
    }
    const __m512 row_sum = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 mask = ChunkMask(n, j);
      _mm512_mask_storeu_ps(row + j, mask,
                            _mm512_div_ps(_mm512_maskz_loadu_ps(mask, row + j), row_sum));
    }
  }
}

// x = LN(x + y) over rows of width e, variance as flax's E[x^2] - E[x]^2.
void AddLayerNorm(int64_t m, int64_t e, float* x, const float* y, const float* scale,
                  const float* bias) {
  for (int64_t i = 0; i < m; ++i) {
    float* row = x + i * e;
    const float* add = y + i * e;
    __m512 sum = _mm512_setzero_ps(), sum_sq = _mm512_setzero_ps();
    for (int64_t j = 0; j < e; j += 16) {
      const __mmask16 mask = ChunkMask(e, j);
      const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, row + j),
                                     _mm512_maskz_loadu_ps(mask, add + j));
      _mm512_mask_storeu_ps(row + j, mask, v);
      sum = _mm512_add_ps(sum, v);
      sum_sq = _mm512_fmadd_ps(v, v, sum_sq);
    }
    const float mean = _mm512_reduce_add_ps(sum) / e;
    const float var = std::fmax(_mm512_reduce_add_ps(sum_sq) / e - mean * mean, 0.f);
    const __m512 mean_v = _mm512_set1_ps(mean);
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(var + kLayerNormEpsilon));
    for (int64_t j = 0; j < e; j += 16) {
      const __mmask16 mask = ChunkMask(e, j);
      const __m512 v = _mm512_maskz_loadu_ps(mask, row + j);
      const __m512 mul = _mm512_mul_ps(inv, _mm512_maskz_loadu_ps(mask, scale + j));
      _mm512_mask_storeu_ps(row + j, mask, _mm512_fmadd_ps(_mm512_sub_ps(v, mean_v), mul,
                                                           _mm512_maskz_loadu_ps(mask, bias + j)));
    }
  }
}
#else
void SoftmaxRows(int64_t m, int64_t n, float* s, int64_t ld, float scale) {
  for (int64_t i = 0; i < m; ++i) {
    float* row = s + i * ld;
    float max = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      row[j] /= scale;
      max = row[j] > max ? row[j] : max;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = std::exp(row[j] - max);
      sum += row[j];
    }
    for (int64_t j = 0; j < n; ++j) row[j] /= sum;
  }
}

void AddLayerNorm(int64_t m, int64_t e, float* x, const float* y, const float* scale,
                  const float* bias) {
  for (int64_t i = 0; i < m; ++i) {
    float* row = x + i * e;
    const float* add = y + i * e;
    float sum = 0.f, sum_sq = 0.f;
    for (int64_t j = 0; j < e; ++j) {
      row[j] += add[j];
      sum += row[j];
      sum_sq += row[j] * row[j];
    }
    const float mean = sum / e;
    const float var = std::fmax(sum_sq / e - mean * mean, 0.f);
    const float inv = 1.f / std::sqrt(var + kLayerNormEpsilon);
    for (int64_t j = 0; j < e; ++j) row[j] = (row[j] - mean) * (inv * scale[j]) + bias[j];
  }
}
#endif

void Activate(int64_t size, float* x, int64_t activation) {
  for (int64_t j = 0; j < size; ++j) {
    const float v = x[j];
    if (activation == kRelu) {
      x[j] = v > 0.f ? v : 0.f;
    } else if (activation == kLeakyRelu) {
      x[j] = v > 0.f ? v : 0.1f * v;
    } else {  // jax.nn.gelu(approximate=True)
      x[j] = 0.5f * v * (1.f + std::tanh(0.7978845608f * (v + 0.044715f * v * v * v)));
    }
  }
}

struct LayerParams {
  const float *q, *q_bias, *k, *k_bias, *v, *v_bias, *o, *o_bias;
  const float *norm1_scale, *norm1_bias;
  const float *inner, *inner_bias, *outer, *outer_bias;
  const float *norm2_scale, *norm2_bias;
};

struct Dims {
  int64_t length, width, query_key, value, inner, heads;
};

// One encoder stack on x [L, E], in place, as phases over row halves
// (threads.h): per layer, (1) q, k, v of the rows; (2) their attention and the
// rest of the layer.
class Stack {
 public:
  static constexpr int kHalves = 2;

  Stack(const Dims& d, std::vector<LayerParams> layers, int64_t activation, float* x)
      : d_(d), layers_(std::move(layers)), activation_(activation), x_(x) {
    const int64_t l = d.length;
    buffer_.resize(2 * l * d.query_key + 2 * l * d.value + d.query_key * l + l * l +
                   l * (d.width > d.inner ? d.width : d.inner) + l * d.inner);
    float* next = buffer_.data();
    auto take = [&next](int64_t size) { float* p = next; next += size; return p; };
    q_ = take(l * d.query_key), k_ = take(l * d.query_key), v_ = take(l * d.value);
    attended_ = take(l * d.value);
    key_t_ = take(d.query_key * l);  // [query_key, L]: the keys transposed
    logits_ = take(l * l);
    y_ = take(l * (d.width > d.inner ? d.width : d.inner));
    hidden_ = take(l * d.inner);
  }

  // A second thread pays off from a few dozen tokens on (its hand-off costs microseconds).
  void Run(ffi::ThreadPool& pool) {
    const int num_phases = static_cast<int>(layers_.size()) * 2;
    cht_jax::RunPhases(pool, d_.length >= 16, num_phases, kHalves, [this](int phase, int half) {
      const int64_t mid = d_.length / 2;
      const int64_t begin = half ? mid : 0, end = half ? d_.length : mid;
      const LayerParams& p = layers_[phase / 2];
      if (phase % 2 == 0) {
        QueryKeyValue(p, begin, end);
      } else {
        AttendAndFeedForward(p, begin, end);
      }
    });
  }

 private:
  void QueryKeyValue(const LayerParams& p, int64_t begin, int64_t end) {
    const int64_t l = d_.length, e = d_.width, dq = d_.query_key, dv = d_.value;
    const int64_t rows = end - begin;
    const float* x = x_ + begin * e;
    Gemm(rows, dq, e, x, e, p.q, dq, p.q_bias, q_ + begin * dq, dq);
    Gemm(rows, dq, e, x, e, p.k, dq, p.k_bias, k_ + begin * dq, dq);
    Gemm(rows, dv, e, x, e, p.v, dv, p.v_bias, v_ + begin * dv, dv);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < dq; ++c) key_t_[c * l + t] = k_[t * dq + c];
    }
  }

  void AttendAndFeedForward(const LayerParams& p, int64_t begin, int64_t end) {
    const int64_t l = d_.length, e = d_.width, dq = d_.query_key, dv = d_.value;
    const int64_t hq = dq / d_.heads, hv = dv / d_.heads, rows = end - begin;
    const float scale = std::sqrt(static_cast<float>(hq));
    float* logits = logits_ + begin * l;
    float* attended = attended_ + begin * dv;
    for (int64_t h = 0; h < d_.heads; ++h) {
      Gemm(rows, l, hq, q_ + begin * dq + h * hq, dq, key_t_ + h * hq * l, l, nullptr, logits, l);
      SoftmaxRows(rows, l, logits, l, scale);
      Gemm(rows, hv, l, logits, l, v_ + h * hv, dv, nullptr, attended + h * hv, dv);
    }
    float* x = x_ + begin * e;
    float* y = y_ + begin * e;
    float* hidden = hidden_ + begin * d_.inner;
    Gemm(rows, e, dv, attended, dv, p.o, e, p.o_bias, y, e);
    AddLayerNorm(rows, e, x, y, p.norm1_scale, p.norm1_bias);
    Gemm(rows, d_.inner, e, x, e, p.inner, d_.inner, p.inner_bias, hidden, d_.inner);
    Activate(rows * d_.inner, hidden, activation_);
    Gemm(rows, e, d_.inner, hidden, d_.inner, p.outer, e, p.outer_bias, y, e);
    AddLayerNorm(rows, e, x, y, p.norm2_scale, p.norm2_bias);
  }

  const Dims d_;
  const std::vector<LayerParams> layers_;
  const int64_t activation_;
  float* const x_;
  std::vector<float> buffer_;
  float *q_, *k_, *v_, *attended_, *key_t_, *logits_, *y_, *hidden_;
};

int64_t NumElements(const ffi::AnyBuffer::Dimensions& dims) {
  int64_t n = 1;
  for (auto d : dims) n *= d;
  return n;
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> tokens,
                       ffi::RemainingArgs params, ffi::ResultBuffer<ffi::F32> out,
                       int64_t num_heads, int64_t activation) {
  auto td = tokens.dimensions();
  if (td.size() < 2 || params.size() == 0 || params.size() % kParamsPerLayer != 0) {
    return ffi::Error::InvalidArgument(
        "fused_cpu encoder: tokens [B..., L, E] and 16 parameters per layer expected");
  }
  Dims d;
  d.length = td[td.size() - 2], d.width = td[td.size() - 1], d.heads = num_heads;
  const int64_t batch = NumElements(td) / (d.length * d.width);
  const int64_t num_layers = params.size() / kParamsPerLayer;
  // Every parameter: its data and its stride between batch elements (0: shared).
  std::vector<const float*> data(params.size());
  std::vector<int64_t> stride(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    auto buffer = params.get<ffi::Buffer<ffi::F32>>(i);
    if (!buffer.has_value()) return buffer.error();
    auto dims = buffer->dimensions();
    const size_t j = i % kParamsPerLayer;
    const bool is_matrix = j < 8 ? j % 2 == 0 : (j == 10 || j == 12);
    const size_t core = is_matrix ? 2 : 1;
    if (dims.size() < core) return ffi::Error::InvalidArgument("fused_cpu encoder: bad rank");
    int64_t core_size = 1;
    for (size_t k = dims.size() - core; k < dims.size(); ++k) core_size *= dims[k];
    const int64_t total = NumElements(dims);
    if (total != core_size && total != core_size * batch) {
      return ffi::Error::InvalidArgument("fused_cpu encoder: parameter batch mismatch");
    }
    data[i] = buffer->typed_data();
    stride[i] = total == core_size ? 0 : core_size;
    if (i == 0) d.query_key = dims[dims.size() - 1];
    if (i == 4) d.value = dims[dims.size() - 1];
    if (i == 10) d.inner = dims[dims.size() - 1];
  }
  if (d.query_key % num_heads != 0 || d.value % num_heads != 0) {
    return ffi::Error::InvalidArgument("fused_cpu encoder: heads must divide q/k/v widths");
  }
  const int64_t size = d.length * d.width;
  for (int64_t b = 0; b < batch; ++b) {
    float* x = out->typed_data() + b * size;
    std::memcpy(x, tokens.typed_data() + b * size, size * sizeof(float));
    std::vector<LayerParams> layers;
    for (int64_t layer = 0; layer < num_layers; ++layer) {
      const float* ptr[kParamsPerLayer];
      for (int i = 0; i < kParamsPerLayer; ++i) {
        const int64_t index = layer * kParamsPerLayer + i;
        ptr[i] = data[index] + b * stride[index];
      }
      layers.push_back({ptr[0], ptr[1], ptr[2],  ptr[3],  ptr[4],  ptr[5],  ptr[6],  ptr[7],
                        ptr[8], ptr[9], ptr[10], ptr[11], ptr[12], ptr[13], ptr[14], ptr[15]});
    }
    Stack(d, std::move(layers), activation, x).Run(pool);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChtEncoderForward, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_heads")
                                  .Attr<int64_t>("activation"));
