// Matmul and row lookup on compact weights, for one instruction set. build.py compiles this file once per ISA
// (generic, AVX2, AVX-512; the AVX-512 build also holds the AMX tiles' code) into its own namespace, and ops.cpp
// picks one at run time.
//
// Weights are [N, K] rows (an output feature a row), K a multiple of 32, in one of these layouts:
//   F16 / BF16   uint16 [N, K]
//   Q4           uint8 [N, K/2]: per 32 weights 16 bytes, low nibble = weight j, high nibble = weight j + 16
//   Q8           int8 [N, K]
// Q4 and Q8 carry a scale per group (16 or 32 weights; fp16 or fp32) and optionally a min: w = q * scale + min.
// Each 32-weight block is expanded to fp32 in registers and fused with the activation rows, so no fp32 copy of
// a weight matrix exists; one expansion serves up to MR activation rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "qgemm.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PIPELLM_AVX2 1
#endif
// AMX code in the AVX-512 build, from compilers that know its intrinsics (GCC 11, clang 12)
#if defined(__AVX512F__) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define PIPELLM_AMX_CODE 1
#else
#define PIPELLM_AMX_CODE 0
#endif

namespace PIPELLM_ISA {

using pipellm::DecodeArgs;
using pipellm::QActs;
using pipellm::QWeight;

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return (float)f;
#endif
}

static inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;  // bf16 is the top half of an fp32
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Group i's scale and min (i = row * s_stride + group). Two-level: an 8-bit multiple of an fp16 per 256 weights,
// multiplied in fp32 (exact: 11 x 8 bits), so w = q * scale + min expands to the same floats as a one-level fp32.
template <int SK>
static inline float scale_at(const QWeight& w, int64_t i) {
  if constexpr (SK == pipellm::SCALE_F32) return static_cast<const float*>(w.scale)[i];
  else if constexpr (SK == pipellm::SCALE_F16) return half_to_float(static_cast<const uint16_t*>(w.scale)[i]);
  else if constexpr (SK == pipellm::SCALE_TWO_LEVEL_I8)
    return half_to_float(static_cast<const uint16_t*>(w.super_scale)[i / 16]) *
           float(static_cast<const int8_t*>(w.scale)[i]);
  else
    return half_to_float(static_cast<const uint16_t*>(w.super_scale)[i / 8]) *
           float(static_cast<const uint8_t*>(w.scale)[i]);
}

template <int SK>
static inline float min_at(const QWeight& w, int64_t i) {
  if constexpr (SK == pipellm::SCALE_F32) return static_cast<const float*>(w.min)[i];
  else if constexpr (SK == pipellm::SCALE_F16) return half_to_float(static_cast<const uint16_t*>(w.min)[i]);
  else
    return -(half_to_float(static_cast<const uint16_t*>(w.super_min)[i / 8]) *
             float(static_cast<const uint8_t*>(w.min)[i]));
}

// The 32 codes of block b of row n in weight order: Q4 unsigned (bit planes included, offset not), Q8 signed.
template <int KIND, int P>
static inline void codes_at(const QWeight& w, int64_t n, int64_t b, int* code) {
  const uint8_t* row = w.qs + n * w.qs_stride;
  if constexpr (KIND == pipellm::Q4) {
    const uint8_t* h = w.qh + n * w.qh_stride + b * 4 * P;
    for (int j = 0; j < 32; j++) {
      code[j] = j < 16 ? row[b * 16 + j] & 15 : row[b * 16 + j - 16] >> 4;
      for (int pl = 0; pl < P; pl++) code[j] |= ((h[4 * pl + j / 8] >> (j % 8)) & 1) << (4 + pl);
    }
  } else {
    for (int j = 0; j < 32; j++) code[j] = reinterpret_cast<const int8_t*>(row)[b * 32 + j];
  }
}

// Weights b*32 .. b*32+31 of row n, as fp32.
template <int KIND, int GROUP, int SK, bool MIN, int P>
static inline void expand(const QWeight& w, int64_t n, int64_t b, float* __restrict out) {
  const uint8_t* row = w.qs + n * w.qs_stride;
  if constexpr (KIND == pipellm::F16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + b * 32;
    for (int j = 0; j < 32; j++) out[j] = half_to_float(p[j]);
    return;
  } else if constexpr (KIND == pipellm::BF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + b * 32;
    for (int j = 0; j < 32; j++) out[j] = bf16_to_float(p[j]);
    return;
  } else {
    int code[32];
    codes_at<KIND, P>(w, n, b, code);
    for (int j = 0; j < 32; j++) out[j] = float(code[j] - (P > 0 ? w.offset : 0));
    constexpr int G = 32 / GROUP;  // groups in this block
    const int64_t g0 = n * w.s_stride + b * G;
    for (int g = 0; g < G; g++) {
      const float s = scale_at<SK>(w, g0 + g);
      const float m = MIN ? min_at<SK>(w, g0 + g) : 0.0f;
      float* o = out + g * GROUP;
      for (int j = 0; j < GROUP; j++) o[j] = MIN ? o[j] * s + m : o[j] * s;
    }
  }
}

constexpr int MR = 8;  // activation rows per weight expansion: 8 accumulators + 4 weights fit in 16 registers
constexpr int NC = 32;  // weight rows a chunk (gemm_t)
#ifdef __AVX512F__
constexpr int NJ = 2;         // weight rows a tile: 2 x 8 accumulators + 8 weight vectors fit in 32 registers
constexpr int KB = 1 << 20;   // K in one slice: with NJ = 2 the tile's rows stream from L2 fast enough
#else
constexpr int NJ = 1;
constexpr int KB = 24;  // at most this many blocks of K a slice: a tile's 8 rows x 768 floats fill 24 KB of L1
#endif

#ifdef PIPELLM_AVX2
struct Block {
  __m256 v[4];  // weights 0-7, 8-15, 16-23, 24-31
};

static inline __m256 u8_to_ps(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
static inline __m256 i8_to_ps(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }
static inline __m256 bf16_to_ps(__m128i h) {  // bf16 is the top half of an fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 32 bytes from 32 bits: byte j is 0xFF where bit j is set (byte j reads source byte j / 8, then tests bit j % 8)
static inline __m256i bytes_from_bits(const uint8_t* bits) {
  uint32_t x;
  std::memcpy(&x, bits, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int(x)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i all_but_bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, all_but_bit), _mm256_set1_epi64x(-1));
}

// codes_at's 32 codes in one register.
template <int KIND, int P>
static inline __m256i codes32(const QWeight& w, int64_t n, int64_t b) {
  const uint8_t* row = w.qs + n * w.qs_stride;
  if constexpr (KIND == pipellm::Q4) {
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
    const __m128i mask = _mm_set1_epi8(15);
    __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), mask), _mm_and_si128(p, mask));
    const uint8_t* h = w.qh + n * w.qh_stride + b * 4 * P;
    for (int pl = 0; pl < P; pl++)
      c = _mm256_or_si256(c, _mm256_and_si256(bytes_from_bits(h + 4 * pl), _mm256_set1_epi8(char(16 << pl))));
    return c;
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
  }
}

// The 32 codes of block b of row n as fp32, in weight order: Q4 unsigned (bit planes included, offset not), Q8
// signed. A 4-bit block is two widenings of 8 bytes, each byte then split into its two weights in 32-bit lanes:
// cross-lane shuffles are the scarce instructions here.
template <int KIND, int P>
static inline void codes_ps(const QWeight& w, int64_t n, int64_t b, __m256* v) {
  const uint8_t* row = w.qs + n * w.qs_stride;
  if constexpr (KIND == pipellm::Q4 && P == 0) {
    const __m256i mask = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; h++) {  // bytes 8h .. 8h+7: weights 8h .. 8h+7 (low nibbles) and 16+8h .. (high)
      const __m128i* at = reinterpret_cast<const __m128i*>(row + b * 16 + 8 * h);
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(at));
      v[h] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, mask));
      v[h + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    }
  } else if constexpr (KIND == pipellm::Q4) {
    const __m256i c = codes32<KIND, P>(w, n, b);
    const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
    v[0] = u8_to_ps(lo);
    v[1] = u8_to_ps(_mm_srli_si128(lo, 8));
    v[2] = u8_to_ps(hi);
    v[3] = u8_to_ps(_mm_srli_si128(hi, 8));
  } else {
    for (int c = 0; c < 4; c++)
      v[c] = i8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + b * 32 + 8 * c)));
  }
}

template <int KIND, int GROUP, int SK, bool MIN, int P>
static inline Block expand_vec(const QWeight& w, int64_t n, int64_t b) {
  const uint8_t* row = w.qs + n * w.qs_stride;
  Block out;
  if constexpr (KIND == pipellm::F16 || KIND == pipellm::BF16) {
    const __m128i* p = reinterpret_cast<const __m128i*>(row + b * 64);
    for (int c = 0; c < 4; c++) {
      const __m128i h = _mm_loadu_si128(p + c);
      out.v[c] = KIND == pipellm::F16 ? _mm256_cvtph_ps(h) : bf16_to_ps(h);
    }
    return out;
  } else {
    if constexpr (KIND == pipellm::Q4 && P == 0) {
      codes_ps<KIND, P>(w, n, b, out.v);
    } else if constexpr (KIND == pipellm::Q4) {
      const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      const __m128i mask = _mm_set1_epi8(15);
      __m128i lo = _mm_and_si128(p, mask), hi = _mm_and_si128(_mm_srli_epi16(p, 4), mask);
      // bits 4 (and 5) from the planes, then the offset: codes fit int8 either way
      const uint8_t* h = w.qh + n * w.qh_stride + b * 4 * P;
      for (int pl = 0; pl < P; pl++) {
        const __m256i bits = _mm256_and_si256(bytes_from_bits(h + 4 * pl), _mm256_set1_epi8(char(16 << pl)));
        lo = _mm_or_si128(lo, _mm256_castsi256_si128(bits));
        hi = _mm_or_si128(hi, _mm256_extracti128_si256(bits, 1));
      }
      const __m128i off = _mm_set1_epi8(char(w.offset));
      lo = _mm_sub_epi8(lo, off);
      hi = _mm_sub_epi8(hi, off);
      out.v[0] = i8_to_ps(lo);
      out.v[1] = i8_to_ps(_mm_srli_si128(lo, 8));
      out.v[2] = i8_to_ps(hi);
      out.v[3] = i8_to_ps(_mm_srli_si128(hi, 8));
    } else {
      codes_ps<KIND, P>(w, n, b, out.v);
    }
    constexpr int G = 32 / GROUP;
    const int64_t g0 = n * w.s_stride + b * G;
    for (int g = 0; g < G; g++) {
      const __m256 s = _mm256_set1_ps(scale_at<SK>(w, g0 + g));
      const __m256 m = _mm256_set1_ps(MIN ? min_at<SK>(w, g0 + g) : 0.0f);
      for (int c = g * 4 / G; c < (g + 1) * 4 / G; c++)
        out.v[c] = MIN ? _mm256_fmadd_ps(out.v[c], s, m) : _mm256_mul_ps(out.v[c], s);
    }
    return out;
  }
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Weight rows n .. n+J-1 against activation rows 0 .. R-1, blocks b0 .. b1-1 (added to y unless b0 is 0): one
// expansion of each weight block serves R rows, one load of an activation vector serves J weight rows.
template <int KIND, int GROUP, int SK, bool MIN, int P, int R, int J>
static inline void gemm_tile(const QWeight& w, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n,
                             int64_t b0, int64_t b1) {
  // A chain of FMAs into one register waits ~4 cycles a link: with few chains, each keeps several partial sums
  // so that independent FMAs fill the pipeline (3x faster for one row).
  constexpr int A = R * J == 1 ? 4 : (R * J == 2 ? 2 : 1);
  __m256 acc[J][R][A];
  for (int j = 0; j < J; j++)
    for (int r = 0; r < R; r++)
      for (int a = 0; a < A; a++) acc[j][r][a] = _mm256_setzero_ps();
  for (int64_t b = b0; b < b1; b++) {
    Block wb[J];
    for (int j = 0; j < J; j++) wb[j] = expand_vec<KIND, GROUP, SK, MIN, P>(w, n + j, b);
    for (int r = 0; r < R; r++) {
      const float* xr = x + r * ldx + b * 32;
      for (int c = 0; c < 4; c++) {
        const __m256 xv = _mm256_loadu_ps(xr + 8 * c);
        for (int j = 0; j < J; j++) acc[j][r][c % A] = _mm256_fmadd_ps(wb[j].v[c], xv, acc[j][r][c % A]);
      }
    }
  }
  for (int j = 0; j < J; j++)
    for (int r = 0; r < R; r++) {
      for (int a = 1; a < A; a++) acc[j][r][0] = _mm256_add_ps(acc[j][r][0], acc[j][r][a]);
      y[r * ldy + n + j] = (b0 ? y[r * ldy + n + j] : 0.0f) + hsum(acc[j][r][0]);
    }
}

// Weight rows n .. n+J-1 (codes, and fp16 scales and mins) on their way to L2. A weight matrix comes from memory
// once a step, so the first tile pass over a chunk asks for the next chunk's rows: with two weight rows a tile
// (AVX-512) the hardware prefetchers alone left the tiles waiting (the LM head's 28 MB of Q8 codes at 16 rows: 70
// -> 80 GFLOP/s, as fast as the AVX2 code's one row a tile; BENCHMARKS.md).
// An asm statement: GCC 12 compiled this function's loops of _mm_prefetch to nothing at all where the scales' loop
// is there (fp16 scales: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), at -O1 too.
static inline void prefetch_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

template <int SK, bool MIN>
static inline void prefetch_rows(const QWeight& w, int64_t n, int J) {
  const char* codes = reinterpret_cast<const char*>(w.qs + n * w.qs_stride);
  for (int64_t i = 0; i < J * w.qs_stride; i += 64) prefetch_l2(codes + i);
  if constexpr (SK == pipellm::SCALE_F16)
    for (int64_t i = 0; i < J * w.s_stride * 2; i += 64) {
      prefetch_l2(static_cast<const char*>(w.scale) + n * w.s_stride * 2 + i);
      if (MIN) prefetch_l2(static_cast<const char*>(w.min) + n * w.s_stride * 2 + i);
    }
}

// Weight rows n0 .. n1-1 against R activation rows, NJ weight rows a tile; rows up to n_end a chunk ahead prefetched.
template <int KIND, int GROUP, int SK, bool MIN, int P, int R>
static inline void gemm_tiles(const QWeight& w, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n0,
                              int64_t n1, int64_t b0, int64_t b1, int64_t n_end) {
  int64_t n = n0;
  for (; n + NJ <= n1; n += NJ) {
    if (n + NC + NJ <= n_end) prefetch_rows<SK, MIN>(w, n + NC, NJ);
    gemm_tile<KIND, GROUP, SK, MIN, P, R, NJ>(w, x, ldx, y, ldy, n, b0, b1);
  }
  for (; n < n1; n++) gemm_tile<KIND, GROUP, SK, MIN, P, R, 1>(w, x, ldx, y, ldy, n, b0, b1);
}

template <int KIND, int GROUP, int SK, bool MIN, int P>
static void gemm_row_t(const QWeight& w, const float* x, float* y, int64_t n0, int64_t n1);

template <int KIND, int GROUP, int SK, bool MIN, int P>
static void gemm_t(const QWeight& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, int64_t n0,
                   int64_t n1) {
  if constexpr (KIND == pipellm::Q4 || KIND == pipellm::Q8)
    if (M == 1) return gemm_row_t<KIND, GROUP, SK, MIN, P>(w, x, y, n0, n1);
  // Weight rows a chunk at a time, each tile of MR activation rows passing over the chunk: the chunk's codes stay
  // in cache for every tile, and a tile's rows stay in L1 across the chunk (weight row by weight row, the tiles of
  // 16 or 32 rows together overflow L1: 1.4x slower). A long K is taken in slices that keep a tile's rows in L1.
  const int64_t nb = w.K / 32, slices = (nb + KB - 1) / KB, kb = (nb + slices - 1) / slices;
  for (int64_t c0 = n0; c0 < n1; c0 += NC) {
    for (int64_t b0 = 0; b0 < nb; b0 += kb) {
      const int64_t c1 = std::min(c0 + NC, n1), b1 = std::min(b0 + kb, nb);
      for (int64_t m = 0; m < M; m += MR) {
        const float* xm = x + m * ldx;
        float* ym = y + m * ldy;
        const int64_t n_end = m == 0 && b0 == 0 ? n1 : 0;  // the first tile pass over the chunk prefetches
        switch (std::min<int64_t>(M - m, MR)) {
          case 8: gemm_tiles<KIND, GROUP, SK, MIN, P, 8>(w, xm, ldx, ym, ldy, c0, c1, b0, b1, n_end); break;
          case 7: gemm_tiles<KIND, GROUP, SK, MIN, P, 7>(w, xm, ldx, ym, ldy, c0, c1, b0, b1, n_end); break;
          case 6: gemm_tiles<KIND, GROUP, SK, MIN, P, 6>(w, xm, ldx, ym, ldy, c0, c1, b0, b1, n_end); break;
          case 5: gemm_tiles<KIND, GROUP, SK, MIN, P, 5>(w, xm, ldx, ym, ldy, c0, c1, b0, b1, n_end); break;
          case 4: gemm_tiles<KIND, GROUP, SK, MIN, P, 4>(w, xm, ldx, ym, ldy, c0, c1, b0, b1, n_end); break;
          case 3: gemm_tiles<KIND, GROUP, SK, MIN, P, 3>(w, xm, ldx, ym, ldy, c0, c1, b0, b1, n_end); break;
          case 2: gemm_tiles<KIND, GROUP, SK, MIN, P, 2>(w, xm, ldx, ym, ldy, c0, c1, b0, b1, n_end); break;
          case 1: gemm_tiles<KIND, GROUP, SK, MIN, P, 1>(w, xm, ldx, ym, ldy, c0, c1, b0, b1, n_end); break;
        }
      }
    }
  }
}

template <int KIND, int GROUP, int SK, bool MIN, int P>
static void dequant_t(const QWeight& w, const int64_t* rows, int64_t R, float* out) {
  const int64_t nb = w.K / 32;
  for (int64_t i = 0; i < R; i++)
    for (int64_t b = 0; b < nb; b++) {
      const Block wb = expand_vec<KIND, GROUP, SK, MIN, P>(w, rows[i], b);
      for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + i * w.K + b * 32 + 8 * c, wb.v[c]);
    }
}
#else

template <int KIND, int GROUP, int SK, bool MIN, int P>
static void gemm_t(const QWeight& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, int64_t n0,
                   int64_t n1) {
  const int64_t nb = w.K / 32;
  alignas(64) float wb[32];
  for (int64_t n = n0; n < n1; n++) {
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int mr = M - m0 < MR ? int(M - m0) : MR;
      alignas(64) float acc[MR][8] = {};
      for (int64_t b = 0; b < nb; b++) {
        expand<KIND, GROUP, SK, MIN, P>(w, n, b, wb);
        for (int r = 0; r < mr; r++) {
          const float* xr = x + (m0 + r) * ldx + b * 32;
          // 8 partial sums a row: one vector register each with AVX2
          for (int c = 0; c < 4; c++)
            for (int l = 0; l < 8; l++) acc[r][l] += wb[c * 8 + l] * xr[c * 8 + l];
        }
      }
      for (int r = 0; r < mr; r++) {
        float s = 0;
        for (int l = 0; l < 8; l++) s += acc[r][l];
        y[(m0 + r) * ldy + n] = s;
      }
    }
  }
}

template <int KIND, int GROUP, int SK, bool MIN, int P>
static void dequant_t(const QWeight& w, const int64_t* rows, int64_t R, float* out) {
  const int64_t nb = w.K / 32;
  for (int64_t i = 0; i < R; i++)
    for (int64_t b = 0; b < nb; b++) expand<KIND, GROUP, SK, MIN, P>(w, rows[i], b, out + i * w.K + b * 32);
}

#endif  // PIPELLM_AVX2

// ---- 8-bit activations times Q4/Q8 codes, in integers (as llama.cpp's Q8_0 dot products) ----

static inline uint16_t float_to_half(float f) {
#ifdef __F16C__
  return _cvtss_sh(f, 0);  // round to nearest even, as numpy's astype(float16)
#else
  _Float16 h = (_Float16)f;
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
#endif
}

// Rows m0 .. m1-1 of x [M, K] rounded as GGUF's Q8_0 rounds a block of 32: d = max |x| / 127, q = x / d rounded
// half away from zero (gguf's np_roundf, written so that it vectorizes), d kept as fp16. `rounded`, if given, gets
// q * d in fp32: the same activations for the path that expands weights for torch's matmul.
void quantize_acts(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, float* d, float* ds,
                   float* ds32, float* rounded) {
  const int64_t nb = K / 32;
  for (int64_t m = m0; m < m1; m++)
    for (int64_t b = 0; b < nb; b++) {
      const float* xb = x + m * ldx + b * 32;
      float amax = 0;
      for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(xb[j]));
      const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
      float v[32];
      for (int j = 0; j < 32; j++) {
        const float t = std::fabs(xb[j] * id), f = std::floor(t);
        v[j] = std::copysign(f + std::floor(2.0f * (t - f)), xb[j]);
      }
      int8_t* qb = q + m * K + b * 32;
      int sum0 = 0, sum1 = 0;
      for (int j = 0; j < 16; j++) sum0 += (qb[j] = int8_t(v[j]));
      for (int j = 16; j < 32; j++) sum1 += (qb[j] = int8_t(v[j]));
      const float df = half_to_float(float_to_half(dd));
      d[m * nb + b] = df;
      ds[m * 2 * nb + 2 * b] = df * float(sum0);
      ds[m * 2 * nb + 2 * b + 1] = df * float(sum1);
      ds32[m * nb + b] = df * float(sum0 + sum1);
      if (rounded)
        for (int j = 0; j < 32; j++) rounded[m * K + b * 32 + j] = v[j] * df;
    }
}

// Block b of row n as w = code * s[g] + c[g] per group g, the code before any offset (5- and 6-bit codes carry it
// in c, with the min).
template <int GROUP, int SK, bool MIN, int P>
static inline void block_consts(const QWeight& w, int64_t n, int64_t b, float* s, float* c) {
  constexpr int G = 32 / GROUP;
  const int64_t g0 = n * w.s_stride + b * G;
  for (int g = 0; g < G; g++) {
    s[g] = scale_at<SK>(w, g0 + g);
    c[g] = (MIN ? min_at<SK>(w, g0 + g) : 0.0f) - (P > 0 ? float(w.offset) * s[g] : 0.0f);
  }
}

#ifdef PIPELLM_AVX2
// Scales and constants (block_consts) of blocks b0 .. b0+7 of row n, 8 or 16 groups: vector loads where the
// layout allows, else one block at a time.
template <int GROUP, int SK, bool MIN, int P>
static inline void chunk_consts(const QWeight& w, int64_t n, int64_t b0, float* s, float* c) {
  constexpr int G = 32 / GROUP;
  const int64_t g0 = n * w.s_stride + b0 * G;
  __m256 sv[G], mv[G];
  auto bytes8 = [](const void* p) { return _mm_loadl_epi64(static_cast<const __m128i*>(p)); };  // 8 bytes
  if constexpr (SK == pipellm::SCALE_F16) {
    auto load16 = [&](const void* p, int h) {  // 8 fp16s from group g0 + 8h on
      const uint16_t* at = static_cast<const uint16_t*>(p) + g0 + 8 * h;
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    };
    for (int h = 0; h < G; h++) {
      sv[h] = load16(w.scale, h);
      mv[h] = MIN ? load16(w.min, h) : _mm256_setzero_ps();
    }
  } else if constexpr (SK == pipellm::SCALE_F32) {
    for (int h = 0; h < G; h++) {
      sv[h] = _mm256_loadu_ps(static_cast<const float*>(w.scale) + g0 + 8 * h);
      mv[h] = MIN ? _mm256_loadu_ps(static_cast<const float*>(w.min) + g0 + 8 * h) : _mm256_setzero_ps();
    }
  } else if constexpr (SK == pipellm::SCALE_TWO_LEVEL) {  // 8 groups of 32 = one super-block
    const int64_t sb = g0 / 8;
    sv[0] = _mm256_mul_ps(_mm256_set1_ps(half_to_float(static_cast<const uint16_t*>(w.super_scale)[sb])),
                          u8_to_ps(bytes8(static_cast<const uint8_t*>(w.scale) + g0)));
    mv[0] = MIN ? _mm256_mul_ps(_mm256_set1_ps(-half_to_float(static_cast<const uint16_t*>(w.super_min)[sb])),
                                u8_to_ps(bytes8(static_cast<const uint8_t*>(w.min) + g0)))
                : _mm256_setzero_ps();
  } else {  // SCALE_TWO_LEVEL_I8: 16 groups of 16 = one super-block
    const __m256 d = _mm256_set1_ps(half_to_float(static_cast<const uint16_t*>(w.super_scale)[g0 / 16]));
    for (int h = 0; h < G; h++) {
      sv[h] = _mm256_mul_ps(d, i8_to_ps(bytes8(static_cast<const int8_t*>(w.scale) + g0 + 8 * h)));
      mv[h] = _mm256_setzero_ps();
    }
  }
  for (int h = 0; h < G; h++) {
    _mm256_storeu_ps(s + 8 * h, sv[h]);
    _mm256_storeu_ps(c + 8 * h, P > 0 ? _mm256_fnmadd_ps(_mm256_set1_ps(float(w.offset)), sv[h], mv[h]) : mv[h]);
  }
}

#ifdef __AVX512F__
// Block b of row n's codes (Q4 with any bit planes, or Q8) as fp32 in 16 lanes: codes 0-15 in lo, 16-31 in hi
template <int KIND, int P>
static inline void codes16(const QWeight& w, int64_t n, int64_t b, __m512& lo, __m512& hi) {
  const uint8_t* row = w.qs + n * w.qs_stride;
  if constexpr (KIND == pipellm::Q4 && P == 0) {  // byte k holds weight k (low nibble) and k + 16 (high)
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  } else if constexpr (KIND == pipellm::Q4) {  // the codes put together as bytes first, then widened
    const __m256i c = codes32<KIND, P>(w, n, b);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(c)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(c, 1)));
  } else {
    const __m128i* at = reinterpret_cast<const __m128i*>(row + b * 32);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at + 1)));
  }
}

// Scales and constants of blocks b0 .. b0+nbk-1 of row n (nbk <= 8): chunk_consts for a whole chunk, else a block
// at a time
template <int GROUP, int SK, bool MIN, int P>
static inline void consts_upto8(const QWeight& w, int64_t n, int64_t b0, int nbk, float* s, float* c) {
  constexpr int G = 32 / GROUP;
  if (nbk == 8)
    chunk_consts<GROUP, SK, MIN, P>(w, n, b0, s, c);
  else
    for (int j = 0; j < nbk; j++) block_consts<GROUP, SK, MIN, P>(w, n, b0 + j, s + G * j, c + G * j);
}

// Block b of row n (Q4 or Q8) as weights in 16 lanes: codes widened, times their group's scale s plus its constant
// c in one FMA (s and c: the block's group, or its two groups of 16). Without an offset (P == 0), the values
// expand_vec gives.
template <int KIND, int GROUP, int P>
static inline void wide_block(const QWeight& w, int64_t n, int64_t b, const float* s, const float* c, __m512& lo,
                              __m512& hi) {
  constexpr int G = 32 / GROUP;
  codes16<KIND, P>(w, n, b, lo, hi);
  lo = _mm512_fmadd_ps(lo, _mm512_set1_ps(s[0]), _mm512_set1_ps(c[0]));
  hi = _mm512_fmadd_ps(hi, _mm512_set1_ps(s[G - 1]), _mm512_set1_ps(c[G - 1]));
}

// Blocks b0 .. b0+nbk-1 of row n's codes (Q4 with any bit planes, or Q8 in groups of 32) dotted with x, each group
// times its scale in s[], added to z0 and z1 (a sum a block, in turn, would wait on the FMA's latency; groups of 16
// have a sum each). 16 lanes halve the instructions of a block, which bound the 8-lane loop.
template <int KIND, int GROUP, int P>
static inline void blocks_dot16(const QWeight& w, int64_t n, const float* x, const float* s, int64_t b0, int nbk,
                                __m512& z0, __m512& z1) {
  for (int j = 0; j < nbk; j++) {
    const int64_t b = b0 + j;
    __m512 lo, hi;  // weights 0-15 and 16-31 of the block
    codes16<KIND, P>(w, n, b, lo, hi);
    const float* xb = x + b * 32;
    if constexpr (GROUP == 16) {
      z0 = _mm512_fmadd_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(xb)), _mm512_set1_ps(s[2 * j]), z0);
      z1 = _mm512_fmadd_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(xb + 16)), _mm512_set1_ps(s[2 * j + 1]), z1);
    } else {
      const __m512 d = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
      if (j & 1)
        z1 = _mm512_fmadd_ps(d, _mm512_set1_ps(s[j]), z1);
      else
        z0 = _mm512_fmadd_ps(d, _mm512_set1_ps(s[j]), z0);
    }
  }
}
#endif

// One fp32 activation row: y[n] = sum over groups of s * (codes . x) + c * sum(x). A group's scale multiplies its
// dot product once instead of every weight, and the constant's share comes from the row's group sums, computed
// once for all weight rows. (Expanding a block to weights pays only when several rows share the expansion.)
template <int KIND, int GROUP, int SK, bool MIN, int P>
static void gemm_row_t(const QWeight& w, const float* x, float* y, int64_t n0, int64_t n1) {
  constexpr int G = 32 / GROUP;
  const int64_t nb = w.K / 32;
  thread_local std::vector<float> sums;
  if constexpr (MIN || P > 0) {
    sums.resize(size_t(nb * G));
    for (int64_t g = 0; g < nb * G; g++) {
      __m256 t = _mm256_loadu_ps(x + g * GROUP);
      for (int j = 8; j < GROUP; j += 8) t = _mm256_add_ps(t, _mm256_loadu_ps(x + g * GROUP + j));
      sums[g] = hsum(t);
    }
  }
  alignas(32) float s[8 * G], c[8 * G];
#ifdef __AVX512F__
  constexpr bool WIDE = KIND == pipellm::Q4 || (KIND == pipellm::Q8 && GROUP == 32);
#else
  constexpr bool WIDE = false;
#endif
  for (int64_t n = n0; n < n1; n++) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), accc = _mm256_setzero_ps();
#ifdef __AVX512F__
    __m512 z0 = _mm512_setzero_ps(), z1 = _mm512_setzero_ps();
#endif
    float cst = 0.0f;
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
      const int nbk = int(std::min<int64_t>(8, nb - b0));
      if (nbk == 8) {
        chunk_consts<GROUP, SK, MIN, P>(w, n, b0, s, c);
        if constexpr (MIN || P > 0)
          for (int h = 0; h < G; h++)
            accc = _mm256_fmadd_ps(_mm256_load_ps(c + 8 * h), _mm256_loadu_ps(sums.data() + b0 * G + 8 * h), accc);
      } else {
        for (int j = 0; j < nbk; j++) block_consts<GROUP, SK, MIN, P>(w, n, b0 + j, s + G * j, c + G * j);
        if constexpr (MIN || P > 0)
          for (int j = 0; j < nbk * G; j++) cst += c[j] * sums[b0 * G + j];
      }
#ifdef __AVX512F__
      if constexpr (WIDE) {
        blocks_dot16<KIND, GROUP, P>(w, n, x, s, b0, nbk, z0, z1);
        continue;
      }
#endif
      for (int j = 0; j < nbk; j++) {
        __m256 v[4];
        codes_ps<KIND, P>(w, n, b0 + j, v);
        const float* xb = x + (b0 + j) * 32;
        // two chains, a group each when groups are 16 weights
        __m256 d0 = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
        __m256 d1 = _mm256_mul_ps(v[2], _mm256_loadu_ps(xb + 16));
        d0 = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), d0);
        d1 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), d1);
        acc0 = _mm256_fmadd_ps(d0, _mm256_broadcast_ss(s + G * j), acc0);
        acc1 = _mm256_fmadd_ps(d1, _mm256_broadcast_ss(s + G * j + G - 1), acc1);
      }
    }
    float wide = 0.0f;
#ifdef __AVX512F__
    if constexpr (WIDE) wide = _mm512_reduce_add_ps(_mm512_add_ps(z0, z1));
#endif
    y[n] = hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), accc)) + cst + wide;
  }
}

// Activation row m against weight row n. Per chunk of 8 blocks: the weight's scales and constants, the row's scale
// products and the constants' share (c . d * sum(codes)); per block one integer dot product. (For more rows the
// integer products gain nothing here: maddubs and madd take the FMA's place, two instructions for its one.)
template <int KIND, int GROUP, int SK, bool MIN, int P>
static inline float gemm_q8_row(const QWeight& w, const QActs& a, int64_t m, int64_t n) {
  constexpr int G = 32 / GROUP;
  const int64_t nb = a.K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  float cst = 0.0f;
  alignas(32) float s[8 * G], c[8 * G], f[8 * G];
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int nbk = int(std::min<int64_t>(8, nb - b0));
    const float* d = a.d + m * nb + b0;
    if (nbk == 8 && G == 1) {
      chunk_consts<GROUP, SK, MIN, P>(w, n, b0, s, c);
      _mm256_store_ps(f, _mm256_mul_ps(_mm256_load_ps(s), _mm256_loadu_ps(d)));
      if constexpr (MIN || P > 0)
        acc = _mm256_fmadd_ps(_mm256_load_ps(c), _mm256_loadu_ps(a.ds32 + m * nb + b0), acc);
    } else {
      if (nbk == 8) chunk_consts<GROUP, SK, MIN, P>(w, n, b0, s, c);
      else for (int j = 0; j < nbk; j++) block_consts<GROUP, SK, MIN, P>(w, n, b0 + j, s + G * j, c + G * j);
      for (int j = 0; j < nbk * G; j++) {
        f[j] = s[j] * d[j / G];
        if constexpr (MIN || P > 0) cst += c[j] * (G == 1 ? a.ds32[m * nb + b0 + j] : a.ds[m * 2 * nb + 2 * b0 + j]);
      }
    }
    for (int j = 0; j < nbk; j++) {
      const int64_t b = b0 + j;
      const __m256i cw = codes32<KIND, P>(w, n, b);
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + m * a.K + b * 32));
      // maddubs multiplies unsigned by signed bytes: signed codes lend their sign to the activations
      const __m256i dot = KIND == pipellm::Q4
          ? _mm256_madd_epi16(_mm256_maddubs_epi16(cw, xv), ones)
          : _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(cw, cw), _mm256_sign_epi8(xv, cw)), ones);
      // int32 lane i sums weights 4i .. 4i+3: with groups of 16, lanes 0-3 are the block's first group
      const __m256 fv = G == 1 ? _mm256_broadcast_ss(&f[j])
                               : _mm256_setr_m128(_mm_broadcast_ss(&f[2 * j]), _mm_broadcast_ss(&f[2 * j + 1]));
      if (j & 1)  // two sums in turn: one would wait on the FMA's latency every block
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), fv, acc1);
      else
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), fv, acc);
    }
  }
  return hsum(_mm256_add_ps(acc, acc1)) + cst;
}

template <int KIND, int GROUP, int SK, bool MIN, int P>
static void gemm_q8_t(const QWeight& w, const QActs& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if constexpr (KIND == pipellm::Q4 || KIND == pipellm::Q8)
    for (int64_t n = n0; n < n1; n++)
      for (int64_t m = 0; m < a.M; m++) y[m * ldy + n] = gemm_q8_row<KIND, GROUP, SK, MIN, P>(w, a, m, n);
}
#else

template <int KIND, int GROUP, int SK, bool MIN, int P>
static void gemm_q8_t(const QWeight& w, const QActs& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if constexpr (KIND == pipellm::Q4 || KIND == pipellm::Q8) {
    constexpr int G = 32 / GROUP;
    const int64_t nb = a.K / 32;
    std::vector<float> acc(a.M);
    int code[32];
    for (int64_t n = n0; n < n1; n++) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = 0; b < nb; b++) {
        codes_at<KIND, P>(w, n, b, code);
        float s[G], k[G];
        block_consts<GROUP, SK, MIN, P>(w, n, b, s, k);
        for (int64_t m = 0; m < a.M; m++) {
          const int8_t* xq = a.q + m * a.K + b * 32;
          const float* ds = a.ds + m * 2 * nb + 2 * b;
          for (int g = 0; g < G; g++) {
            int dot = 0;
            for (int j = g * GROUP; j < (g + 1) * GROUP; j++) dot += code[j] * xq[j];
            acc[m] += s[g] * a.d[m * nb + b] * float(dot) + k[g] * (G == 1 ? a.ds32[m * nb + b] : ds[g]);
          }
        }
      }
      for (int64_t m = 0; m < a.M; m++) y[m * ldy + n] = acc[m];
    }
  }
}

#endif  // PIPELLM_AVX2

constexpr int F16S = pipellm::SCALE_F16, F32S = pipellm::SCALE_F32, TWO = pipellm::SCALE_TWO_LEVEL,
              TWO_I8 = pipellm::SCALE_TWO_LEVEL_I8;

// The layouts that GGUF's types and our own quantization produce; anything else is refused by ops.cpp first.
// With bit planes: Q5_0 and Q5_1 (fp16 scales, offset 16 or a min), Q5_K (two-level), Q6_K (int8 two-level per
// 16, offset 32).
#define PIPELLM_DISPATCH(FN, ...)                                                      \
  switch (w.kind) {                                                                    \
    case pipellm::F16: return FN<pipellm::F16, 32, false, false, 0>(__VA_ARGS__);      \
    case pipellm::BF16: return FN<pipellm::BF16, 32, false, false, 0>(__VA_ARGS__);    \
    case pipellm::Q4:                                                                  \
      if (w.planes == 2) return FN<pipellm::Q4, 16, TWO_I8, false, 2>(__VA_ARGS__);   \
      if (w.planes == 1) {                                                             \
        if (w.scale_kind == TWO) return FN<pipellm::Q4, 32, TWO, true, 1>(__VA_ARGS__); \
        if (w.min) return FN<pipellm::Q4, 32, F16S, true, 1>(__VA_ARGS__);             \
        return FN<pipellm::Q4, 32, F16S, false, 1>(__VA_ARGS__);                       \
      }                                                                                \
      if (w.scale_kind == TWO) return FN<pipellm::Q4, 32, TWO, true, 0>(__VA_ARGS__);     \
      if (w.scale_kind == F32S) return FN<pipellm::Q4, 32, F32S, true, 0>(__VA_ARGS__);   \
      if (w.min) return FN<pipellm::Q4, 32, F16S, true, 0>(__VA_ARGS__);                  \
      return FN<pipellm::Q4, 32, F16S, false, 0>(__VA_ARGS__);                            \
    default:                                                                           \
      if (w.group == 16) {                                                             \
        if (w.scale_kind == F32S) return FN<pipellm::Q8, 16, F32S, false, 0>(__VA_ARGS__); \
        return FN<pipellm::Q8, 16, F16S, false, 0>(__VA_ARGS__);                          \
      }                                                                                \
      if (w.scale_kind == TWO) return FN<pipellm::Q8, 32, TWO, true, 0>(__VA_ARGS__);     \
      if (w.scale_kind == F32S && w.min) return FN<pipellm::Q8, 32, F32S, true, 0>(__VA_ARGS__); \
      if (w.scale_kind == F32S) return FN<pipellm::Q8, 32, F32S, false, 0>(__VA_ARGS__);  \
      if (w.min) return FN<pipellm::Q8, 32, F16S, true, 0>(__VA_ARGS__);                  \
      return FN<pipellm::Q8, 32, F16S, false, 0>(__VA_ARGS__);                            \
  }

void gemm(const QWeight& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  PIPELLM_DISPATCH(gemm_t, w, x, M, ldx, y, ldy, n0, n1)
}

void dequant(const QWeight& w, const int64_t* rows, int64_t R, float* out) {
  PIPELLM_DISPATCH(dequant_t, w, rows, R, out)
}

void gemm_q8(const QWeight& w, const QActs& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  PIPELLM_DISPATCH(gemm_q8_t, w, a, y, ldy, n0, n1)
}

template <int C> struct CacheElem;
template <> struct CacheElem<pipellm::CACHE_F32> { using T = float; };
template <> struct CacheElem<pipellm::CACHE_BF16> { using T = uint16_t; };
template <> struct CacheElem<pipellm::CACHE_I8> { using T = int8_t; };

template <typename T> static inline float cache_value(T x) {
  if constexpr (std::is_same_v<T, uint16_t>) return bf16_to_float(x);
  else return float(x);
}

#ifdef PIPELLM_AVX2
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) { return bf16_to_ps(_mm_loadu_si128((const __m128i*)p)); }  // bf16
static inline __m256 load8(const int8_t* p) { return i8_to_ps(_mm_loadl_epi64((const __m128i*)p)); }
#endif

// q . k and acc += e * v over one cached row of D values, D a multiple of 8 on the SIMD path.
template <typename T> static inline float row_dot(const float* q, const T* k, int64_t D) {
  int64_t i = 0;
  float dot = 0;
#ifdef PIPELLM_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();  // two chains: an FMA's latency is ~4 cycles
  for (; i + 16 <= D; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k + i + 8), s1);
  }
  for (; i + 8 <= D; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), s0);
  dot = hsum(_mm256_add_ps(s0, s1));
#endif
  for (; i < D; i++) dot += q[i] * cache_value(k[i]);
  return dot;
}

#ifdef PIPELLM_AVX2
// e^x for x <= 0 (scores less their running max), as Cephes' expf: x = n ln2 + r, e^r by a degree-6 polynomial
// (within 2 ulp), times 2^n built in the exponent bits. Below -87 it gives ~1e-38 rather than 0.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts keeps r exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

// s[i] = e^(s[i] - mx) for i < n; returns their sum
static inline float exp_shifted(float* s, int64_t n, float mx) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef PIPELLM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; i++) sum += s[i] = std::exp(s[i] - mx);
  return sum;
}

// max(init, s[0], ..., s[n - 1])
static inline float max_of(const float* s, int64_t n, float init) {
  int64_t i = 0;
#ifdef PIPELLM_AVX2
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 h2 = _mm_max_ps(h, _mm_movehl_ps(h, h));
    init = std::max(init, _mm_cvtss_f32(_mm_max_ss(h2, _mm_shuffle_ps(h2, h2, 1))));
  }
#endif
  for (; i < n; i++) init = std::max(init, s[i]);
  return init;
}

template <typename T> static inline void row_axpy(float* acc, float e, const T* v, int64_t D) {
  int64_t i = 0;
#ifdef PIPELLM_AVX2
  const __m256 ev = _mm256_set1_ps(e);
  for (; i + 8 <= D; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(ev, load8(v + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < D; i++) acc[i] += e * cache_value(v[i]);
}

#ifdef PIPELLM_AVX2
// [sum(a[0]), sum(a[1]), sum(a[2]), sum(a[3])]: a transpose-and-add tree, ~1 instruction a sum where hsum takes ~5
static inline __m128 hsum4(const __m256* a) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}
#endif

// The query heads of one KV head in groups of up to HEAD_GROUP, each cached row's values loaded once for all heads
// of a group: a span's rows come from L2 (the stream below puts them there), and loading them once per query head
// tripled that traffic at the default model's 3 heads a KV head.
constexpr int64_t HEAD_GROUP = 3;

// s[j * ld + r] = q[j] . rows[r] * scale for the HG heads j of a group and the n rows of a span: 4 rows at a time
template <int HG, typename T>
static inline void group_scores(const float* q, const T* const* rows, int64_t n, int64_t D, float scale, float* s,
                                int64_t ld, int64_t col) {
  int64_t r = 0;
#ifdef PIPELLM_AVX2
  if (D % 8 == 0)
    for (; r + 4 <= n; r += 4) {
      __m256 acc[HG][4];  // HG x 4 independent FMA chains
      for (int j = 0; j < HG; j++)
        for (int c = 0; c < 4; c++) acc[j][c] = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        __m256 k[4];
        for (int c = 0; c < 4; c++) k[c] = load8(rows[r + c] + col + i);
        for (int j = 0; j < HG; j++) {
          const __m256 qv = _mm256_loadu_ps(q + j * D + i);
          for (int c = 0; c < 4; c++) acc[j][c] = _mm256_fmadd_ps(qv, k[c], acc[j][c]);
        }
      }
      for (int j = 0; j < HG; j++) _mm_storeu_ps(s + j * ld + r, _mm_mul_ps(hsum4(acc[j]), _mm_set1_ps(scale)));
    }
#endif
  for (; r < n; r++)
    for (int j = 0; j < HG; j++) s[j * ld + r] = row_dot(q + j * D, rows[r] + col, D) * scale;
}

// acc[j] = acc[j] * corr[j] + sum_r e[j * ld + r] * scale * rows[r] for the HG heads j of a group (acc[j] at
// acc + j * D): a quarter of the row (32 values) at a time, held in registers across the span's rows
template <int HG, typename T>
static inline void group_axpy(float* acc, const float* corr, const float* e, int64_t ld, const T* const* rows,
                              int64_t n, float scale, int64_t D, int64_t col) {
#ifdef PIPELLM_AVX2
  if (D % 32 == 0) {
    for (int64_t i0 = 0; i0 < D; i0 += 32) {
      __m256 a[HG][4];
      for (int j = 0; j < HG; j++)
        for (int c = 0; c < 4; c++)
          a[j][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + j * D + i0 + 8 * c), _mm256_set1_ps(corr[j]));
      for (int64_t r = 0; r < n; r++) {
        __m256 v[4];
        for (int c = 0; c < 4; c++) v[c] = load8(rows[r] + col + i0 + 8 * c);
        for (int j = 0; j < HG; j++) {
          const __m256 ev = _mm256_set1_ps(e[j * ld + r] * scale);
          for (int c = 0; c < 4; c++) a[j][c] = _mm256_fmadd_ps(ev, v[c], a[j][c]);
        }
      }
      for (int j = 0; j < HG; j++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + j * D + i0 + 8 * c, a[j][c]);
    }
    return;
  }
#endif
  for (int j = 0; j < HG; j++) {
    for (int64_t i = 0; i < D; i++) acc[j * D + i] *= corr[j];
    for (int64_t r = 0; r < n; r++) row_axpy(acc + j * D, e[j * ld + r] * scale, rows[r] + col, D);
  }
}

// f(hg, j0) for j0 = 0, HEAD_GROUP, ... and hg = min(HEAD_GROUP, G - j0), the group's size as a constant
template <typename F> static inline void for_head_groups(int64_t G, F&& f) {
  static_assert(HEAD_GROUP == 3, "one branch per group size");
  for (int64_t j0 = 0; j0 < G; j0 += HEAD_GROUP) {
    const int64_t hg = std::min(HEAD_GROUP, G - j0);
    if (hg == 3) f(std::integral_constant<int, 3>{}, j0);
    else if (hg == 2) f(std::integral_constant<int, 2>{}, j0);
    else f(std::integral_constant<int, 1>{}, j0);
  }
}

constexpr int64_t SPAN_BLOCKS = 4;  // blocks of keys per online-softmax update (fp32 and bf16 caches)
static_assert(pipellm::DECODE_CHUNK_BLOCKS % SPAN_BLOCKS == 0, "chunks must hold whole spans");

// Reads n cache blocks of `bytes` each before the kernel reads them row by row and head by head, and prefetches the
// nn blocks of the span after into L2. A plain stream of loads is what the hardware prefetchers follow: reading the
// rows where the dot products need them reached ~8 GB/s from memory on one core, a stream ~25 GB/s. The blocks are
// read side by side, a line of each in turn, so that a span's 8 blocks (K and V) are 8 streams in flight, and the
// next span's lines are on their way while this span is computed: one layer at 8 x 4,096 tokens 2.0 ms against 3.1
// with the blocks one after another (BENCHMARKS.md).
static inline void stream_blocks(const char* const* blocks, int64_t n, const char* const* next, int64_t nn,
                                 int64_t bytes) {
#ifdef PIPELLM_AVX2
  __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0;
  for (int64_t i = 0; i + 128 <= bytes; i += 128) {
    for (int64_t j = 0; j < n; j++) {
      acc0 = _mm256_or_si256(acc0, _mm256_loadu_si256((const __m256i*)(blocks[j] + i)));
      acc1 = _mm256_or_si256(acc1, _mm256_loadu_si256((const __m256i*)(blocks[j] + i + 64)));
    }
    for (int64_t j = 0; j < nn; j++) {
      _mm_prefetch(next[j] + i, _MM_HINT_T1);
      _mm_prefetch(next[j] + i + 64, _MM_HINT_T1);
    }
  }
  volatile int sink = _mm256_testz_si256(acc0, acc1);  // keeps the loads
  (void)sink;
#else
  (void)blocks, (void)n, (void)next, (void)nn, (void)bytes;
#endif
}

// Attention of one new token per sequence, reading K/V where they lie in the paged caches (no gathered copy).
// A unit is (sequence, chunk of its positions) and covers every head: a block's rows hold all KV heads, so it is
// read once, as a stream. Each KV head's query heads share its rows. Blockwise online softmax in fp32.
// An int8 cache's scale is per block and head: it multiplies a row's dot product, and a row's softmax weight.
template <int C>
void decode_attention_t(const DecodeArgs& a, int64_t u0, int64_t u1) {
  using T = typename CacheElem<C>::T;
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const int64_t H = a.H, KV = a.KV, G = H / KV, D = a.D, bs = a.block_size, row = KV * D;
  // Keys go through the online softmax a span of blocks at a time (an int8 cache's scales are per block: one)
  const int64_t span_blocks = C == pipellm::CACHE_I8 ? 1 : SPAN_BLOCKS, span = span_blocks * bs;
  std::vector<float> acc(H * D), s(G * span), m(H), l(H), corr(G);
  std::vector<const T*> krows(span), vrows(span);
  std::vector<const char*> blocks(4 * span_blocks);
  struct Unit {
    int64_t b, lo, hi;  // its sequence, and the positions it reads: [lo, hi)
    bool whole;         // the sequence's only chunk
    const int64_t* table;
  };
  auto unit = [&](int64_t u) {
    const int64_t b = u / a.num_chunks, c = u % a.num_chunks, len = a.seq_lens[b];
    const int64_t start = pipellm::first_key(len, a.window);
    return Unit{b, std::max(start, c * a.chunk_keys), std::min(len, (c + 1) * a.chunk_keys),
                start / a.chunk_keys == (len - 1) / a.chunk_keys, a.block_tables + b * a.table_width};
  };
  // the K and V blocks of positions [q0, q1) (one span at most) into out; returns how many
  auto span_blocks_of = [&](const int64_t* table, int64_t q0, int64_t q1, const char** out) {
    const int64_t first = q0 / bs, nb = q1 > q0 ? (q1 - 1) / bs - first + 1 : 0;
    for (int64_t j = 0; j < nb; j++) {
      out[2 * j] = (const char*)(k_cache + table[first + j] * bs * row);
      out[2 * j + 1] = (const char*)(v_cache + table[first + j] * bs * row);
    }
    return 2 * nb;
  };
  for (int64_t u = u0; u < u1; u++) {
    const auto [b, lo, hi, whole, table] = unit(u);
    if (lo >= hi) continue;
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(m.begin(), m.end(), -INFINITY);
    std::fill(l.begin(), l.end(), 0.0f);
    for (int64_t p0 = lo; p0 < hi;) {
      const int64_t p1 = std::min(hi, (p0 / span + 1) * span), n = p1 - p0;
      const char** next = blocks.data() + 2 * span_blocks;
      const int64_t nb = span_blocks_of(table, p0, p1, blocks.data());
      int64_t nn = span_blocks_of(table, p1, std::min(hi, p1 + span), next);
      for (int64_t w = u + 1; nn == 0 && w < u1; w++) {  // this unit's last span: the next unit's first
        const Unit x = unit(w);
        nn = span_blocks_of(x.table, x.lo, std::min(x.hi, (x.lo / span + 1) * span), next);
      }
      stream_blocks(blocks.data(), nb, next, nn, bs * row * int64_t(sizeof(T)));
      for (int64_t p = p0; p < p1;) {  // where row p of the span starts, head 0: a block at a time, no division a key
        const int64_t blk = p / bs, end = std::min(p1, (blk + 1) * bs);
        for (int64_t off = (table[blk] * bs + p - blk * bs) * row; p < end; p++, off += row) {
          krows[p - p0] = k_cache + off;
          vrows[p - p0] = v_cache + off;
        }
      }
      const int64_t id = table[p0 / bs];
      for (int64_t g = 0; g < KV; g++) {
        const float ks = C == pipellm::CACHE_I8 ? a.k_scale[id * KV + g] * a.scale : a.scale;
        const float vs = C == pipellm::CACHE_I8 ? a.v_scale[id * KV + g] : 1.0f;
        const float* q = a.q + (b * H + g * G) * D;
        for_head_groups(G, [&](auto hg, int64_t j0) {
          group_scores<decltype(hg)::value>(q + j0 * D, krows.data(), n, D, ks, s.data() + j0 * span, span, g * D);
        });
        if (a.softcap > 0)  // as the layers' torch path: scaled scores / cap, tanh, * cap
          for (int64_t j = 0; j < G; j++)
            for (int64_t i = 0; i < n; i++) s[j * span + i] = a.softcap * std::tanh(s[j * span + i] / a.softcap);
        for (int64_t j = 0; j < G; j++) {
          float* sj = s.data() + j * span;
          const int64_t h = g * G + j;
          const float mx = max_of(sj, n, m[h]);
          corr[j] = std::exp(m[h] - mx);  // 0 on the first span (m = -inf)
          m[h] = mx;
          l[h] = l[h] * corr[j] + exp_shifted(sj, n, mx);
        }
        for_head_groups(G, [&](auto hg, int64_t j0) {
          group_axpy<decltype(hg)::value>(acc.data() + (g * G + j0) * D, corr.data() + j0, s.data() + j0 * span,
                                          span, vrows.data(), n, vs, D, g * D);
        });
      }
      p0 = p1;
    }
    if (whole) {
      for (int64_t h = 0; h < H; h++) {
        float* o = a.out + (b * H + h) * D;
        const float sum = a.sinks ? l[h] + std::exp(a.sinks[h] - m[h]) : l[h];
        for (int64_t i = 0; i < D; i++) o[i] = acc[h * D + i] / sum;
      }
    } else {
      float* part = a.partial + u * H * (D + 2);
      std::copy(acc.begin(), acc.end(), part);
      std::copy(m.begin(), m.end(), part + H * D);
      std::copy(l.begin(), l.end(), part + H * D + H);
    }
  }
}

// ---- a few fp32 rows times a dense [K, N] weight (decode steps of few sequences with fp32 weights) ----
// y[:, n0:n1] += x @ w[:, n0:n1], eight weight rows a pass (then one at a time): one row at ~1.5x the rate at which
// MKL's sgemm reads a one-row product's weights here; each weight vector loaded once serves every row, where sgemm
// of 2-8 rows ran at 19-43 GFLOP/s on one thread (BENCHMARKS.md). Each output sums its products in k order in both
// paths (the vector loop and the scalar tail), so a column's result depends neither on which thread's range holds
// it nor on the other rows. A pass reads a thread's columns of 8 rows, short streams for the hardware prefetchers
// (~3 KB a row at N = 1536), so it prefetches into L2 the same columns of `ahead`'s R rows, two passes on: 1.0-1.3x
// the read rate without.
template <int R>
static inline void dense_rows_pass(const float* x, int64_t ldx, int64_t M, const float* w, int64_t N, float* y,
                                   int64_t ldy, int64_t n0, int64_t n1, const float* ahead) {
  int64_t n = n0;
#ifdef PIPELLM_AVX2
  if (M == 1) {  // the row's R values stay in registers
    __m256 a[R];
    for (int i = 0; i < R; i++) a[i] = _mm256_set1_ps(x[i]);
    for (; n + 8 <= n1; n += 8) {
      __m256 s = _mm256_loadu_ps(y + n);
      if (ahead && n % 16 == 0)  // a 64-byte line a row
        for (int i = 0; i < R; i++) _mm_prefetch((const char*)(ahead + i * N + n), _MM_HINT_T1);
      for (int i = 0; i < R; i++) s = _mm256_fmadd_ps(a[i], _mm256_loadu_ps(w + i * N + n), s);
      _mm256_storeu_ps(y + n, s);
    }
  } else {  // the weights' R vectors stay in registers, each row's values broadcast from memory
    for (; n + 8 <= n1; n += 8) {
      __m256 wv[R];
      if (ahead && n % 16 == 0)
        for (int i = 0; i < R; i++) _mm_prefetch((const char*)(ahead + i * N + n), _MM_HINT_T1);
      for (int i = 0; i < R; i++) wv[i] = _mm256_loadu_ps(w + i * N + n);
      for (int64_t m = 0; m < M; m++) {
        __m256 s = _mm256_loadu_ps(y + m * ldy + n);
        for (int i = 0; i < R; i++) s = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * ldx + i), wv[i], s);
        _mm256_storeu_ps(y + m * ldy + n, s);
      }
    }
  }
#endif
  for (; n < n1; n++)
    for (int64_t m = 0; m < M; m++) {
      float s = y[m * ldy + n];
      for (int i = 0; i < R; i++) s = std::fma(x[m * ldx + i], w[i * N + n], s);
      y[m * ldy + n] = s;
    }
}

#ifdef PIPELLM_AVX2
#ifdef __AVX512F__
using Vec = __m512;
constexpr int kLanes = 16, kTileRows = 8;
static inline Vec vzero() { return _mm512_setzero_ps(); }
static inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
static inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#else
using Vec = __m256;
constexpr int kLanes = 8, kTileRows = 4;
static inline Vec vzero() { return _mm256_setzero_ps(); }
static inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
static inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#endif

// Weight rows a block (a column panel's block, 8 KB at 32 columns and 64 rows, stays in L1): a block's rows are
// read side by side, one stream each. Up to 16 rows of x, where reading the weights bounds the product, 32
// streams, which the L2 prefetchers follow better than 64 (the default model's layers from memory on a Xeon with
// AMX: 1.35x at 16 rows; benchmarks/dense_layers.py). From 32 rows on, 64: fewer passes over the sums in cache.
static inline int64_t tile_k(int64_t M) { return M <= 16 ? 32 : 64; }
// columns a sweep: the sums of 32 rows (128 KB) stay in L2 between blocks of weight rows (the LM head's 49,152
// columns: 1.2x at 16 and 32 rows, BENCHMARKS.md)
constexpr int64_t kTileN = 1024;

// y[R rows, n:n + V * kLanes] (+)= x[:, k0:k0 + KB] @ w[k0:k0 + KB, n:...], the R x V sums in registers over the
// block: each weight vector loaded once serves R rows. Each output sums its products in k order from zero (the
// block's first call starts at zero, the next ones go on from y, exactly), as dense_rows_pass: a row's bits do not
// depend on the rows beside it. ahead: prefetch the next panel's lines of these weight rows (the first row tile).
template <int R, int V>
static inline void dense_tile(const float* x, int64_t ldx, const float* w, int64_t KB, int64_t N, float* y,
                              int64_t ldy, int64_t n, bool first, bool ahead) {
  Vec acc[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) acc[r][v] = first ? vzero() : vload(y + r * ldy + n + v * kLanes);
  for (int64_t k = 0; k < KB; k++) {
    const float* wk = w + k * N + n;
    if (ahead)
      for (int v = 0; v < V; v++) _mm_prefetch((const char*)(wk + (V + v) * kLanes), _MM_HINT_T0);
    Vec wv[V];
    for (int v = 0; v < V; v++) wv[v] = vload(wk + v * kLanes);
    for (int r = 0; r < R; r++) {
      const Vec a = vbroadcast(x + r * ldx + k);
      for (int v = 0; v < V; v++) acc[r][v] = vfma(a, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) vstore(y + r * ldy + n + v * kLanes, acc[r][v]);
}

template <int R, int V>
static void dense_tile_rows(int64_t M, const float* x, int64_t ldx, const float* w, int64_t KB, int64_t N, float* y,
                            int64_t ldy, int64_t n, bool first) {
  int64_t m = 0;
  for (; m + R <= M; m += R)
    dense_tile<R, V>(x + m * ldx, ldx, w, KB, N, y + m * ldy, ldy, n, first, m == 0);
  if constexpr (R > 1) {  // the last rows, fewer than R
    if (m < M) dense_tile_rows<R - 1, V>(M - m, x + m * ldx, ldx, w, KB, N, y + m * ldy, ldy, n, first);
  }
}

// More than 8 rows: sweeps of kTileN columns, each in blocks of tile_k(M) weight rows, each block by column panels of 2
// vectors (then 1, then scalars) and, in each panel, tiles of kTileRows rows. A block's weight rows are read as
// parallel forward streams.
static void dense_tiles(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K, int64_t N, float* y,
                        int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t c0 = n0; c0 < n1; c0 += kTileN) {
    const int64_t c1 = std::min(n1, c0 + kTileN);
    for (int64_t k0 = 0, tk = tile_k(M); k0 < K; k0 += tk) {
      const int64_t KB = std::min(tk, K - k0);
      const float *xb = x + k0, *wb = w + k0 * N;
      int64_t n = c0;
      for (; n + 2 * kLanes <= c1; n += 2 * kLanes)
        dense_tile_rows<kTileRows, 2>(M, xb, ldx, wb, KB, N, y, ldy, n, k0 == 0);
      for (; n + kLanes <= c1; n += kLanes) dense_tile_rows<kTileRows, 1>(M, xb, ldx, wb, KB, N, y, ldy, n, k0 == 0);
      for (; n < c1; n++)
        for (int64_t m = 0; m < M; m++) {
          float s = k0 == 0 ? 0.0f : y[m * ldy + n];
          for (int64_t k = 0; k < KB; k++) s = std::fma(xb[m * ldx + k], wb[k * N + n], s);
          y[m * ldy + n] = s;
        }
    }
  }
}
#endif

void dense_rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K, int64_t N, float* y,
                int64_t ldy, int64_t n0, int64_t n1) {
#ifdef PIPELLM_AVX2
  if (M > 8) return dense_tiles(x, ldx, M, w, K, N, y, ldy, n0, n1);
#endif
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    dense_rows_pass<8>(x + k, ldx, M, w + k * N, N, y, ldy, n0, n1, k + 24 <= K ? w + (k + 16) * N : nullptr);
  for (; k < K; k++) dense_rows_pass<1>(x + k, ldx, M, w + k * N, N, y, ldy, n0, n1, nullptr);
}

// ---- fp32 rows times compact weights in 16 lanes (the AVX-512 build; ops.cpp: XT_MIN_ROWS to XT_MAX_ROWS rows) ----
// gemm_t expands each weight block once per tile of 8 rows, in 8 lanes. Here each group of 8 (or 16) weight rows
// is expanded once, to fp32 in a buffer that stays in L1, and serves every row: x comes transposed, [K, Mp] (M
// rounded up to 16, packed once a call), so a tile of 8 weight rows x 32 rows keeps its sums in 16 registers and
// each weight, broadcast once, meets 32 rows. Each output sums its products in k order from zero, as the dense
// tiles do: the same bits as the dense kernels on the dequantized weights, whatever rows are beside it.
#ifdef __AVX512F__
// acc += the products of R weight rows' next KB weights (wb[r * ldb + k]) and xt's next KB rows (xt[k * Mp],
// 16 * V lanes from where xt points), in k order
template <int R, int V>
static inline void xt_sums(__m512 (&acc)[R][V], const float* wb, int64_t ldb, const float* xt, int64_t Mp,
                           int64_t KB) {
  for (int64_t k = 0; k < KB; k++) {
    __m512 xv[V];
    for (int v = 0; v < V; v++) xv[v] = _mm512_loadu_ps(xt + k * Mp + 16 * v);
    for (int r = 0; r < R; r++) {
      const __m512 a = _mm512_set1_ps(wb[r * ldb + k]);
      for (int v = 0; v < V; v++) acc[r][v] = _mm512_fmadd_ps(a, xv[v], acc[r][v]);
    }
  }
}

// y[4J + q, 0:8] = u[q]'s and u[4 + q]'s 128-bit lane J, q = 0..3
template <int J>
static inline void store_lanes(const __m512 (&u)[8], float* y, int64_t ldy) {
  for (int q = 0; q < 4; q++) {
    _mm_storeu_ps(y + (4 * J + q) * ldy, _mm512_extractf32x4_ps(u[q], J));
    _mm_storeu_ps(y + (4 * J + q) * ldy + 4, _mm512_extractf32x4_ps(u[4 + q], J));
  }
}

// y[m, 0:8] = a[0..7][m] for m = 0..15: 8 weight rows' sums over 16 rows, transposed in registers (written a value
// at a time, this took a fifth of a 576-column product's time)
static inline void store_transposed(const __m512 (&a)[8], float* y, int64_t ldy) {
  const __m512 t0 = _mm512_unpacklo_ps(a[0], a[1]), t1 = _mm512_unpackhi_ps(a[0], a[1]);  // a[0][4j], a[1][4j], ...
  const __m512 t2 = _mm512_unpacklo_ps(a[2], a[3]), t3 = _mm512_unpackhi_ps(a[2], a[3]);
  const __m512 t4 = _mm512_unpacklo_ps(a[4], a[5]), t5 = _mm512_unpackhi_ps(a[4], a[5]);
  const __m512 t6 = _mm512_unpacklo_ps(a[6], a[7]), t7 = _mm512_unpackhi_ps(a[6], a[7]);
  // u[q], lane j: a[0..3][4j + q]; u[4 + q]: a[4..7][4j + q]
  const __m512 u[8] = {_mm512_shuffle_ps(t0, t2, 0x44), _mm512_shuffle_ps(t0, t2, 0xEE),
                       _mm512_shuffle_ps(t1, t3, 0x44), _mm512_shuffle_ps(t1, t3, 0xEE),
                       _mm512_shuffle_ps(t4, t6, 0x44), _mm512_shuffle_ps(t4, t6, 0xEE),
                       _mm512_shuffle_ps(t5, t7, 0x44), _mm512_shuffle_ps(t5, t7, 0xEE)};
  store_lanes<0>(u, y, ldy);
  store_lanes<1>(u, y, ldy);
  store_lanes<2>(u, y, ldy);
  store_lanes<3>(u, y, ldy);
}

// y[m0.., n .. n+rows-1] = a tile's sums (y's rows are the tile's lanes)
template <int R, int V>
static inline void xt_store(const __m512 (&acc)[R][V], float* y, int64_t ldy, int64_t n, int64_t rows, int64_t m0,
                            int64_t M) {
  alignas(64) float t[16];
  for (int v = 0; v < V; v++) {
    const int64_t m1 = m0 + 16 * v;
    if constexpr (R % 8 == 0) {
      if (rows == R) {
        for (int h = 0; h < R; h += 8) {
          const __m512 a[8] = {acc[h][v],     acc[h + 1][v], acc[h + 2][v], acc[h + 3][v],
                               acc[h + 4][v], acc[h + 5][v], acc[h + 6][v], acc[h + 7][v]};
          if (m1 + 16 <= M) {
            store_transposed(a, y + m1 * ldy + n + h, ldy);
          } else {  // the last rows, fewer than 16
            alignas(64) float part[16 * 8];
            store_transposed(a, part, 8);
            for (int64_t m = m1; m < M; m++) std::memcpy(y + m * ldy + n + h, part + (m - m1) * 8, 8 * sizeof(float));
          }
        }
        continue;
      }
    }
    for (int64_t r = 0; r < rows; r++) {
      _mm512_store_ps(t, acc[r][v]);
      for (int64_t i = 0, m = m1; i < 16 && m < M; i++, m++) y[m * ldy + n + r] = t[i];
    }
  }
}

// Blocks b0 .. b0+nbk-1 (nbk <= 8) of weight rows n .. n+rows-1 as fp32, out[i * ldo + k]: Q4 and Q8 codes
// without an offset widen in 16 lanes and take their group's scale (and min) in one FMA, the values expand_vec
// gives in half the instructions
template <int KIND, int GROUP, int SK, bool MIN, int P>
static inline void expand_blocks(const QWeight& w, int64_t n, int64_t rows, int64_t b0, int nbk, float* out,
                                 int64_t ldo) {
  constexpr int G = 32 / GROUP;
  alignas(32) float s[8 * G], c[8 * G];
  for (int64_t i = 0; i < rows; i++) {
    consts_upto8<GROUP, SK, MIN, P>(w, n + i, b0, nbk, s, c);
    float* o = out + i * ldo;  // computed once: w's fields would be read again after each store, which may alias
    for (int j = 0; j < nbk; j++) {
      __m512 lo, hi;  // weights 0-15 and 16-31 of the block
      wide_block<KIND, GROUP, P>(w, n + i, b0 + j, s + G * j, c + G * j, lo, hi);
      _mm512_storeu_ps(o + j * 32, lo);
      _mm512_storeu_ps(o + j * 32 + 16, hi);
    }
  }
}

// A tile of R weight rows x 16V rows over a chunk of KB weights, the sums going on from part (unless first) and
// left there, or written to y (last)
template <int R, int V>
static inline void xt_tile_chunk(const float* wb, int64_t ldb, const float* xt, int64_t Mp, int64_t KB, bool first,
                                 bool last, float* part, float* y, int64_t ldy, int64_t n, int64_t rows, int64_t m0,
                                 int64_t M) {
  __m512 acc[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + (r * V + v) * 16);
  xt_sums<R, V>(acc, wb, ldb, xt, Mp, KB);
  if (last) {
    xt_store<R, V>(acc, y, ldy, n, rows, m0, M);
  } else {
    for (int r = 0; r < R; r++)
      for (int v = 0; v < V; v++) _mm512_storeu_ps(part + (r * V + v) * 16, acc[r][v]);
  }
}

// Every tile of rows (32, then 16) over the same chunk of R weight rows: part holds each tile's sums (R x 16V)
template <int R>
static inline void xt_tiles(const float* wb, int64_t ldb, const float* xt, int64_t Mp, int64_t KB, bool first,
                            bool last, float* part, float* y, int64_t ldy, int64_t n, int64_t rows, int64_t M) {
  for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
    float* p = part ? part + m0 * R : nullptr;
    if (Mp - m0 >= 32) xt_tile_chunk<R, 2>(wb, ldb, xt + m0, Mp, KB, first, last, p, y, ldy, n, rows, m0, M);
    else xt_tile_chunk<R, 1>(wb, ldb, xt + m0, Mp, KB, first, last, p, y, ldy, n, rows, m0, M);
  }
}

// Q4 or Q8 codes without an offset: R weight rows' next 8 blocks expanded into R KB that stay in L1, then
// multiplied by every tile of rows, each tile's sums kept (part, R x Mp) between chunks. Expanding whole rows
// first (K = 1,536: 48 KB) let x's reads push them out of L1 before they were used.
template <int KIND, int GROUP, int SK, bool MIN, int P, int R>
static void xt_group_by_blocks(const QWeight& w, int64_t n, int64_t rows, const float* xt, int64_t M, int64_t Mp,
                               float* y, int64_t ldy, float* buf, float* part) {
  constexpr int64_t kLd = 8 * 32;
  const int64_t nb = w.K / 32;
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int nbk = int(std::min<int64_t>(8, nb - b0));
    expand_blocks<KIND, GROUP, SK, MIN, P>(w, n, rows, b0, nbk, buf, kLd);
    xt_tiles<R>(buf, kLd, xt + b0 * 32 * Mp, Mp, nbk * 32, b0 == 0, b0 + 8 >= nb, part, y, ldy, n, rows, M);
  }
}

template <int KIND, int GROUP, int SK, bool MIN, int P>
static void gemm_xt_t(const QWeight& w, const float* xt, int64_t M, int64_t Mp, float* y, int64_t ldy, int64_t n0,
                      int64_t n1) {
  const int64_t K = w.K;
  constexpr bool kWide = (KIND == pipellm::Q4 || KIND == pipellm::Q8) && P == 0;
  // 16 rows of x fill one vector a weight: 16 weight rows a group keep 16 sums in flight, not 8
  const int64_t G = kWide && Mp == 16 ? 16 : 8;
  thread_local std::vector<float> buf;  // a last group's rows past n1 are summed, not stored
  buf.resize(size_t(kWide ? 16 * 8 * 32 + 16 * Mp : 8 * K));
  float* part = kWide ? buf.data() + 16 * 8 * 32 : nullptr;  // the tiles' sums, after 16 rows' chunk of blocks
  for (int64_t n = n0; n < n1; n += G) {
    const int64_t nr = std::min<int64_t>(G, n1 - n);
    if (n + 3 * G <= n1) prefetch_rows<SK, MIN>(w, n + 2 * G, int(G));  // codes come from memory: two groups ahead
    if constexpr (kWide) {
      if (G == 16) xt_group_by_blocks<KIND, GROUP, SK, MIN, P, 16>(w, n, nr, xt, M, Mp, y, ldy, buf.data(), part);
      else xt_group_by_blocks<KIND, GROUP, SK, MIN, P, 8>(w, n, nr, xt, M, Mp, y, ldy, buf.data(), part);
    } else {  // whole rows first, then each tile of rows over them
      int64_t ids[8];
      for (int64_t i = 0; i < nr; i++) ids[i] = n + i;
      dequant_t<KIND, GROUP, SK, MIN, P>(w, ids, nr, buf.data());
      xt_tiles<8>(buf.data(), K, xt, Mp, K, true, true, nullptr, y, ldy, n, nr, M);
    }
  }
}

void gemm_xt(const QWeight& w, const float* xt, int64_t M, int64_t Mp, float* y, int64_t ldy, int64_t n0,
             int64_t n1) {
  PIPELLM_DISPATCH(gemm_xt_t, w, xt, M, Mp, y, ldy, n0, n1)
}

// xt[k, m] = x[m, k], 0 for m >= M: 8 rows x 16 values at a time, transposed in registers (torch's transposing
// copy into zeros took ~20 us a call, ~3 ms of a 32-row decode step, while the other threads waited)
void pack_xt(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Mp, float* xt) {
  for (int64_t m0 = 0; m0 < Mp; m0 += 8)
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      __m512 a[8];
      for (int64_t i = 0; i < 8; i++)
        a[i] = m0 + i < M ? _mm512_loadu_ps(x + (m0 + i) * ldx + k0) : _mm512_setzero_ps();
      store_transposed(a, xt + k0 * Mp + m0, Mp);
    }
}
#else
void gemm_xt(const QWeight&, const float*, int64_t, int64_t, float*, int64_t, int64_t, int64_t) { std::abort(); }
void pack_xt(const float*, int64_t, int64_t, int64_t, int64_t, float*) { std::abort(); }
#endif

// Rows rounded to 8 bits (quantize_acts: q [M, K], d [M, K / 32]) as the int8 products below and the AMX-INT8 tiles
// take them: xp[group of 16 rows][block][quad k][row r][4] = q[16 g + r][32 b + 4 k ...], xd[group][block][row] = its
// scale, and where xc is given, xc[group][block][row] = -128 times the block's sum of codes; rows past M are 0
void pack_i8_rows(const int8_t* q, const float* d, int64_t M, int64_t K, int8_t* xp, float* xd, int32_t* xc) {
  const int64_t nb = K / 32;
  for (int64_t g = 0; g < (M + 15) / 16; g++)
    for (int64_t b = 0; b < nb; b++) {
      int8_t* out = xp + (g * nb + b) * 512;
      for (int r = 0; r < 16; r++) {
        const int64_t m = g * 16 + r;
        int32_t sum = 0;
        for (int k = 0; k < 8; k++) {
          int8_t* quad = out + (k * 16 + r) * 4;
          if (m < M) std::memcpy(quad, q + m * K + b * 32 + 4 * k, 4);
          else std::memset(quad, 0, 4);
          sum += quad[0] + quad[1] + quad[2] + quad[3];
        }
        xd[(g * nb + b) * 16 + r] = m < M ? d[m * nb + b] : 0.0f;
        if (xc) xc[(g * nb + b) * 16 + r] = -128 * sum;
      }
    }
}

#ifdef __AVX512F__
// ---- greedy picks' first pass on AVX512-VNNI (no AMX tiles): those rows times Q8 codes (a scale per 32, no min) as
// they lie in memory, 16 rows in a vector's lanes. vpdpbusd multiplies unsigned by signed bytes: a weight row's 4
// codes, broadcast, become unsigned by + 128 (an xor), and xc takes the 128 times the rows' codes back off. Each
// block's integer sums are exact; their scaling in fp32 is the int8 tiles' (greedy_pick bounds both alike).
#define PIPELLM_VNNI_FN __attribute__((target("avx512vnni,avx512f,avx512bw,avx512vl")))
template <int SK>
PIPELLM_VNNI_FN static void gemm_q8_i8_vnni_t(const QWeight& w, const int8_t* xp, const float* xd, const int32_t* xc,
                                              int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int R = 8;  // weight rows a tile, their sums in registers; the tile's codes stay in L1 for every group
  const int64_t nb = w.K / 32, groups = (M + 15) / 16;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t n = n0; n < n1; n += R) {
    int64_t row[R];  // past n1 (the last tile of N only), row n1 - 1 again, into y's padding
    for (int i = 0; i < R; i++) row[i] = std::min(n + i, n1 - 1);
    // the next tile's codes (contiguous), a share each block, to L1
    const char* next = reinterpret_cast<const char*>(w.qs) + (n + R) * w.qs_stride;
    const int64_t lines = n + 2 * R <= n1 ? R * w.qs_stride / 64 : 0, per = (lines + nb - 1) / nb;
    for (int64_t g = 0; g < groups; g++) {
      __m512 acc[R];
      for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; b++) {
        for (int64_t l = b * per; g == 0 && l < std::min(lines, b * per + per); l++)
          _mm_prefetch(next + 64 * l, _MM_HINT_T0);
        const int8_t* xb = xp + (g * nb + b) * 512;
        __m512i dot[R];
        for (int i = 0; i < R; i++) dot[i] = _mm512_loadu_si512(xc + (g * nb + b) * 16);
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
          const __m512i xk = _mm512_load_si512(xb + 64 * k);
#pragma GCC unroll 8
          for (int i = 0; i < R; i++) {
            int32_t quad;  // codes 32 b + 4 k .. + 3 of weight row i
            std::memcpy(&quad, reinterpret_cast<const int8_t*>(w.qs) + row[i] * w.qs_stride + 32 * b + 4 * k, 4);
            dot[i] = _mm512_dpbusd_epi32(dot[i], _mm512_xor_si512(_mm512_set1_epi32(quad), flip), xk);
          }
        }
        const __m512 dv = _mm512_loadu_ps(xd + (g * nb + b) * 16);
        for (int i = 0; i < R; i++) {
          const __m512 s = _mm512_mul_ps(_mm512_set1_ps(scale_at<SK>(w, row[i] * w.s_stride + b)), dv);
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), s, acc[i]);
        }
      }
      store_transposed(acc, y + g * 16 * ldy + n, ldy);  // y[16 g + r, n + i] = acc[i][r]
    }
  }
}
#undef PIPELLM_VNNI_FN

void gemm_q8_i8_vnni(const QWeight& w, const int8_t* xp, const float* xd, const int32_t* xc, int64_t M, float* y,
                     int64_t ldy, int64_t n0, int64_t n1) {
  if (w.scale_kind == pipellm::SCALE_F32)
    return gemm_q8_i8_vnni_t<pipellm::SCALE_F32>(w, xp, xd, xc, M, y, ldy, n0, n1);
  gemm_q8_i8_vnni_t<pipellm::SCALE_F16>(w, xp, xd, xc, M, y, ldy, n0, n1);
}

// greedy_pick's candidates from a [N], bf16 (the tiles') or fp32
template <typename T>
static int64_t greedy_candidates_t(const T* a, int64_t N, const float* n1, const float* n2, float alpha, float beta,
                                   float c, float floor, int64_t* cand) {
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta), vc = _mm512_set1_ps(c);
  const __m512 vf = _mm512_set1_ps(floor), inf = _mm512_set1_ps(INFINITY);
  const auto load = [&](int64_t j, __mmask16 m) {
    if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(m, a + j);
    else  // bf16 -> fp32: the 16 bits on top
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, a + j)), 16));
  };
  const auto bound = [&](__m512 v, int64_t j, __mmask16 m) {
    const __m512 b = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, n2 + j),
                                     _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, n1 + j), vf));
    return _mm512_fmadd_ps(vc, _mm512_abs_ps(v), b);
  };
  const auto mask = [&](int64_t j) { return N - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (N - j)) - 1); };
  __m512 lo = _mm512_set1_ps(-INFINITY);
  __mmask16 bad = 0;
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 m = mask(j);
    const __m512 v = load(j, m);
    bad |= _mm512_mask_cmp_ps_mask(m, _mm512_abs_ps(v), inf, _CMP_NLT_UQ);  // NaN or infinity
    lo = _mm512_mask_max_ps(lo, m, lo, _mm512_sub_ps(v, bound(v, j, m)));
  }
  if (bad) return -1;
  const __m512 thr = _mm512_set1_ps(_mm512_reduce_max_ps(lo));
  int64_t n = 0;
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 m = mask(j);
    const __m512 v = load(j, m);
    for (uint32_t keep = _mm512_mask_cmp_ps_mask(m, _mm512_add_ps(v, bound(v, j, m)), thr, _CMP_GE_OQ); keep;
         keep &= keep - 1)
      cand[n++] = j + __builtin_ctz(keep);
  }
  return n;
}

int64_t greedy_candidates(const uint16_t* a, int64_t N, const float* n1, const float* n2, float alpha, float beta,
                          float c, float floor, int64_t* cand) {
  return greedy_candidates_t(a, N, n1, n2, alpha, beta, c, floor, cand);
}
int64_t greedy_candidates(const float* a, int64_t N, const float* n1, const float* n2, float alpha, float beta,
                          float c, float floor, int64_t* cand) {
  return greedy_candidates_t(a, N, n1, n2, alpha, beta, c, floor, cand);
}
#else
void gemm_q8_i8_vnni(const QWeight&, const int8_t*, const float*, const int32_t*, int64_t, float*, int64_t, int64_t,
                     int64_t) {
  std::abort();
}
int64_t greedy_candidates(const uint16_t*, int64_t, const float*, const float*, float, float, float, float, int64_t*) {
  std::abort();
}
int64_t greedy_candidates(const float*, int64_t, const float*, const float*, float, float, float, float, int64_t*) {
  std::abort();
}
#endif

void decode_attention(const DecodeArgs& a, int64_t u0, int64_t u1) {
  if (a.cache_kind == pipellm::CACHE_BF16) return decode_attention_t<pipellm::CACHE_BF16>(a, u0, u1);
  if (a.cache_kind == pipellm::CACHE_I8) return decode_attention_t<pipellm::CACHE_I8>(a, u0, u1);
  return decode_attention_t<pipellm::CACHE_F32>(a, u0, u1);
}

// ---- bf16 rows through AMX tiles (ops.cpp calls these only where the CPU has AMX-BF16 and Linux grants it) ----
// A tile multiply takes 16 rows x 32 values of bf16 on each side and sums them into 16 x 16 fp32. Each 16 weight
// rows are expanded once, to bf16 in a buffer that stays in L1/L2, and serve every activation row: the expansion,
// not the multiply, is then the cost. The weight rows are the tiles' A side (a row's 32 values side by side, as
// expanded) and the activations the B side (pairs of values, packed once a call), so C holds y transposed.
#if PIPELLM_AMX_CODE
#define PIPELLM_AMX_FN __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512dq,avx512f,avx512bw,avx512vl")))

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void pack_bf16_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xp) {
  // xp[group of 16 rows][block of 32 values][pair p][row r][2] = x[16 g + r][32 b + 2 p ...]; rows past M are 0
  const int64_t nb = K / 32;
  uint32_t* out = reinterpret_cast<uint32_t*>(xp);
  for (int64_t g = 0; g < (M + 15) / 16; g++)
    for (int64_t b = 0; b < nb; b++)
      for (int p = 0; p < 16; p++)
        for (int r = 0; r < 16; r++) {
          const int64_t m = g * 16 + r;
          uint32_t pair = 0;
          if (m < M) std::memcpy(&pair, x + m * ldx + b * 32 + 2 * p, 4);
          *out++ = pair;
        }
}

// Weight rows n0 .. n0+rows-1 as bf16 [16, K] (rows past them 0). Codes widen in 16 lanes and take their group's
// scale and constant (chunk_consts, as the one-row kernel) in one FMA; other kinds expand as the fp32 paths do.
template <int KIND, int GROUP, int SK, bool MIN, int P>
PIPELLM_AMX_FN static void expand_bf16(const QWeight& w, int64_t n0, int rows, uint16_t* out) {
  constexpr int G = 32 / GROUP;
  constexpr bool WIDE = KIND == pipellm::Q4 || KIND == pipellm::Q8;
  const int64_t nb = w.K / 32;
  alignas(32) float s[8 * G], c[8 * G];
  for (int i = 0; i < 16; i++) {
    uint16_t* o = out + i * w.K;
    const int64_t n = n0 + i;
    if (i >= rows) {
      std::memset(o, 0, w.K * 2);
      continue;
    }
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
      const int nbk = int(std::min<int64_t>(8, nb - b0));
      if constexpr (WIDE) consts_upto8<GROUP, SK, MIN, P>(w, n, b0, nbk, s, c);
      for (int j = 0; j < nbk; j++) {
        const int64_t b = b0 + j;
        __m512 lo, hi;  // weights 0-15 and 16-31 of the block
        if constexpr (WIDE) {
          wide_block<KIND, GROUP, P>(w, n, b, s + G * j, c + G * j, lo, hi);
        } else {
          const Block v = expand_vec<KIND, GROUP, SK, MIN, P>(w, n, b);
          lo = _mm512_insertf32x8(_mm512_castps256_ps512(v.v[0]), v.v[1], 1);
          hi = _mm512_insertf32x8(_mm512_castps256_ps512(v.v[2]), v.v[3], 1);
        }
        _mm512_storeu_si512(o + b * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // rounded to nearest even
      }
    }
  }
}

// 2 x 2 tiles of C (a * 2 + b) += expanded weight rows a (16 each, tiles 4, 5) times packed row groups b (tiles 6,
// 7): each tile loaded serves two products. NA weight tiles, NB row groups (1 or 2 each).
template <int NA, int NB>
PIPELLM_AMX_FN static inline void tile_products(const uint16_t* wb, int64_t K, const uint16_t* xp, int64_t nb,
                                                float* c) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NA > 1) _tile_zero(2);
  if constexpr (NA > 1 && NB > 1) _tile_zero(3);
  for (int64_t b = 0; b < nb; b++) {
    _tile_loadd(4, wb + b * 32, K * 2);
    _tile_loadd(6, xp + b * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) {
      _tile_loadd(7, xp + (nb + b) * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NA > 1) {
      _tile_loadd(5, wb + 16 * K + b * 32, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NB > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NA > 1) _tile_stored(2, c + 512, 64);
  if constexpr (NA > 1 && NB > 1) _tile_stored(3, c + 768, 64);
}

template <int KIND, int GROUP, int SK, bool MIN, int P>
PIPELLM_AMX_FN static void gemm_bf16_t(const QWeight& w, const uint16_t* xp, int64_t M, uint16_t* y, int64_t ldy,
                                       int64_t n0, int64_t n1) {
  TileConfig cfg;
  for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  const int64_t K = w.K, nb = K / 32, groups = (M + 15) / 16;
  thread_local std::vector<uint16_t> wbuf;
  wbuf.resize(32 * K);
  alignas(64) float c[4 * 256];  // [weight tile * 2 + row group][weight row][activation row]
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  // 32 weight rows at a time where two row groups share them; for one, 16 rows' bf16 stay closer (in L1)
  const int64_t step = groups > 1 ? 32 : 16;
  for (int64_t n = n0; n < n1; n += step) {
    const int rows = int(std::min<int64_t>(step, n1 - n));
    expand_bf16<KIND, GROUP, SK, MIN, P>(w, n, std::min(rows, 16), wbuf.data());
    if (rows > 16) expand_bf16<KIND, GROUP, SK, MIN, P>(w, n + 16, rows - 16, wbuf.data() + 16 * K);
    const int NA = rows > 16 ? 2 : 1;
    for (int64_t g = 0; g < groups; g += 2) {
      const int NB = groups - g > 1 ? 2 : 1;
      const uint16_t* xg = xp + g * nb * 512;
      if (NA == 2 && NB == 2) tile_products<2, 2>(wbuf.data(), K, xg, nb, c);
      else if (NA == 2) tile_products<2, 1>(wbuf.data(), K, xg, nb, c);
      else if (NB == 2) tile_products<1, 2>(wbuf.data(), K, xg, nb, c);
      else tile_products<1, 1>(wbuf.data(), K, xg, nb, c);
      // C holds y transposed: a row of y is a column of a tile, gathered, rounded to bf16 and stored
      for (int a = 0; a < NA; a++) {
        const int cols = std::min(16, rows - 16 * a);
        const __mmask16 keep = __mmask16((1u << cols) - 1);
        for (int b = 0; b < NB; b++)
          for (int r = 0; r < 16 && (g + b) * 16 + r < M; r++) {
            const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(r)),
                                                 c + (a * 2 + b) * 256, 4);
            _mm256_mask_storeu_epi16(y + ((g + b) * 16 + r) * ldy + n + 16 * a, keep,
                                     (__m256i)_mm512_cvtneps_pbh(v));
          }
      }
    }
  }
  _tile_release();
}

void gemm_bf16(const QWeight& w, const uint16_t* xp, int64_t M, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1) {
  PIPELLM_DISPATCH(gemm_bf16_t, w, xp, M, y, ldy, n0, n1)
}
bool amx_built() { return true; }

// ---- fp32 rows times codes through AMX tiles ----
// Q4 and Q8 codes are integers below 256 in magnitude, exact in bf16, and an fp32 row is the sum of three bf16
// parts (hi, then the rounding of what hi leaves, then of what both leave: exact but for denormals). So a tile
// multiply of a group's codes by the three parts gives its dot products as fp32 kernels have them: each product
// exact, the sums in fp32. The group's scale then multiplies the dot product and its constant (min and offset) the
// row's sum over the group: y[m, n] = sum over groups g, in order, of s[n, g] (codes . x) + c[n, g] sum(x). A
// group of 32 is a tile product; groups of 16 (Q6_K) take one each, of tiles 16 values wide, which costs the same.
// The expansion is only the codes, and a tile multiply does 8,192 products where an FMA does 16.
PIPELLM_AMX_FN static inline __m512 bf16_low_to_ps(__m512i h) {  // the 16 bf16 in h's low half, as fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
}
PIPELLM_AMX_FN static inline __m512 bf16_high_to_ps(__m512i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
}

// r[i][j] -> r[j][i] for 16 x 16 32-bit values: pairs, then quads within 128-bit lanes, then the lanes
PIPELLM_AMX_FN static inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);      // per lane: r_i[0] r_i+1[0] r_i[1] r_i+1[1]
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);  // r_i[2] r_i+1[2] r_i[3] r_i+1[3]
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + e]: lane L holds element 4L + e of rows i .. i+3
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int e = 0; e < 4; e++) {  // row 4L + e: lane L of u[e], u[4 + e], u[8 + e], u[12 + e]
    const __m512 v = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88), w = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
    const __m512 w2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
    r[e] = _mm512_shuffle_f32x4(v, v2, 0x88);
    r[8 + e] = _mm512_shuffle_f32x4(v, v2, 0xDD);
    r[4 + e] = _mm512_shuffle_f32x4(w, w2, 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(w, w2, 0xDD);
  }
}

PIPELLM_AMX_FN void pack_f32_parts(const float* x, int64_t ldx, int64_t M, int64_t K, int G, uint16_t* xp,
                                   float* xsum) {
  // xp[group of 16 rows][block][part][pair p][row r][2] = part of x[16 g + r][32 b + 2 p ...]; rows past M are 0
  const int64_t nb = K / 32, groups = (M + 15) / 16;
  for (int64_t g = 0; g < groups; g++)
    for (int64_t b = 0; b < nb; b++) {
      __m512 lo[16], hi[16], parts[3][16];  // a row's 16 pairs of a part: 16 32-bit values
      for (int r = 0; r < 16; r++) {
        const int64_t m = g * 16 + r;
        lo[r] = hi[r] = _mm512_setzero_ps();
        if (m < M) lo[r] = _mm512_loadu_ps(x + m * ldx + b * 32), hi[r] = _mm512_loadu_ps(x + m * ldx + b * 32 + 16);
      }
      for (int h = 0; h < G; h++) {  // the block's sum, or its two halves'
        __m512 sums[16];
        for (int r = 0; r < 16; r++) sums[r] = G == 1 ? _mm512_add_ps(lo[r], hi[r]) : h ? hi[r] : lo[r];
        transpose16(sums);  // lane r of sums[0] + ... + sums[15]: row r's sum
        __m512 total = sums[0];
        for (int i = 1; i < 16; i++) total = _mm512_add_ps(total, sums[i]);
        _mm512_storeu_ps(xsum + ((g * nb + b) * G + h) * 16, total);
      }
      for (int part = 0; part < 3; part++)
        for (int r = 0; r < 16; r++) {
          const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(hi[r], lo[r]);  // 32 bf16 in k order: 16 pairs
          parts[part][r] = _mm512_castsi512_ps(h);
          lo[r] = _mm512_sub_ps(lo[r], bf16_low_to_ps(h));  // what the part leaves, exact
          hi[r] = _mm512_sub_ps(hi[r], bf16_high_to_ps(h));
        }
      float* out = reinterpret_cast<float*>(xp + (g * nb + b) * 1536);
      for (int part = 0; part < 3; part++) {
        transpose16(parts[part]);  // [pair][row]
        for (int p = 0; p < 16; p++) _mm512_storeu_ps(out + part * 256 + p * 16, parts[part][p]);
      }
    }
}

// Blocks b0 .. b0+nbk-1 of a row's 4-bit codes (no bit planes) as bf16, block j's 32 at out + j * ldo: two blocks
// at a time, 32 bytes widened to 16-bit lanes, split into nibbles, put in weight order and looked up in a table
// of bf16(0 .. 15)
PIPELLM_AMX_FN static inline void q4_codes_bf16(const uint8_t* qs, int64_t b0, int nbk, uint16_t* out, int64_t ldo) {
  static const __m512i table = [] {
    alignas(64) uint16_t t[32];
    for (int v = 0; v < 32; v++) {
      const float f = float(v);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      t[v] = uint16_t(bits >> 16);  // exact: small integers
    }
    return _mm512_load_si512(t);
  }();
  const __m512i low4 = _mm512_set1_epi16(15);
  int j = 0;
  for (; j + 2 <= nbk; j += 2) {  // lanes 0-15: block j's bytes, 16-31: block j + 1's
    const __m512i v =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (b0 + j) * 16)));
    const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
    _mm512_store_si512(out + j * ldo, _mm512_permutexvar_epi16(_mm512_shuffle_i64x2(lo, hi, 0x44), table));
    _mm512_store_si512(out + (j + 1) * ldo, _mm512_permutexvar_epi16(_mm512_shuffle_i64x2(lo, hi, 0xEE), table));
  }
  if (j < nbk) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (b0 + j) * 16)));
    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi16(15)), hi = _mm256_srli_epi16(v, 4);
    _mm512_store_si512(out + j * ldo,
                       _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), table));
  }
}

constexpr int64_t AMX_CHUNK = 8;    // blocks a chunk of K
constexpr int64_t AMX_PANEL = 256;  // weight rows whose sums wait between chunks: 16 KB a row group

// Weight rows n .. n+15 over blocks b0 .. b0+nbk-1: codes into a[j] (a tile: row i at a[j] + 32 i, rows past
// `rows` 0), scales and constants of group g of block j into s[j * G + g][i] and c[j * G + g][i]
template <int KIND, int GROUP, int SK, bool MIN, int P>
PIPELLM_AMX_FN static inline void expand_chunk(const QWeight& w, int64_t n, int rows, int64_t b0, int nbk,
                                               uint16_t (*a)[512], float (*s)[16], float (*c)[16]) {
  constexpr int G = 32 / GROUP;  // s and c: [block * G + group][weight row]
  for (int i = 0; i < 16; i++) {
    if (i >= rows) {
      for (int j = 0; j < nbk; j++) std::memset(a[j] + 32 * i, 0, 64);
      for (int j = 0; j < nbk * G; j++) s[j][i] = c[j][i] = 0;
      continue;
    }
    alignas(32) float sv[8 * G], cv[8 * G];
    consts_upto8<GROUP, SK, MIN, P>(w, n + i, b0, nbk, sv, cv);
    for (int j = 0; j < nbk * G; j++) s[j][i] = sv[j], c[j][i] = cv[j];
    for (int j = 0; j < nbk; j++) {
      if constexpr (KIND == pipellm::Q8 || P > 0) {
        __m512 lo, hi;
        codes16<KIND, P>(w, n + i, b0 + j, lo, hi);
        _mm512_store_si512(a[j] + 32 * i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // exact
      }
    }
    if constexpr (KIND == pipellm::Q4 && P == 0)
      q4_codes_bf16(w.qs + (n + i) * w.qs_stride, b0, nbk, a[0] + 32 * i, 512);
  }
}

// acc[r] += s[r] * (row r of tile) + c[r] * sx: a block's dot products of weight row r scaled, and its constant
// times the rows' block sums
PIPELLM_AMX_FN static inline void scale_tile(const float* tile, const float* s, const float* c, __m512 sx,
                                             __m512* acc) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; r++)
    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(c[r]), sx,
                             _mm512_fmadd_ps(_mm512_set1_ps(s[r]), _mm512_load_ps(tile + 16 * r), acc[r]));
}

// One block's dot products: tile C (0 or 1) = the codes in tile A (2 or 3) times the three parts (5, 6, 7), stored
// to `tile` (the intrinsics take tile numbers as literals)
#define PIPELLM_AMX_BLOCK(C, A, codes, xb, tile) \
  _tile_zero(C);                                 \
  _tile_loadd(A, codes, 64);                     \
  _tile_loadd(5, xb, 64);                        \
  _tile_dpbf16ps(C, A, 5);                       \
  _tile_loadd(6, xb + 512, 64);                  \
  _tile_dpbf16ps(C, A, 6);                       \
  _tile_loadd(7, xb + 1024, 64);                 \
  _tile_dpbf16ps(C, A, 7);                       \
  _tile_stored(C, tile, 64);

// Panels of weight rows, each over K in chunks of 8 blocks: a chunk's parts of a row group (24 KB) stay in L1 while
// every 16 weight rows of the panel are expanded (codes, scales and constants of the chunk only) and multiplied,
// their sums in registers over the chunk and in `sums` [group, weight row, 16 rows] between chunks. Walking all of
// K per 16 weight rows read the rows' parts again from L2 each time: the tiles ran at ~1/3 of their rate.
template <int KIND, int GROUP, int SK, bool MIN, int P>
PIPELLM_AMX_FN static void gemm_f32_amx_t(const QWeight& w, const uint16_t* xp, const float* xsum, int64_t M,
                                          float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if constexpr (!(KIND == pipellm::Q4 || KIND == pipellm::Q8)) {
    std::abort();  // ops.cpp sends only these
  } else {
    constexpr int G = 32 / GROUP;  // scales a block
    TileConfig cfg;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    if constexpr (G == 2) {  // a product per group of 16: A tiles of 16 values a row, B tiles of 8 pairs
      cfg.colsb[2] = cfg.colsb[3] = 32;
      cfg.rows[5] = cfg.rows[6] = cfg.rows[7] = 8;
    }
    _tile_loadconfig(&cfg);
    const int64_t nb = w.K / 32, groups = (M + 15) / 16;
    thread_local std::vector<float> sums;  // [group, weight row n - p0, 16 rows] between chunks
    sums.resize(groups * AMX_PANEL * 16);
    alignas(64) uint16_t a[AMX_CHUNK][512];
    alignas(64) float s[AMX_CHUNK * G][16], c[AMX_CHUNK * G][16], tile[2][256];
    for (int64_t p0 = n0; p0 < n1; p0 += AMX_PANEL) {
      const int64_t p1 = std::min(n1, p0 + AMX_PANEL);
      for (int64_t b0 = 0; b0 < nb; b0 += AMX_CHUNK) {
        const int nbk = int(std::min(AMX_CHUNK, nb - b0));
        for (int64_t n = p0; n < p1; n += 16) {
          expand_chunk<KIND, GROUP, SK, MIN, P>(w, n, int(std::min<int64_t>(16, p1 - n)), b0, nbk, a, s, c);
          for (int64_t g = 0; g < groups; g++) {
            float* out = sums.data() + (g * AMX_PANEL + n - p0) * 16;
            __m512 acc[16];
            for (int r = 0; r < 16; r++) acc[r] = b0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + 16 * r);
            const uint16_t* xg = xp + (g * nb + b0) * 1536;
            const float* xs = xsum + (g * nb + b0) * G * 16;
            // blocks (or a block's two groups) in pairs through tiles 0 and 1: one's scaling overlaps the next
            // one's products
            int j = 0;
            for (; G == 2 && j < nbk; j++) {  // group h: values 16 h .. 16 h + 15 of each row, pairs 8 h .. 8 h + 7
              PIPELLM_AMX_BLOCK(0, 2, a[j], xg + j * 1536, tile[0])
              PIPELLM_AMX_BLOCK(1, 3, a[j] + 16, xg + j * 1536 + 256, tile[1])
              scale_tile(tile[0], s[2 * j], c[2 * j], _mm512_loadu_ps(xs + 32 * j), acc);
              scale_tile(tile[1], s[2 * j + 1], c[2 * j + 1], _mm512_loadu_ps(xs + 32 * j + 16), acc);
            }
            for (; j + 2 <= nbk; j += 2) {
              PIPELLM_AMX_BLOCK(0, 2, a[j], xg + j * 1536, tile[0])
              PIPELLM_AMX_BLOCK(1, 3, a[j + 1], xg + (j + 1) * 1536, tile[1])
              scale_tile(tile[0], s[j], c[j], _mm512_loadu_ps(xs + 16 * j), acc);
              scale_tile(tile[1], s[j + 1], c[j + 1], _mm512_loadu_ps(xs + 16 * (j + 1)), acc);
            }
            if (j < nbk) {
              PIPELLM_AMX_BLOCK(0, 2, a[j], xg + j * 1536, tile[0])
              scale_tile(tile[0], s[j], c[j], _mm512_loadu_ps(xs + 16 * j), acc);
            }
            if (b0 + nbk < nb) {
              for (int r = 0; r < 16; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
              continue;
            }
            transpose16(acc);  // acc[r] held weight row n + r's sums over the group's rows; now row 16 g + r's
            const __mmask16 cols = __mmask16((1u << std::min<int64_t>(16, p1 - n)) - 1);
            for (int64_t m = g * 16; m < std::min(M, g * 16 + 16); m++)
              _mm512_mask_storeu_ps(y + m * ldy + n, cols, acc[m - g * 16]);
          }
        }
      }
    }
    _tile_release();
  }
}
#undef PIPELLM_AMX_BLOCK

void gemm_f32_amx(const QWeight& w, const uint16_t* xp, const float* xsum, int64_t M, float* y, int64_t ldy,
                  int64_t n0, int64_t n1) {
  PIPELLM_DISPATCH(gemm_f32_amx_t, w, xp, xsum, M, y, ldy, n0, n1)
}

// ---- greedy picks' first pass: 8-bit rows times 8-bit codes in AMX-INT8 tiles ----
// An LM head's Q8 codes (one fp16 or fp32 scale per 32, no min) go to the tiles as they lie in memory: no expansion,
// which is most of what the bf16 tiles cost there. The rows come rounded to 8 bits per 32 (quantize_acts), so a
// tile product of a block is an exact integer sum, scaled by the weight's and the row's scales in fp32. This gives
// a ~ x_hat . w, which greedy_pick bounds by ||w|| ||x - x_hat|| and the fp32 sums' rounding.
#define PIPELLM_AMX_I8_FN \
  __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512bf16,avx512dq,avx512f,avx512bw,avx512vl")))

// Block b's integer dot products: tile C (0 or 1) = codes in tile A (2 or 3, read in place) times the rows in tile B
// (4 or 5), stored to tile[C] (the intrinsics take tile numbers as literals)
#define PIPELLM_AMX_I8_BLOCK(C, A, B, b)      \
  _tile_zero(C);                              \
  _tile_loadd(A, codes + (b) * 32, stride);   \
  _tile_loadd(B, xg + (b) * 512, 64);         \
  _tile_dpbssd(C, A, B);                      \
  _tile_stored(C, tile[C], 64);

// y[m, n] (bf16) = sum over blocks b, in order, of (s[n, b] d[m, b]) (codes_n . q_m over b) in fp32, for weight rows
// n0 .. n1-1: tiles 0 and 1 take alternate blocks' sums, A tiles (2, 3) 16 weight rows x 32 codes read in place,
// B tiles (4, 5) a block of 16 packed rows
template <int SK>
PIPELLM_AMX_I8_FN static void gemm_q8_i8_amx_t(const QWeight& w, const int8_t* xp, const float* xd, int64_t M,
                                               uint16_t* y, int64_t ldy, int64_t n0, int64_t n1) {
  TileConfig cfg;
  for (int t = 0; t < 2; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  for (int t = 2; t < 4; t++) cfg.colsb[t] = 32, cfg.rows[t] = 16;
  for (int t = 4; t < 6; t++) cfg.colsb[t] = 64, cfg.rows[t] = 8;
  _tile_loadconfig(&cfg);
  const int64_t K = w.K, nb = K / 32, groups = (M + 15) / 16;
  thread_local std::vector<float> scales;  // [block][weight row] of the 16 rows at hand
  thread_local std::vector<int8_t> tail;   // the last rows, padded to 16 with zeros: tiles read 16
  scales.resize(nb * 16);
  alignas(64) int32_t tile[2][256];
  const auto scale_block = [&](const int32_t* t, const float* s, __m512 dv, __m512* acc) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(t + 16 * r)),
                               _mm512_mul_ps(_mm512_set1_ps(s[r]), dv), acc[r]);
  };
  for (int64_t n = n0; n < n1; n += 16) {
    const int rows = int(std::min<int64_t>(16, n1 - n));
    const int8_t* codes = reinterpret_cast<const int8_t*>(w.qs) + n * w.qs_stride;
    int64_t stride = w.qs_stride;
    if (rows < 16) {
      tail.assign(16 * K, 0);
      for (int i = 0; i < rows; i++) std::memcpy(tail.data() + i * K, codes + i * w.qs_stride, K);
      codes = tail.data(), stride = K;
    }
    for (int i = 0; i < 16; i++)
      for (int64_t b = 0; b < nb; b++) scales[b * 16 + i] = i < rows ? scale_at<SK>(w, (n + i) * w.s_stride + b) : 0;
    // the codes of the 16 rows after the next (contiguous), a share each two blocks, to L2: the tiles' 16 strided
    // rows alone read a head that is not in cache at ~5 GB/s (the default model's, 16 rows: 5.8 ms, 4.5 with this)
    const char* next = n + 48 <= n1 && stride == K ? reinterpret_cast<const char*>(codes + 32 * K) : nullptr;
    const int64_t lines = 16 * K / 64, per = nb >= 2 ? (lines + nb / 2 - 1) / (nb / 2) : 0;  // lines a pair
    for (int64_t g = 0; g < groups; g++) {
      __m512 acc[16];
      for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
      const int8_t* xg = xp + g * nb * 512;
      const float* dg = xd + g * nb * 16;
      int64_t b = 0;
      for (; b + 2 <= nb; b += 2) {  // two blocks through tiles 0 and 1: one's scaling overlaps the next one's product
        if (next && g == 0)
          for (int64_t i = b / 2 * per; i < std::min(lines, b / 2 * per + per); i++)
            _mm_prefetch(next + 64 * i, _MM_HINT_T1);
        PIPELLM_AMX_I8_BLOCK(0, 2, 4, b)
        PIPELLM_AMX_I8_BLOCK(1, 3, 5, b + 1)
        scale_block(tile[0], scales.data() + b * 16, _mm512_loadu_ps(dg + b * 16), acc);
        scale_block(tile[1], scales.data() + (b + 1) * 16, _mm512_loadu_ps(dg + (b + 1) * 16), acc);
      }
      if (b < nb) {
        PIPELLM_AMX_I8_BLOCK(0, 2, 4, b)
        scale_block(tile[0], scales.data() + b * 16, _mm512_loadu_ps(dg + b * 16), acc);
      }
      transpose16(acc);  // acc[r] held weight row n + r's sums over the group's rows; now row 16 g + r's
      const __mmask16 cols = __mmask16((1u << rows) - 1);
      for (int64_t m = g * 16; m < std::min(M, g * 16 + 16); m++)
        _mm256_mask_storeu_epi16(y + m * ldy + n, cols, (__m256i)_mm512_cvtneps_pbh(acc[m - g * 16]));
    }
  }
  _tile_release();
}

#undef PIPELLM_AMX_I8_BLOCK

void gemm_q8_i8_amx(const QWeight& w, const int8_t* xp, const float* xd, int64_t M, uint16_t* y, int64_t ldy,
                    int64_t n0, int64_t n1) {
  if (w.scale_kind == pipellm::SCALE_F32) return gemm_q8_i8_amx_t<pipellm::SCALE_F32>(w, xp, xd, M, y, ldy, n0, n1);
  gemm_q8_i8_amx_t<pipellm::SCALE_F16>(w, xp, xd, M, y, ldy, n0, n1);
}
#undef PIPELLM_AMX_I8_FN
#else
bool amx_built() { return false; }
void pack_bf16_rows(const uint16_t*, int64_t, int64_t, int64_t, uint16_t*) { std::abort(); }
void gemm_bf16(const QWeight&, const uint16_t*, int64_t, uint16_t*, int64_t, int64_t, int64_t) { std::abort(); }
void pack_f32_parts(const float*, int64_t, int64_t, int64_t, int, uint16_t*, float*) { std::abort(); }
void gemm_f32_amx(const QWeight&, const uint16_t*, const float*, int64_t, float*, int64_t, int64_t, int64_t) {
  std::abort();
}
void gemm_q8_i8_amx(const QWeight&, const int8_t*, const float*, int64_t, uint16_t*, int64_t, int64_t, int64_t) {
  std::abort();
}
#endif  // PIPELLM_AMX_CODE

// Each row's first index of its largest value, or of its first NaN where it has one (torch's max(dim=-1).indices):
// greedy sampling's pick over the vocabulary, in two passes, the max in vectors, then the first lane equal to it
void argmax_rows(const float* x, int64_t V, int64_t r0, int64_t r1, int64_t* out) {
  for (int64_t r = r0; r < r1; r++) {
    const float* row = x + r * V;
    float best = -INFINITY;
    bool nan = false;
    int64_t i = 0, at = 0;
#ifdef __AVX512F__
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= V; i += 16) {
      const __m512 v = _mm512_loadu_ps(row + i);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, v);
    }
    best = _mm512_reduce_max_ps(m);
    nan = unordered;
#elif defined(PIPELLM_AVX2)
    __m256 m = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m = _mm256_max_ps(m, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (float l : lanes) best = std::max(best, l);
    nan = _mm256_movemask_ps(unordered);
#endif
    for (; i < V; i++) {
      nan |= std::isnan(row[i]);
      best = std::max(best, row[i]);
    }
    if (nan) {
      while (!std::isnan(row[at])) at++;
    } else {
#ifdef __AVX512F__
      for (; at + 16 <= V && !_mm512_cmp_ps_mask(_mm512_loadu_ps(row + at), _mm512_set1_ps(best), _CMP_EQ_OQ);
           at += 16) {}
#elif defined(PIPELLM_AVX2)
      for (; at + 8 <= V && !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + at), _mm256_set1_ps(best),
                                                              _CMP_EQ_OQ)); at += 8) {}
#endif
      while (row[at] != best) at++;
    }
    out[r] = at;
  }
}

}  // namespace PIPELLM_ISA
