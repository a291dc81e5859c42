// A GGUF tensor's own blocks times activations, the way llama.cpp's CPU backend computes it
// (each weight block's integers meet the activation's integers in AVX2's u8 x s8 multiply-add,
// `maddubs`, one float multiply-add per block), except that each activation is rounded to a
// 16-bit integer where llama.cpp rounds it to int8: per block of 32, d_x = max|x| / 127 / 256,
// x ~ d_x (256 q + r) with q = x / (256 d_x) rounded and r the rest rounded, q and r int8, each
// met alone and the sums joined (256 s_q + s_r). Rounded once to int8, the greedy texts of the
// default model's generation job kept to the float32 reference's in 9 rows of 256 (the int4
// kernel's bfloat16 activations 36, llama.cpp 6 of 64); twice, 59 (bench/FINDINGS.md), at
// about the time of a call at one row and 1.0-1.4x at 4-16 (the 512-bit build; the 256-bit ones
// 1.1-1.9x, before the AVX2 path's words below). The weight is read once, in the file's bytes, at
// any number of activation rows (the rows loop inside the block loop).
//
// Block layouts (ggml's, element j of a 32-weight block is byte j's low nibble for j < 16 and
// byte j - 16's high nibble otherwise):
//   Q4_0: fp16 d, 16 bytes of nibbles q;          w = d (q - 8)
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles q;  w = d q + m
//   Q5_0: fp16 d, 4 bytes qh, 16 bytes q;         w = d (q + 16 hi - 16), hi bit j of qh
//   Q8_0: fp16 d, 32 int8 q;                      w = d q
// and the K-quants' super-blocks of 256 (8 sub-blocks of 32, each met by one activation block):
//   Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit sc_j and m_j, 128 bytes of nibbles (bytes
//         32c..32c+31 hold sub-block 2c in their low nibbles, 2c + 1 in their high ones);
//         w = d sc_j q - dmin m_j
//   Q5_K: as Q4_K with 32 bytes qh after the scales, bit j of qh[i] element i's fifth bit in
//         sub-block j
//   Q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 weights), fp16 d;
//         w = d sc (q - 32), q 6 bits (ggml's dequantize_row_q6_K gives the order)
//
// Where the CPU has AVX-512 VNNI (and VL), the integer dot product is one `vpdpbusd` (u8 x s8
// summed in fours into int32) instead of `maddubs` + `madd`: the same sums, exactly (neither
// saturates at these magnitudes). Where it has AVX-512 (F, BW, DQ, VL) with VNNI, the K-quants
// meet two sub-blocks of a super-block in one 512-bit `vpdpbusd`, each half of the vector scaled
// by its own sub-block's scales (MILLM_AVX512): 1.2-1.3x a call at 4-16 rows on an AMD EPYC.
// The 32-weight kinds there take each activation block as its 32 words 256 q + r in one 512-bit
// vector, met by the weight's integers widened to words in one `vpmaddwd` (`tile_wide`): on a
// 2-core AMD EPYC with AVX-512 (Zen 5) 1.15-1.65x the 512-bit `vpdpbusd` of q and r they took
// before, and 1.2-1.45x the AVX2 words build, at 4-16 rows (bench/FINDINGS.md).
//
// Where the CPU has AVX2 alone (no VNNI: MILLM_WORDS), an activation is kept as the one 16-bit
// word 256 q + r and met by the weight's integers widened to words in `madd_epi16` (two a block,
// the even elements and the odd ones, so each int32 lane sums the same four elements as
// `maddubs` + `madd` did): the same integer sums, so the same floats, with half the integer work
// of meeting q and r alone.
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

#if !defined(MILLM_VNNI)
#define MILLM_WORDS 1
#endif

namespace {

constexpr int64_t QK = 32;
constexpr int64_t QK_K = 256;
// GGMLQuantizationType values
enum Kind : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr bool is_k(int64_t kind) { return kind == Q4_K || kind == Q5_K || kind == Q6_K; }

constexpr int64_t bytes_of(int64_t kind) {
  switch (kind) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
  }
  return 0;
}

// Inputs a block covers.
constexpr int64_t weights_of(int64_t kind) { return is_k(kind) ? QK_K : QK; }

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

// Sums of u[i] * s[i] (u unsigned 0..255, s signed) over each 4 bytes: lane k holds bytes
// 4k..4k+3, as 8 int32.
inline __m256i dot_int(__m256i u, __m256i s) {
#ifdef MILLM_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The same sums against an activation block's 256 q + r (q and r signed, each summed alone:
// neither product saturates), as 8 floats.
inline __m256 dot_us(__m256i u, __m256i q, __m256i r) {
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(dot_int(u, q), 8), dot_int(u, r)));
}

#ifdef MILLM_WORDS
// The weight's 32 integers (bytes, unsigned or `SIGNED`) as two vectors of 16 words: elements
// 0, 2, ..., 30 and 1, 3, ..., 31, the order an activation block's words are kept in.
template <bool SIGNED>
inline void widen(__m256i bytes, __m256i& even, __m256i& odd) {
  if constexpr (SIGNED) {
    even = _mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 8);
    odd = _mm256_srai_epi16(bytes, 8);
  } else {
    even = _mm256_and_si256(bytes, _mm256_set1_epi16(0xFF));
    odd = _mm256_srli_epi16(bytes, 8);
  }
}

// Sums of w[i] * (256 q[i] + r[i]) over elements 4k..4k+3 in lane k, as 8 floats: `dot_us`'s
// sums, met as words (no product or pair sum overflows: |w| <= 128, |256 q + r| < 2^15).
inline __m256 dot_words(__m256i even, __m256i odd, const int16_t* words) {
  const __m256i e = _mm256_madd_epi16(even, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words)));
  const __m256i o = _mm256_madd_epi16(odd, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 16)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(e, o));
}
#endif

// Q4_K's and Q5_K's 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4).
inline void scale_min(const uint8_t* q, int j, float& sc, float& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Activations rounded per block to d (256 q + r), q and r int8: d the block's step max|x| / 127
// over 256, q x rounded to that step times 256, r the rest; the sum of 256 q + r (for an offset
// weight: Q4_0, Q5_0) and the sum of x (for a minimum: Q4_1). Under MILLM_WORDS each block's
// 256 q + r as 32 words instead, its even elements then its odd ones (`widen`'s order); in the
// AVX-512 build, for the 32-weight kinds (`in_order`), as 32 words in order (`tile_wide`'s).
struct Activations {
  int64_t rows, blocks;
  std::vector<int8_t> q, r;
  std::vector<int16_t> words;
  std::vector<float> d, xsum;
  std::vector<int32_t> qsum;
};

// 32 int32 (four vectors of 8, each in -127..127) as 32 bytes in order (packs interleave 128-bit
// lanes; the permute undoes it).
inline void store_bytes(const __m256i n[4], int8_t* out) {
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// The 32 words 256 n + m in order (each within ±32639: no pack saturates).
inline void store_words(const __m256i n[4], const __m256i m[4], int16_t* out) {
  for (int j = 0; j < 4; ++j) {
    const __m256i whole = _mm256_add_epi32(_mm256_slli_epi32(n[j], 8), m[j]);
    // Packed per 128-bit lane (words 0-3 twice, then 4-7 twice): the permute takes one of each.
    const __m256i packed = _mm256_packs_epi32(whole, whole);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * j),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
  }
}

inline int32_t lane_sum(const __m256i n[4]) {
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

Activations quantize(const float* x, int64_t rows, int64_t in, bool in_order) {
  Activations a{rows, in / QK};
#ifdef MILLM_WORDS
  a.words.resize(rows * in);
#else
  if (in_order) {
    a.words.resize(rows * in);
  } else {
    a.q.resize(rows * in);
    a.r.resize(rows * in);
  }
#endif
  a.d.resize(rows * a.blocks);
  a.xsum.resize(rows * a.blocks);
  a.qsum.resize(rows * a.blocks);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < rows * a.blocks; ++i) {
    const float* xb = x + i * QK;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      sum = _mm256_add_ps(sum, v[j]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    // Rounded to nearest, ties to even (the default rounding mode, as std::nearbyint), 32 at a
    // time: x·(1/d) to q, then what is left, x - q·d (one rounding), times 256/d to r.
    __m256i n[4], m[4];
    for (int j = 0; j < 4; ++j) {
      n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inverse)));
      const __m256 left = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(n[j]), _mm256_set1_ps(d), v[j]);
      m[j] = _mm256_cvtps_epi32(_mm256_mul_ps(left, _mm256_set1_ps(256.0f * inverse)));
      m[j] = _mm256_max_epi32(_mm256_min_epi32(m[j], _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    }
#ifdef MILLM_WORDS
    alignas(32) int32_t whole[QK];
    for (int j = 0; j < 4; ++j) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(whole + 8 * j), _mm256_add_epi32(_mm256_slli_epi32(n[j], 8), m[j]));
    }
    int16_t* words = a.words.data() + i * QK;
    for (int j = 0; j < QK / 2; ++j) {
      words[j] = static_cast<int16_t>(whole[2 * j]);
      words[QK / 2 + j] = static_cast<int16_t>(whole[2 * j + 1]);
    }
#else
    if (in_order) {
      store_words(n, m, a.words.data() + i * QK);
    } else {
      store_bytes(n, a.q.data() + i * QK);
      store_bytes(m, a.r.data() + i * QK);
    }
#endif
    a.d[i] = d / 256.0f;
    a.xsum[i] = hsum(sum);
    a.qsum[i] = 256 * lane_sum(n) + lane_sum(m);
  }
  return a;
}

#ifdef MILLM_AVX512
// Lane k of 16 takes element k / 8 (a pair of blocks' scales), or k / 4 (Q6_K's four 16-weight
// groups of two blocks).
inline __m512 pair_lanes(__m128 two) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                               _mm512_castps128_ps512(two));
}

inline __m512 quarter_lanes(__m128 four) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                               _mm512_castps128_ps512(four));
}

// Two consecutive activation blocks' scales d_x, one per half.
inline __m512 pair_of(const float* dx) {
  return pair_lanes(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx))));
}

inline __m512i join(__m256i low, __m256i high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

// Sums of u[i] * (256 q[i] + r[i]) over each 4 bytes, as 16 floats.
inline __m512 dot_us(__m512i u, __m512i q, __m512i r) {
  const __m512i high = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, q), 8);
  return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(high, u, r));
}

// Signed weights qw against signed activations 256 qa + ra: |qw| (unsigned) times each with qw's sign.
inline __m512 dot_signed(__m512i qw, __m512i qa, __m512i ra) {
  const __mmask64 negative = _mm512_movepi8_mask(qw);
  const __m512i zero = _mm512_setzero_si512();
  return dot_us(_mm512_abs_epi8(qw), _mm512_mask_sub_epi8(qa, negative, zero, qa),
                _mm512_mask_sub_epi8(ra, negative, zero, ra));
}
#endif

// A 32-weight block's integers as 32 bytes in element order: Q4_0's, Q4_1's and Q5_0's 0..15 or
// 0..31 (their offsets not taken), Q8_0's signed.
template <int64_t KIND>
inline __m256i integers(const uint8_t* w) {
  static_assert(KIND == Q4_0 || KIND == Q4_1 || KIND == Q5_0 || KIND == Q8_0);
  if constexpr (KIND == Q4_0) return nibbles(w + 2);
  else if constexpr (KIND == Q4_1) return nibbles(w + 4);
  else if constexpr (KIND == Q5_0) return _mm256_or_si256(nibbles(w + 6), fifth_bits(w + 2));
  else return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
}

// out[r0 + r, n] for the R activation rows from r0 (R a constant: the accumulators stay in
// registers) and one output feature, whose blocks start at w.
template <int64_t KIND, int R>
inline void tile(const uint8_t* w, const Activations& a, int64_t r0, float* out, int64_t out_stride, int64_t n) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  float extra[R];
  for (int r = 0; r < R; ++r) extra[r] = 0.0f;
#ifdef MILLM_WORDS
  const int16_t* words = a.words.data() + r0 * a.blocks * QK;
#else
  const int8_t* q = a.q.data() + r0 * a.blocks * QK;
  const int8_t* rest = a.r.data() + r0 * a.blocks * QK;
#endif
  const float* dx = a.d.data() + r0 * a.blocks;
  for (int64_t b = 0; b < a.blocks; ++b, w += bytes_of(KIND)) {
    const float d = fp16(w);
    const __m256i qw = integers<KIND>(w);
#ifdef MILLM_WORDS
    __m256i even, odd;
    widen<KIND == Q8_0>(qw, even, odd);
#else
    __m256i magnitude = qw;
    if constexpr (KIND == Q8_0) magnitude = _mm256_sign_epi8(qw, qw);
#endif
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * a.blocks + b;
      const float scale = d * dx[i];
#if defined(MILLM_WORDS)
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale), dot_words(even, odd, words + i * QK), acc[r]);
#else
      __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * QK));
      __m256i ra = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rest + i * QK));
      if constexpr (KIND == Q8_0) {
        qa = _mm256_sign_epi8(qa, qw);
        ra = _mm256_sign_epi8(ra, qw);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale), dot_us(magnitude, qa, ra), acc[r]);
#endif
      if constexpr (KIND == Q4_0) extra[r] -= 8.0f * scale * static_cast<float>(a.qsum[r0 * a.blocks + i]);
      if constexpr (KIND == Q5_0) extra[r] -= 16.0f * scale * static_cast<float>(a.qsum[r0 * a.blocks + i]);
      if constexpr (KIND == Q4_1) extra[r] += fp16(w + 2) * a.xsum[r0 * a.blocks + i];
    }
  }
  for (int r = 0; r < R; ++r) out[(r0 + r) * out_stride + n] = hsum(acc[r]) + extra[r];
}

#ifdef MILLM_AVX512
// `tile` on AVX-512: each activation block's 32 words (in order) in one 512-bit vector, met by
// the weight's 32 integers widened to words in one `vpmaddwd` (16 sums of two products) and one
// float multiply-add; Q4_0's and Q5_0's offset taken from the integers as words, so the sums are
// of the weight's own w / d.
template <int64_t KIND, int R>
inline void tile_wide(const uint8_t* w, const Activations& a, int64_t r0, float* out, int64_t out_stride, int64_t n) {
  __m512 acc[R];
  float extra[R];  // Q4_1's minimum times each row's exact sum of x
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    extra[r] = 0.0f;
  }
  const int16_t* words = a.words.data() + r0 * a.blocks * QK;
  const float* dx = a.d.data() + r0 * a.blocks;
  const float* xsum = a.xsum.data() + r0 * a.blocks;
  for (int64_t b = 0; b < a.blocks; ++b, w += bytes_of(KIND)) {
    const __m256i qw = integers<KIND>(w);
    __m512i wide = KIND == Q8_0 ? _mm512_cvtepi8_epi16(qw) : _mm512_cvtepu8_epi16(qw);
    if constexpr (KIND == Q4_0) wide = _mm512_sub_epi16(wide, _mm512_set1_epi16(8));
    if constexpr (KIND == Q5_0) wide = _mm512_sub_epi16(wide, _mm512_set1_epi16(16));
    const __m512 d = _mm512_set1_ps(fp16(w));
    float minimum = 0.0f;
    if constexpr (KIND == Q4_1) minimum = fp16(w + 2);
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * a.blocks + b;
      const __m512i sums = _mm512_madd_epi16(wide, _mm512_loadu_si512(words + i * QK));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[i])), _mm512_cvtepi32_ps(sums), acc[r]);
      if constexpr (KIND == Q4_1) extra[r] += minimum * xsum[i];
    }
  }
  for (int r = 0; r < R; ++r) out[(r0 + r) * out_stride + n] = _mm512_reduce_add_ps(acc[r]) + extra[r];
}
#endif

// The K-quants' tile: each super-block's 8 sub-blocks, each against one activation block.
template <int64_t KIND, int R>
inline void tile_k(const uint8_t* w, const Activations& a, int64_t r0, float* out, int64_t out_stride, int64_t n) {
  __m256 acc[R], mins[R];  // mins: the minimums' products (Q4_K, Q5_K), subtracted at the end
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    mins[r] = _mm256_setzero_ps();
  }
#ifdef MILLM_AVX512
  __m512 wide[R];
  for (int r = 0; r < R; ++r) wide[r] = _mm512_setzero_ps();
#endif
#ifdef MILLM_WORDS
  const int16_t* words = a.words.data() + r0 * a.blocks * QK;
#else
  const int8_t* q = a.q.data() + r0 * a.blocks * QK;
  const int8_t* rest = a.r.data() + r0 * a.blocks * QK;
#endif
  const float* dx = a.d.data() + r0 * a.blocks;
  const float* xsum = a.xsum.data() + r0 * a.blocks;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b0 = 0; b0 < a.blocks; b0 += QK_K / QK, w += bytes_of(KIND)) {
    if constexpr (KIND == Q6_K) {
      const float d = fp16(w + 208);
      const int8_t* scales = reinterpret_cast<const int8_t*>(w + 192);
      for (int half = 0; half < 2; ++half) {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * half));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * half + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * half));
        const __m256i two_bits = _mm256_set1_epi8(3);
        __m256i groups[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_slli_epi16(_mm256_and_si256(qh, two_bits), 4)),
            _mm256_or_si256(_mm256_and_si256(ql1, low),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), two_bits), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), two_bits), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), two_bits), 4)),
        };
#ifdef MILLM_AVX512
        for (int g = 0; g < 4; g += 2) {  // two groups (two activation blocks) at a time
          const __m512i qw = _mm512_sub_epi8(join(groups[g], groups[g + 1]), _mm512_set1_epi8(32));
          int32_t four;  // the two groups' four int8 scales
          std::memcpy(&four, scales + 8 * half + 2 * g, 4);
          const __m512 sc = quarter_lanes(
              _mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)))));
          const int64_t block = b0 + 4 * half + g;
          for (int r = 0; r < R; ++r) {
            const int64_t i = r * a.blocks + block;
            const __m512i qa = _mm512_loadu_si512(q + i * QK), ra = _mm512_loadu_si512(rest + i * QK);
            wide[r] = _mm512_fmadd_ps(_mm512_mul_ps(sc, pair_of(dx + i)), dot_signed(qw, qa, ra), wide[r]);
          }
        }
#else
        for (int g = 0; g < 4; ++g) {
          const __m256i qw = _mm256_sub_epi8(groups[g], _mm256_set1_epi8(32));  // -32..31
          // Lanes 0-3 (elements 0-15) take the group's first scale, lanes 4-7 its second.
          const float s0 = d * scales[8 * half + 2 * g], s1 = d * scales[8 * half + 2 * g + 1];
          const __m256 sc = _mm256_set_ps(s1, s1, s1, s1, s0, s0, s0, s0);
          const int64_t block = b0 + 4 * half + g;
#ifdef MILLM_WORDS
          __m256i even, odd;
          widen<true>(qw, even, odd);
          for (int r = 0; r < R; ++r) {
            const int64_t i = r * a.blocks + block;
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(sc, _mm256_set1_ps(dx[i])), dot_words(even, odd, words + i * QK),
                                     acc[r]);
          }
#else
          const __m256i magnitude = _mm256_sign_epi8(qw, qw);
          for (int r = 0; r < R; ++r) {
            const int64_t i = r * a.blocks + block;
            const __m256i qa = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * QK)), qw);
            const __m256i ra = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rest + i * QK)), qw);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(sc, _mm256_set1_ps(dx[i])), dot_us(magnitude, qa, ra), acc[r]);
          }
#endif
        }
#endif
      }
    } else {
      const float d = fp16(w), dmin = fp16(w + 2);
      float scales[8], minimums[8];
      for (int j = 0; j < 8; ++j) {
        scale_min(w + 4, j, scales[j], minimums[j]);
        scales[j] *= d;
        minimums[j] *= dmin;
      }
      // The minimums times each sub-block's exact sum of x: one vector of 8 per row.
      const __m256 minimum = _mm256_loadu_ps(minimums);
      for (int r = 0; r < R; ++r) {
        mins[r] = _mm256_fmadd_ps(minimum, _mm256_loadu_ps(xsum + r * a.blocks + b0), mins[r]);
      }
      const uint8_t* nibble_bytes = w + (KIND == Q4_K ? 16 : 48);
      __m256i qh = _mm256_setzero_si256();
      if constexpr (KIND == Q5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
#ifdef MILLM_AVX512
      // Sub-blocks 2c and 2c + 1 (the low and high nibbles of the same 32 bytes) at a time.
      const __m512i low512 = _mm512_set1_epi8(0x0F);
      for (int c = 0; c < 4; ++c) {
        const __m512i both = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibble_bytes + 32 * c)));
        // The upper half's 16-bit lanes shifted by 4: its bytes' high nibbles.
        __m512i qw = _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4), low512);
        if constexpr (KIND == Q5_K) {
          const __m512i bits = join(_mm256_set1_epi8(static_cast<char>(1 << (2 * c))),
                                    _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1))));
          const __mmask64 set = _mm512_test_epi8_mask(_mm512_broadcast_i64x4(qh), bits);
          qw = _mm512_mask_add_epi8(qw, set, qw, _mm512_set1_epi8(0x10));
        }
        const __m512 sc = pair_lanes(_mm_setr_ps(scales[2 * c], scales[2 * c + 1], 0.0f, 0.0f));
        for (int r = 0; r < R; ++r) {
          const int64_t i = r * a.blocks + b0 + 2 * c;
          const __m512i qa = _mm512_loadu_si512(q + i * QK), ra = _mm512_loadu_si512(rest + i * QK);
          wide[r] = _mm512_fmadd_ps(_mm512_mul_ps(sc, pair_of(dx + i)), dot_us(qw, qa, ra), wide[r]);
        }
      }
#else
      for (int c = 0; c < 4; ++c) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibble_bytes + 32 * c));
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * c + h;
          __m256i qw = h == 0 ? _mm256_and_si256(bytes, low) : _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
          if constexpr (KIND == Q5_K) {
            const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
            qw = _mm256_or_si256(qw, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
          }
#ifdef MILLM_WORDS
          __m256i even, odd;
          widen<false>(qw, even, odd);
          for (int r = 0; r < R; ++r) {
            const int64_t i = r * a.blocks + b0 + j;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scales[j] * dx[i]), dot_words(even, odd, words + i * QK), acc[r]);
          }
#else
          for (int r = 0; r < R; ++r) {
            const int64_t i = r * a.blocks + b0 + j;
            const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * QK));
            const __m256i ra = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rest + i * QK));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scales[j] * dx[i]), dot_us(qw, qa, ra), acc[r]);
          }
#endif
        }
      }
#endif
    }
  }
  for (int r = 0; r < R; ++r) {
    float total = hsum(acc[r]) - hsum(mins[r]);
#ifdef MILLM_AVX512
    total += _mm512_reduce_add_ps(wide[r]);
#endif
    out[(r0 + r) * out_stride + n] = total;
  }
}

// out[r0 + r, n] for the R rows from r0: a tile of the kind's family.
template <int64_t KIND, int R>
inline void rows_of(const uint8_t* w, const Activations& a, int64_t r0, float* out, int64_t out_stride, int64_t n) {
  if constexpr (is_k(KIND)) {
    tile_k<KIND, R>(w, a, r0, out, out_stride, n);
  } else {
#ifdef MILLM_AVX512
    tile_wide<KIND, R>(w, a, r0, out, out_stride, n);
#else
    tile<KIND, R>(w, a, r0, out, out_stride, n);
#endif
  }
}

// out[r, n] for output features [begin, end) and every activation row r: four rows at a time
// (each weight block read and unpacked once for them), then the last one to three rows as one
// tile (as one row each, a 7-row call cost 1.06-1.14x an 8-row one on an AVX2 EPYC). A row's sums
// are the same in a tile of any size.
template <int64_t KIND>
void features(const uint8_t* weight, int64_t row_bytes, const Activations& a, float* out, int64_t out_stride,
              int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* w = weight + n * row_bytes;
    int64_t r0 = 0;
    for (; r0 + 4 <= a.rows; r0 += 4) rows_of<KIND, 4>(w, a, r0, out, out_stride, n);
    switch (a.rows - r0) {
      case 3: rows_of<KIND, 3>(w, a, r0, out, out_stride, n); break;
      case 2: rows_of<KIND, 2>(w, a, r0, out, out_stride, n); break;
      case 1: rows_of<KIND, 1>(w, a, r0, out, out_stride, n); break;
      default: break;
    }
  }
}

}  // namespace

// x [..., in] (any float dtype; its leading dimensions are its rows), weight [out, in / 32 * block
// bytes] uint8: float32 [..., out]. Shaped here, not around the call in Python: at one row a
// reshape and a cast there were as long again as the call (bench/FINDINGS.md).
torch::Tensor block_mm(const torch::Tensor& x, const torch::Tensor& weight, int64_t kind) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && weight.scalar_type() == torch::kUInt8, "block_mm: shapes");
  const int64_t in = x.size(-1), rows = in > 0 ? x.numel() / in : 0, out = weight.size(0);
  TORCH_CHECK(bytes_of(kind) > 0, "block_dot: no kernel for GGML type ", kind);
  TORCH_CHECK(in % weights_of(kind) == 0 && weight.size(1) == in / weights_of(kind) * bytes_of(kind), "block_mm: ",
              in, " inputs and ", weight.size(1), " bytes a row do not match GGML type ", kind);
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  const torch::Tensor w = weight.contiguous();
#ifdef MILLM_AVX512
  const bool in_order = !is_k(kind);  // tile_wide's words
#else
  const bool in_order = false;
#endif
  const Activations a = quantize(xf.data_ptr<float>(), rows, in, in_order);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  torch::Tensor result = torch::empty(shape, torch::kFloat32);
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
      case Q4_K: features<Q4_K>(wp, row_bytes, a, o, out, begin, end); break;
      case Q5_K: features<Q5_K>(wp, row_bytes, a, o, out, begin, end); break;
      case Q6_K: features<Q6_K>(wp, row_bytes, a, o, out, begin, end); break;
    }
  });
  return result;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_mm", &block_mm, "a GGUF tensor's blocks times activations quantized per block");
}
