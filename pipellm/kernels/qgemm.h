#pragma once
#include <cstdint>

namespace pipellm {

enum Kind { F16 = 0, BF16 = 1, Q4 = 2, Q8 = 3 };

struct QWeight {
  const uint8_t* qs;   // row n starts at qs + n * qs_stride
  int64_t qs_stride;   // bytes
  const void* scale;   // [N, K / group]: fp16, fp32, or (two-level) uint8 multiples of super_scale; null for F16/BF16
  const void* min;     // same shape and type, or null (two-level: w = q * scale - min)
  const void* super_scale;  // two-level only: fp16 [N, K / 256], the K-quants' d and dmin
  const void* super_min;
  int64_t s_stride;    // scales a row
  int64_t K;
  int kind, group;
  int scale_kind;      // ScaleKind
  // Q4 only: codes of 5 or 6 bits keep bits 4 and 5 in bit planes beside the nibbles, and may be offset:
  // code = nibble | plane0 << 4 | plane1 << 5, w = (code - offset) * scale (+ min)
  const uint8_t* qh;   // per 32 weights, `planes` runs of 4 bytes (bit j of a run: weight j); row n at n * qh_stride
  int64_t qh_stride;
  int planes;          // 0, 1 (Q5_0, Q5_1, Q5_K) or 2 (Q6_K)
  int offset;
};

// TWO_LEVEL: uint8 multiples (scales and mins) of fp16s per 256, groups of 32 (Q4_K, Q5_K); TWO_LEVEL_I8: int8
// multiples of an fp16 per 256, groups of 16, no mins (Q6_K)
enum ScaleKind { SCALE_F16 = 0, SCALE_F32 = 1, SCALE_TWO_LEVEL = 2, SCALE_TWO_LEVEL_I8 = 3 };

// Activations rounded to 8 bits per 32 values, as GGUF's Q8_0 rounds them: x ~= q * d, d = fp16(max |x| / 127).
// The Q4/Q8 matmul multiplies these codes with the weights' codes in integers, as llama.cpp does.
struct QActs {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, K / 32]: the fp16-rounded scales, as fp32
  const float* ds;     // [M, K / 16]: d * (sum of the 16 codes): what a weight group's min or offset multiplies
  const float* ds32;   // [M, K / 32]: the same per 32
  int64_t M, K;
};

enum CacheKind { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_I8 = 2 };

struct DecodeArgs {
  const float* q;              // [B, H, D]
  const void* k_cache;         // [num_blocks, block_size, KV, D]: fp32, bf16, or int8 with scales
  const void* v_cache;
  const float* k_scale;        // int8 only: [num_blocks, KV], value = int8 * scale
  const float* v_scale;
  int cache_kind;              // CacheKind
  const int64_t* block_tables; // [B, table_width]
  const int64_t* seq_lens;     // [B]: keys 0 .. len-1 (the new token's included)
  float* out;                  // [B, H, D]
  int64_t table_width, block_size, window;  // window <= 0: the whole context
  int64_t H, KV, D;
  float scale;
  // A unit of work is (sequence, chunk of chunk_keys positions): units b * num_chunks .. (b + 1) * num_chunks - 1.
  // A sequence whose keys span several chunks leaves each chunk's unnormalized result in partial, [B, num_chunks,
  // H, D + 2] (the weighted values, then the running max and sum per head), which ops.cpp then merges.
  int64_t chunk_keys, num_chunks;
  float* partial;
  float softcap;               // > 0: scores become softcap * tanh(scores / softcap) (Gemma 2)
  const float* sinks;          // [H] or null: a logit per head in each softmax's denominator only (GPT-OSS)
};

// Keys per chunk: a multiple of every span the kernel takes (the online softmax's spans of blocks, aligned to
// positions). It does not depend on the batch or the threads, so neither changes a sequence's result.
constexpr int64_t DECODE_CHUNK_BLOCKS = 8;

// The first key a sequence of len keys attends to: the window's first, or 0
inline int64_t first_key(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

}  // namespace pipellm

#define PIPELLM_DECLARE_ISA(NS)                                                                            \
  namespace NS {                                                                                           \
  void gemm(const pipellm::QWeight& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,     \
            int64_t n0, int64_t n1);                                                                       \
  void dequant(const pipellm::QWeight& w, const int64_t* rows, int64_t R, float* out);                    \
  void quantize_acts(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, float* d,    \
                     float* ds, float* ds32, float* rounded);                                              \
  void gemm_q8(const pipellm::QWeight& w, const pipellm::QActs& a, float* y, int64_t ldy, int64_t n0,       \
               int64_t n1);                                                                                \
  void decode_attention(const pipellm::DecodeArgs& a, int64_t u0, int64_t u1);                            \
  void argmax_rows(const float* x, int64_t V, int64_t r0, int64_t r1, int64_t* out);                      \
  void dense_rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K, int64_t N, float* y,   \
                  int64_t ldy, int64_t n0, int64_t n1);                                                     \
  /* fp32 rows given transposed, xt [K, Mp] (Mp a multiple of 16, zeros past M), times compact weights, */  \
  /* in 16 lanes (the avx512 build only; the others abort) */                                               \
  void gemm_xt(const pipellm::QWeight& w, const float* xt, int64_t M, int64_t Mp, float* y, int64_t ldy,    \
               int64_t n0, int64_t n1);                                                                     \
  /* ... and the rows so laid out: xt [K, Mp] from x [M, K] (K a multiple of 16) */                         \
  void pack_xt(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Mp, float* xt);                  \
  /* bf16 rows times compact weights in AMX tiles, where this build has the code (amx_built()): */          \
  /* pack_bf16_rows lays x [M, K] out as the tiles read it, [(M + 15) / 16, K / 32, 16, 16, 2], and */       \
  /* gemm_bf16 writes y [M, n0:n1] in bf16, n0 a multiple of 32 */                                           \
  bool amx_built();                                                                                         \
  void pack_bf16_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xp);                 \
  void gemm_bf16(const pipellm::QWeight& w, const uint16_t* xp, int64_t M, uint16_t* y, int64_t ldy,        \
                 int64_t n0, int64_t n1);                                                                   \
  /* fp32 rows times Q4/Q8 codes (groups of 16 or 32) through AMX tiles (amx_built()): pack_f32_parts lays */  \
  /* x [M, K] out as three bf16 parts, [(M + 15) / 16, K / 32, 3, 16, 16, 2], and its sums per group of G = */    \
  /* 1 or 2 a block, [(M + 15) / 16, K / 32, G, 16]; gemm_f32_amx writes y [M, n0:n1] in fp32, n0 a multiple */  \
  /* of 32 */                                                                                                    \
  void pack_f32_parts(const float* x, int64_t ldx, int64_t M, int64_t K, int G, uint16_t* xp, float* xsum);    \
  void gemm_f32_amx(const pipellm::QWeight& w, const uint16_t* xp, const float* xsum, int64_t M, float* y,      \
                    int64_t ldy, int64_t n0, int64_t n1);                                                       \
  /* greedy picks' candidates (ops.cpp's greedy_pick; the avx512 build): the j of a [N] (bf16 or fp32) with */  \
  /* a_j + b_j >= max_k (a_k - b_k), b_j = alpha n1_j + beta n2_j + c |a_j| + floor, ascending into cand; how */  \
  /* many, or -1 where some a_j is not finite */                                                              \
  int64_t greedy_candidates(const uint16_t* a, int64_t N, const float* n1, const float* n2, float alpha,     \
                            float beta, float c, float floor, int64_t* cand);                               \
  int64_t greedy_candidates(const float* a, int64_t N, const float* n1, const float* n2, float alpha,        \
                            float beta, float c, float floor, int64_t* cand);                               \
  /* ... their first pass for Q8 codes (group 32, no min) in integers: pack_i8_rows lays out rows rounded by */  \
  /* quantize_acts (q [M, K], d [M, K / 32]) as [(M + 15) / 16, K / 32, 8, 16, 4], their scales as */            \
  /* [(M + 15) / 16, K / 32, 16], and, where xc is given, -128 times their codes' sums a block alike; */         \
  /* gemm_q8_i8_amx (AMX-INT8 tiles) writes y [M, n0:n1] in bf16; gemm_q8_i8_vnni (AVX512-VNNI) writes y */       \
  /* [(M + 15) / 16 * 16, n0:n1 rounded up to 8] in fp32, n0 a multiple of 8 */                                  \
  void pack_i8_rows(const int8_t* q, const float* d, int64_t M, int64_t K, int8_t* xp, float* xd, int32_t* xc); \
  void gemm_q8_i8_vnni(const pipellm::QWeight& w, const int8_t* xp, const float* xd, const int32_t* xc,       \
                       int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1);                             \
  void gemm_q8_i8_amx(const pipellm::QWeight& w, const int8_t* xp, const float* xd, int64_t M, uint16_t* y,   \
                      int64_t ldy, int64_t n0, int64_t n1);                                                   \
  }

PIPELLM_DECLARE_ISA(generic)
PIPELLM_DECLARE_ISA(avx2)
PIPELLM_DECLARE_ISA(avx512)
