// A GGUF tensor's own blocks times activations, the way llama.cpp's CPU backend computes it:
// each activation row is quantized to int8 per block of 32 (a scale d_x = max|x| / 127, and the
// block's sum), and each weight block's integers meet the activation's integers in AVX2's
// u8 x s8 multiply-add (`maddubs`), one float multiply-add per block. The weight is read once,
// in the file's bytes, at any number of activation rows (the rows loop inside the block loop).
//
// Block layouts (ggml's, element j of a 32-weight block is byte j's low nibble for j < 16 and
// byte j - 16's high nibble otherwise):
//   Q4_0: fp16 d, 16 bytes of nibbles q;          w = d (q - 8)
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles q;  w = d q + m
//   Q5_0: fp16 d, 4 bytes qh, 16 bytes q;         w = d (q + 16 hi - 16), hi bit j of qh
//   Q8_0: fp16 d, 32 int8 q;                      w = d q
//
// Threads: at::parallel_for over output features, torch's own pool (the engine's one model
// thread sets its size), so no second OpenMP runtime spins beside torch's.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QK = 32;
enum Kind : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8 };  // GGMLQuantizationType values

int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q8_0: return 34;
  }
  TORCH_CHECK(false, "block_dot: no kernel for GGML type ", kind);
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// 16 bytes of nibbles -> 32 bytes 0..15 in ggml's element order.
inline __m256i nibbles(const uint8_t* p) {
  __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, byte j 0x10 where bit j is set (Q5_0's fifth bits).
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  const __m256i mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  bytes = _mm256_or_si256(bytes, mask);
  bytes = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
  return _mm256_and_si256(bytes, _mm256_set1_epi8(0x10));
}

// Sum of u[i] * s[i] (u unsigned 0..255, s signed), as 8 float partial sums.
inline __m256 dot_us(__m256i u, __m256i s) {
  __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Activations quantized per block: q (int8), d, the sum of q (for an offset weight: Q4_0, Q5_0)
// and the sum of x (for a minimum: Q4_1).
struct Activations {
  int64_t rows, blocks;
  std::vector<int8_t> q;
  std::vector<float> d, xsum;
  std::vector<int32_t> qsum;
};

Activations quantize(const float* x, int64_t rows, int64_t in) {
  Activations a{rows, in / QK};
  a.q.resize(rows * in);
  a.d.resize(rows * a.blocks);
  a.xsum.resize(rows * a.blocks);
  a.qsum.resize(rows * a.blocks);
  for (int64_t i = 0; i < rows * a.blocks; ++i) {
    const float* xb = x + i * QK;
    __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < QK; j += 8) {
      __m256 v = _mm256_loadu_ps(xb + j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
      sum = _mm256_add_ps(sum, v);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t qsum = 0;
    for (int j = 0; j < QK; ++j) {
      const int8_t q = static_cast<int8_t>(std::nearbyint(xb[j] * inverse));
      a.q[i * QK + j] = q;
      qsum += q;
    }
    a.d[i] = d;
    a.xsum[i] = hsum(sum);
    a.qsum[i] = qsum;
  }
  return a;
}

constexpr int64_t bytes_of(int64_t kind) {
  return kind == Q4_0 ? 18 : kind == Q4_1 ? 20 : kind == Q5_0 ? 22 : 34;
}

// out[r0 + r, n] for the R activation rows from r0 (R a constant: the accumulators stay in
// registers) and one output feature, whose blocks start at w.
template <int64_t KIND, int R>
inline void tile(const uint8_t* w, const Activations& a, int64_t r0, float* out, int64_t out_stride, int64_t n) {
  __m256 acc[R];
  float extra[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    extra[r] = 0.0f;
  }
  const int8_t* q = a.q.data() + r0 * a.blocks * QK;
  const float* dx = a.d.data() + r0 * a.blocks;
  for (int64_t b = 0; b < a.blocks; ++b, w += bytes_of(KIND)) {
    const float d = fp16(w);
    __m256i qw;
    if constexpr (KIND == Q4_0) qw = nibbles(w + 2);
    if constexpr (KIND == Q4_1) qw = nibbles(w + 4);
    if constexpr (KIND == Q5_0) qw = _mm256_or_si256(nibbles(w + 6), fifth_bits(w + 2));
    if constexpr (KIND == Q8_0) qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
    __m256i magnitude = qw;
    if constexpr (KIND == Q8_0) magnitude = _mm256_sign_epi8(qw, qw);
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * a.blocks + b;
      __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * QK));
      if constexpr (KIND == Q8_0) qa = _mm256_sign_epi8(qa, qw);
      const float scale = d * dx[i];
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale), dot_us(magnitude, qa), acc[r]);
      if constexpr (KIND == Q4_0) extra[r] -= 8.0f * scale * static_cast<float>(a.qsum[r0 * a.blocks + i]);
      if constexpr (KIND == Q5_0) extra[r] -= 16.0f * scale * static_cast<float>(a.qsum[r0 * a.blocks + i]);
      if constexpr (KIND == Q4_1) extra[r] += fp16(w + 2) * a.xsum[r0 * a.blocks + i];
    }
  }
  for (int r = 0; r < R; ++r) out[(r0 + r) * out_stride + n] = hsum(acc[r]) + extra[r];
}

// out[r, n] for output features [begin, end) and every activation row r: four rows at a time
// (each weight block read once for them), then one at a time.
template <int64_t KIND>
void features(const uint8_t* weight, int64_t row_bytes, const Activations& a, float* out, int64_t out_stride,
              int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* w = weight + n * row_bytes;
    int64_t r0 = 0;
    for (; r0 + 4 <= a.rows; r0 += 4) tile<KIND, 4>(w, a, r0, out, out_stride, n);
    for (; r0 < a.rows; ++r0) tile<KIND, 1>(w, a, r0, out, out_stride, n);
  }
}

}  // namespace

// x [rows, in] (any float dtype), weight [out, in / 32 * block bytes] uint8: float32 [rows, out].
torch::Tensor block_mm(const torch::Tensor& x, const torch::Tensor& weight, int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.scalar_type() == torch::kUInt8, "block_mm: shapes");
  const int64_t rows = x.size(0), in = x.size(1), out = weight.size(0);
  TORCH_CHECK(in % QK == 0 && weight.size(1) == in / QK * block_bytes(kind), "block_mm: ", in, " inputs and ",
              weight.size(1), " bytes a row do not match GGML type ", kind);
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  const torch::Tensor w = weight.contiguous();
  const Activations a = quantize(xf.data_ptr<float>(), rows, in);
  torch::Tensor result = torch::empty({rows, out}, torch::kFloat32);
  float* o = result.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  const int64_t grain = std::max<int64_t>(16, 4096 / std::max<int64_t>(1, in / QK));
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
    switch (kind) {
      case Q4_0: features<Q4_0>(wp, row_bytes, a, o, out, begin, end); break;
      case Q4_1: features<Q4_1>(wp, row_bytes, a, o, out, begin, end); break;
      case Q5_0: features<Q5_0>(wp, row_bytes, a, o, out, begin, end); break;
      case Q8_0: features<Q8_0>(wp, row_bytes, a, o, out, begin, end); break;
    }
  });
  return result;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_mm", &block_mm, "a GGUF tensor's blocks times activations quantized per block");
}
