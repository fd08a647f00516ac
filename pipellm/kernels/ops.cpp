// A Python module over qgemm.cpp: picks the best instruction set this CPU has at run time and splits rows over
// torch's own thread pool (at::parallel_for), so set_num_threads governs these kernels as it does matmul.
// Plain pybind11 functions rather than torch.ops: a decode step makes ~10 calls a layer, and the dispatcher's
// argument handling cost ~8 us a call against ~1 us here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include <string>

#include "ops.h"
#include "qgemm.h"

namespace {

// Rows of a dense fp32 product that take our kernels (more take sgemm, as fast from ~96 rows on): dense_rows in
// qgemm.cpp
constexpr int64_t kDenseMaxRows = 64;

// bf16 rows that take the AMX tiles: their cost is expanding the weights to bf16 (~0.1 ns a weight), whatever the
// rows; the fused fp32 kernels grow with the rows, and from 3 on cost more (BENCHMARKS.md)
constexpr int64_t kAmxMinRows = 3;
// fp32 rows that take the AMX tiles with Q4/Q8 codes (gemm_f32_amx): the default model's layer shapes (Q4) at 6 rows
// 1.47x (1 thread) and 1.18x (2 threads) the 8-lane kernel, at 5 rows 1.27x and 1.0x (BENCHMARKS.md)
constexpr int64_t kAmxF32MinRows = 6;
// ... with codes in groups of 16 (Q6_K), a tile product a group: at 8 rows 0.97-1.08x, at 9 1.6-1.8x (the 16-lane
// kernel's rows there)
constexpr int64_t kAmxF32MinRows16 = 9;
// fp32 rows from which gemm_xt (16 lanes, x transposed) beats gemm's 8-lane tiles (AVX-512; Xeon with AMX: the
// default model's layers and LM head on one thread at 9 rows 1.15-1.2x, at 15 1.55-1.65x; on two at 9 rows
// 0.9-1.15x; at 8 rows its 16 lanes, half empty, do no better)
constexpr int64_t kXtMinRows = 9;
// ... and up to which it beats expanding slices of weights for sgemm, where fused_max_rows (the 8-lane tiles'
// limit) would send them: at 64 rows 1.1-1.5x on 1 and 2 threads (the default model's layers and LM head, Q4 and
// Q8); at 128, 576 x 1536 on 2 threads ran 0.9x (same CPU)
constexpr int64_t kXtMaxRows = 64;

struct Isa {
  const char* name;
  decltype(&generic::gemm) gemm;
  decltype(&generic::dequant) dequant;
  decltype(&generic::quantize_acts) quantize_acts;
  decltype(&generic::gemm_q8) gemm_q8;
  decltype(&generic::decode_attention) decode_attention;
  decltype(&generic::argmax_rows) argmax_rows;
  decltype(&generic::dense_rows) dense_rows;
  decltype(&generic::gemm_xt) gemm_xt;
  decltype(&generic::pack_xt) pack_xt;
  bool amx;  // bf16 rows through AMX tiles (avx512's code besides)
  bool xt;   // gemm_xt's 16 lanes (avx512's code)
};

// AMX-BF16 and AVX512-BF16 in CPUID, and Linux's leave to use the tiles' 8 KB of state (asked once a process)
bool amx_granted() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool granted = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

// AMX-INT8 besides (every CPU with AMX so far has it; CPUID says, asked once: in a VM each CPUID traps, ~14 us)
bool amx_int8() {
#if defined(__x86_64__)
  static const bool has_int8 = [] {
    unsigned a, b, c, d;
    return amx_granted() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
  }();
  return has_int8;
#else
  return false;
#endif
}

// AVX512-VNNI (CPUID, asked once)
bool vnni() {
#if defined(__x86_64__)
  static const bool has_vnni = [] {
    __builtin_cpu_init();
    return bool(__builtin_cpu_supports("avx512vnni"));
  }();
  return has_vnni;
#else
  return false;
#endif
}

bool has(const char* isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (!std::strcmp(isa, "amx")) return has("avx512") && avx512::amx_built() && amx_granted();
  if (!std::strcmp(isa, "avx512"))
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (!std::strcmp(isa, "avx2"))
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  return !std::strcmp(isa, "generic");
}

#define PIPELLM_ISA_ENTRY(NAME, NS, AMX, XT)                                                                  \
  {NAME, NS::gemm, NS::dequant, NS::quantize_acts, NS::gemm_q8, NS::decode_attention, NS::argmax_rows,          \
   NS::dense_rows, NS::gemm_xt, NS::pack_xt, AMX, XT}
const Isa kIsas[] = {PIPELLM_ISA_ENTRY("amx", avx512, true, true), PIPELLM_ISA_ENTRY("avx512", avx512, false, true),
                     PIPELLM_ISA_ENTRY("avx2", avx2, false, false),
                     PIPELLM_ISA_ENTRY("generic", generic, false, false)};

const Isa& pick(const std::string& isa) {
  std::string want = isa;
  if (want.empty()) {
    const char* env = std::getenv("PIPELLM_ISA");  // to compare paths in tests and benchmarks
    want = env ? env : "";
  }
  for (const Isa& i : kIsas) {
    if (want.empty() ? has(i.name) : want == i.name) {
      TORCH_CHECK(has(i.name), "this CPU lacks the ", i.name, " instructions");
      return i;
    }
  }
  TORCH_CHECK(false, "unknown instruction set '", want, "' (amx, avx512, avx2 or generic)");
}

pipellm::QWeight describe(const at::Tensor& qs, const c10::optional<at::Tensor>& scale,
                          const c10::optional<at::Tensor>& min, int64_t kind, int64_t group,
                          const c10::optional<at::Tensor>& super_scale, const c10::optional<at::Tensor>& super_min,
                          const c10::optional<at::Tensor>& high, int64_t offset) {
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.device().is_cpu(), "qs must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(kind >= pipellm::F16 && kind <= pipellm::Q8, "unknown weight kind ", kind);
  pipellm::QWeight w{};
  w.qs = static_cast<const uint8_t*>(qs.data_ptr());
  w.qs_stride = qs.size(1) * qs.element_size();
  w.kind = int(kind);
  w.group = int(group);
  if (kind == pipellm::F16 || kind == pipellm::BF16) {
    TORCH_CHECK(qs.element_size() == 2, "F16/BF16 weights must have 2-byte elements");
    w.K = qs.size(1);
    w.group = 32;
  } else {
    TORCH_CHECK(qs.element_size() == 1, "Q4/Q8 codes must be 1-byte elements");
    w.K = kind == pipellm::Q4 ? qs.size(1) * 2 : qs.size(1);
    if (high.has_value()) {  // bit planes: 5- and 6-bit codes
      TORCH_CHECK(kind == pipellm::Q4 && high->scalar_type() == at::kByte && high->is_contiguous() &&
                  high->dim() == 2 && high->size(0) == qs.size(0) && high->size(1) % (w.K / 8) == 0,
                  "bit planes must be uint8 [N, planes * K / 8] beside Q4 codes");
      w.planes = int(high->size(1) / (w.K / 8));
      w.qh = static_cast<const uint8_t*>(high->data_ptr());
      w.qh_stride = high->size(1);
      TORCH_CHECK(w.planes == 1 || w.planes == 2, "1 or 2 bit planes, got ", w.planes);
      TORCH_CHECK(offset >= 0 && offset <= 32, "code offset must be in [0, 32]");
      w.offset = int(offset);
    }
    TORCH_CHECK(group == 32 || (group == 16 && (kind == pipellm::Q8 || w.planes == 2)), "unsupported group size ",
                group);
    TORCH_CHECK(scale.has_value(), "Q4/Q8 weights need scales");
    const at::Tensor& s = *scale;
    TORCH_CHECK(s.is_contiguous() && s.dim() == 2 && s.size(0) == qs.size(0) && s.size(1) == w.K / group,
                "scales must be [N, K / group] and contiguous");
    w.scale = s.data_ptr();
    w.s_stride = s.size(1);
    if (super_scale.has_value() && w.planes == 2) {  // Q6_K: int8 multiples of an fp16 per 256, no mins
      TORCH_CHECK(s.scalar_type() == at::kChar && !min.has_value() && group == 16 && w.K % 256 == 0 &&
                  super_scale->scalar_type() == at::kHalf && super_scale->is_contiguous() &&
                  super_scale->dim() == 2 && super_scale->size(0) == qs.size(0) && super_scale->size(1) == w.K / 256,
                  "6-bit codes: int8 scales per 16, fp16 super-scales [N, K / 256], no mins");
      w.super_scale = super_scale->data_ptr();
      w.scale_kind = pipellm::SCALE_TWO_LEVEL_I8;
    } else if (super_scale.has_value()) {  // two-level: uint8 multiples of an fp16 per 256 weights, scales and mins
      TORCH_CHECK(s.scalar_type() == at::kByte && min.has_value() && super_min.has_value() && group == 32 &&
                  w.K % 256 == 0, "two-level scales: uint8 scales and mins, fp16 super-scales, K a multiple of 256");
      for (const at::Tensor* t : {&*super_scale, &*super_min})
        TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == qs.size(0) && t->size(1) == w.K / 256, "super-scales must be fp16 [N, K / 256]");
      w.super_scale = super_scale->data_ptr();
      w.super_min = super_min->data_ptr();
      w.scale_kind = pipellm::SCALE_TWO_LEVEL;
    } else {
      TORCH_CHECK(s.scalar_type() == at::kHalf || s.scalar_type() == at::kFloat, "scales must be fp16 or fp32");
      w.scale_kind = s.scalar_type() == at::kFloat ? pipellm::SCALE_F32 : pipellm::SCALE_F16;
    }
    if (min.has_value()) {
      TORCH_CHECK(min->sizes() == s.sizes() && min->scalar_type() == s.scalar_type() && min->is_contiguous(),
                  "mins must match the scales");
      w.min = min->data_ptr();
    }
    TORCH_CHECK(!(w.scale_kind == pipellm::SCALE_F32 && kind == pipellm::Q4 && !w.min),
                "fp32-scaled Q4 weights need mins");
    TORCH_CHECK(w.planes != 2 || w.scale_kind == pipellm::SCALE_TWO_LEVEL_I8, "6-bit codes take two-level scales");
    TORCH_CHECK(w.planes != 1 || (group == 32 && (w.scale_kind == pipellm::SCALE_F16 ||
                                                  w.scale_kind == pipellm::SCALE_TWO_LEVEL)),
                "5-bit codes take fp16 or two-level scales per 32");
    TORCH_CHECK(!(w.group == 16 && w.min), "groups of 16 take no mins");
  }
  TORCH_CHECK(w.K % 32 == 0, "K must be a multiple of 32, got ", w.K);
  return w;
}

// x @ W^T for x fp32 or bf16 [M, K] (checked by the callers), W [N, K] described by w; y has x's dtype.
at::Tensor qmatmul(const at::Tensor& x, const pipellm::QWeight& w, int64_t N, int64_t fused_max_rows, bool int8_acts,
                   int64_t integer_max_rows, const Isa& impl) {
  at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = w.K;
  const bool bf16 = xc.scalar_type() == at::kBFloat16;  // dtype="bfloat16"
  if (bf16 && impl.amx && !int8_acts && M >= kAmxMinRows) {
    // AMX tiles multiply the rows with each 16 weight rows expanded to bf16 (as a dense bf16 copy would be)
    at::Tensor xp = at::empty({(M + 15) / 16 * 16 * K}, xc.options());
    auto* xp16 = reinterpret_cast<uint16_t*>(xp.data_ptr<at::BFloat16>());
    avx512::pack_bf16_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), K, M, K, xp16);
    at::Tensor y = at::empty({M, N}, xc.options());
    auto* y16 = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t b0, int64_t b1) {
      avx512::gemm_bf16(w, xp16, M, y16, N, b0 * 32, std::min(b1 * 32, N));
    });
    return y;
  }
  if (!bf16 && impl.amx && !int8_acts && (w.kind == pipellm::Q4 || w.kind == pipellm::Q8) &&
      M >= (w.group == 16 ? kAmxF32MinRows16 : kAmxF32MinRows)) {
    // AMX tiles multiply the codes, exact in bf16, by the rows split into three bf16 parts (packed once a call)
    const int64_t nb = K / 32, groups = (M + 15) / 16;
    const int G = int(32 / w.group);  // scales a block
    at::Tensor xp = at::empty({groups * nb * 3 * 512}, xc.options().dtype(at::kBFloat16));
    at::Tensor sums = at::empty({groups * nb * G * 16}, xc.options());
    auto* xp16 = reinterpret_cast<uint16_t*>(xp.data_ptr<at::BFloat16>());
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {  // a group of 16 rows at a time, each laid out alone
      avx512::pack_f32_parts(xc.data_ptr<float>() + g0 * 16 * K, K, std::min(M, g1 * 16) - g0 * 16, K, G,
                             xp16 + g0 * nb * 1536, sums.data_ptr<float>() + g0 * nb * G * 16);
    });
    at::Tensor y = at::empty({M, N}, xc.options());
    at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t b0, int64_t b1) {
      avx512::gemm_f32_amx(w, xp16, sums.data_ptr<float>(), M, y.data_ptr<float>(), N, b0 * 32,
                           std::min(b1 * 32, N));
    });
    return y;
  }
  if (bf16 && (M <= fused_max_rows || int8_acts))  // our kernels, which multiply in fp32
    return qmatmul(xc.to(at::kFloat), w, N, fused_max_rows, int8_acts, integer_max_rows, impl).to(at::kBFloat16);
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  if (int8_acts) {
    // The rows rounded to 8 bits per 32 first. One row (a decode step of one sequence) multiplies codes in
    // integers, 1.1-1.9x faster than expanding them to fp32 here; more rows take the rounded rows through the fp32
    // paths below, where the integer products gain nothing (BENCHMARKS.md). Codes and scales live in a per-thread
    // scratch buffer: four tensor allocations a call cost more than rounding one row.
    thread_local std::vector<float> scratch;
    const int64_t nb = K / 32;
    scratch.resize(size_t(M * (K / 4 + nb + 2 * nb + nb)));
    int8_t* q = reinterpret_cast<int8_t*>(scratch.data());           // [M, K]
    float* d = scratch.data() + M * K / 4;                            // [M, K/32]
    float* ds = d + M * nb;                                           // [M, K/16]
    float* ds32 = ds + 2 * M * nb;                                    // [M, K/32]
    const bool integer = M <= integer_max_rows;
    at::Tensor rounded = integer ? at::Tensor() : at::empty({M, K}, xc.options());
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      impl.quantize_acts(xc.data_ptr<float>(), K, m0, m1, K, q, d, ds, ds32,
                         integer ? nullptr : rounded.data_ptr<float>());
    });
    if (integer) {
      const pipellm::QActs a{q, d, ds, ds32, M, K};
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { impl.gemm_q8(w, a, y.data_ptr<float>(), N, n0, n1); });
      return y;
    }
    xc = rounded;
  }
  if (impl.xt && !bf16 && fused_max_rows >= kXtMinRows && M >= kXtMinRows &&
      M <= std::max(fused_max_rows, kXtMaxRows)) {
    // 16 lanes: each group of weight rows expanded once for all rows, which go transposed (packed once a call)
    const int64_t Mp = (M + 15) / 16 * 16;
    at::Tensor xt = at::empty({K, Mp}, xc.options());
    impl.pack_xt(xc.data_ptr<float>(), K, M, K, Mp, xt.data_ptr<float>());
    at::parallel_for(0, (N + 7) / 8, 1, [&](int64_t b0, int64_t b1) {
      impl.gemm_xt(w, xt.data_ptr<float>(), M, Mp, y.data_ptr<float>(), N, b0 * 8, std::min(b1 * 8, N));
    });
    return y;
  }
  if (M <= fused_max_rows) {
    // few rows (decoding): expand each weight block once, in registers, for all rows
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      impl.gemm(w, xc.data_ptr<float>(), M, K, y.data_ptr<float>(), N, n0, n1);
    });
    return y;
  }
  // many rows (prefill): expand a slice of weight rows at a time (~2 MB of fp32) and let torch's matmul use it.
  // bf16 rows multiply the slice rounded to bf16, as a dense bf16 copy of the weights would be: torch's bf16 matmul
  // has bf16 dot products where the CPU does.
  const int64_t chunk = std::max<int64_t>(64, ((int64_t(1) << 19) / K) / 16 * 16);
  at::Tensor buf = at::empty({std::min(chunk, N), K}, xc.options().dtype(at::kFloat));
  at::Tensor buf16 = bf16 ? at::empty_like(buf, xc.options()) : at::Tensor();
  at::Tensor rows = at::arange(N, at::kLong);
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t r = std::min(chunk, N - n0);
    const int64_t* idx = rows.data_ptr<int64_t>() + n0;
    float* out = buf.data_ptr<float>();
    at::parallel_for(0, r, 8, [&](int64_t a, int64_t b) { impl.dequant(w, idx + a, b - a, out + a * K); });
    at::Tensor slice = buf.narrow(0, 0, r);
    if (bf16) slice = buf16.narrow(0, 0, r).copy_(slice);
    at::Tensor out_cols = y.narrow(1, n0, r);  // written in place: rows of stride N, as BLAS takes them
    at::mm_out(out_cols, xc, slice.t());
  }
  return y;
}

at::Tensor dequant_rows(const at::Tensor& qs, const c10::optional<at::Tensor>& scale,
                        const c10::optional<at::Tensor>& min, int64_t kind, int64_t group,
                        const c10::optional<at::Tensor>& super_scale, const c10::optional<at::Tensor>& super_min,
                        const c10::optional<at::Tensor>& high, int64_t offset, const at::Tensor& rows,
                        const std::string& isa) {
  const pipellm::QWeight w = describe(qs, scale, min, kind, group, super_scale, super_min, high, offset);
  const Isa& impl = pick(isa);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be a 1-D int64 tensor");
  const at::Tensor r = rows.contiguous();
  const int64_t R = r.size(0), N = qs.size(0);
  const int64_t* idx = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; i++) TORCH_CHECK(idx[i] >= 0 && idx[i] < N, "row index out of range [0, ", N, ")");
  at::Tensor out = at::empty({R, w.K}, at::kFloat);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, R, 4, [&](int64_t a, int64_t b) { impl.dequant(w, idx + a, b - a, o + a * w.K); });
  return out;
}

}  // namespace

namespace pipellm {

// The least values a thread takes in the row-wise ops below: a decode step's few rows stay on one, a prefill chunk's
// go to all (on one, RMSNorm and rotary were ~3% of a 512-token chunk while the other threads waited)
constexpr int64_t kRowsGrain = 32768;

// Decode steps run these on a handful of rows, where a chain of small torch ops costs more than the arithmetic:
// one call each instead of 8 (RMSNorm) or 12 (rotary). Same operations in the same order as the torch twins in
// models/layers.py; this file is compiled with -ffp-contract=off so no multiply-add is fused differently.
// x [T, H] and weight [H], both fp32 or both bf16. In HF Llama's order: normalised in fp32, rounded to x's dtype,
// then scaled (a bf16 product rounded again).
template <typename T>
static void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), H = x.size(1);
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, rows, kRowsGrain / std::max<int64_t>(H, 1) + 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const T* xr = x.data_ptr<T>() + t * x.stride(0);
      T* o = out.data_ptr<T>() + t * H;
      // in double: no worse than torch's float reduction, whatever its order; 8 sums, not one chain of adds
      double part[8] = {};
      int64_t i = 0;
      for (; i + 8 <= H; i += 8)
        for (int j = 0; j < 8; j++) part[j] += double(float(xr[i + j])) * float(xr[i + j]);
      for (; i < H; i++) part[0] += double(float(xr[i])) * float(xr[i]);
      const double ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      const float inv = 1.0f / std::sqrt(float(ss / H) + float(eps));
      for (i = 0; i < H; i++) o[i] = T(float(w[i]) * float(T(float(xr[i]) * inv)));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto type = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (type == at::kFloat || type == at::kBFloat16) && x.stride(1) == 1,
              "x must be fp32 or bf16 [T, H], rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == type && weight.size(0) == x.size(1) &&
              weight.is_contiguous(), "weight must be [H], of x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (type == at::kFloat)
    rms_norm_rows<float>(x, weight, eps, out);
  else
    rms_norm_rows<at::BFloat16>(x, weight, eps, out);
  return out;
}

// Each product and the sum rounded to T, as torch's ops on T round them (bf16: HF's q * cos + rotate_half(q) * sin)
template <typename T>
static void rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rows = cos.size(0), D = cos.numel() / std::max<int64_t>(rows, 1), half = D / 2;
  auto r = [](float v) { return float(T(v)); };
  at::parallel_for(0, rows, kRowsGrain / std::max<int64_t>(x.size(1) * D, 1) + 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(D);
    for (int64_t t = t0; t < t1; t++) {
      const T* c = cos.data_ptr<T>() + t * D;
      const T* s = sin.data_ptr<T>() + t * D;
      for (int64_t h = 0; h < x.size(1); h++) {
        T* v = x.data_ptr<T>() + t * x.stride(0) + h * x.stride(1);
        for (int64_t i = 0; i < half; i++)
          tmp[i] = r(r(float(v[i]) * float(c[i])) + r(-float(v[i + half]) * float(s[i])));
        for (int64_t i = half; i < D; i++)
          tmp[i] = r(r(float(v[i]) * float(c[i])) + r(float(v[i - half]) * float(s[i])));
        for (int64_t i = 0; i < D; i++) v[i] = T(tmp[i]);
      }
    }
  });
}

// q [T, H, D] and k [T, KV, D] rotated in place by cos/sin [T, D] (rotate-half layout); last dims contiguous; all fp32
// or all bf16.
void rotary_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const auto type = cos.scalar_type();
  TORCH_CHECK((type == at::kFloat || type == at::kBFloat16) && sin.scalar_type() == type && cos.is_contiguous() &&
              sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "cos/sin must be contiguous fp32 or bf16 tables of one shape");
  const int64_t T = cos.size(0), D = cos.numel() / std::max<int64_t>(T, 1);
  for (const at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->scalar_type() == type && x->size(0) == T && x->size(2) == D && x->stride(2) == 1,
                "q/k must be [T, heads, D] of the tables' dtype, D contiguous");
    if (type == at::kFloat)
      rotate_rows<float>(*x, cos, sin);
    else
      rotate_rows<at::BFloat16>(*x, cos, sin);
  }
}

// K and V of T new tokens [T, KV, D] (each head's D values contiguous; q, k and v are views of one matmul's output)
// into flat slots of caches [blocks, block_size, KV, D] of their own dtype: one call instead of two index_puts.
void kv_cache_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
                    const at::Tensor& v) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [blocks, block_size, KV, D], alike");
  const int64_t slots_total = k_cache.size(0) * k_cache.size(1), KV = k_cache.size(2), D = k_cache.size(3);
  const int64_t T = slots.numel(), es = k_cache.element_size();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1, "slots must be int64 [T]");
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == T && x->size(1) == KV && x->size(2) == D && x->stride(2) == 1 &&
                x->scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                "k and v must be [T, KV, D] in the caches' dtype, each head's values contiguous");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++) {
    TORCH_CHECK(sl[t] >= 0 && sl[t] < slots_total, "slot out of range of the cache");
    for (auto [cache, x] : {std::pair{&k_cache, &k}, std::pair{&v_cache, &v}})
      for (int64_t h = 0; h < KV; h++)
        std::memcpy(static_cast<char*>(cache->data_ptr()) + ((sl[t] * KV + h) * D) * es,
                    static_cast<const char*>(x->data_ptr()) + (t * x->stride(0) + h * x->stride(1)) * es, D * es);
  }
}

// An int8 KV cache's write (models/kv_cache.py's _write_int8 is its torch twin, with the same arithmetic): x [T, KV, D]
// fp32 into flat slots of cache [blocks, block_size, KV, D], scale [blocks, KV] = largest |value| / 127 per block and
// head. A block's first token resets its scale; a scale that grows re-rounds what the block held.
void kv_cache_write_int8(const at::Tensor& cache, const at::Tensor& scale, const at::Tensor& slots, const at::Tensor& x) {
  TORCH_CHECK(cache.dim() == 4 && cache.scalar_type() == at::kChar && cache.is_contiguous(),
              "cache must be contiguous int8 [blocks, block_size, KV, D]");
  const int64_t N = cache.size(0), bs = cache.size(1), KV = cache.size(2), D = cache.size(3), T = slots.numel();
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == N &&
              scale.size(1) == KV, "scale must be contiguous fp32 [blocks, KV]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1, "slots must be int64 [T]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3 && x.size(0) == T &&
              x.size(1) == KV && x.size(2) == D, "x must be contiguous fp32 [T, KV, D]");
  int8_t* c = cache.data_ptr<int8_t>();
  float* sc = scale.data_ptr<float>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  for (int64_t t = 0; t < T; t++) {
    TORCH_CHECK(sl[t] >= 0 && sl[t] < N * bs, "slot out of range of the cache");
    if (sl[t] % bs == 0) std::fill(sc + sl[t] / bs * KV, sc + (sl[t] / bs + 1) * KV, 0.0f);
  }
  std::vector<int64_t> blocks;
  std::vector<float> before;  // the touched blocks' scales before this write
  for (int64_t t = 0; t < T; t++) {
    const int64_t b = sl[t] / bs;
    if (std::find(blocks.begin(), blocks.end(), b) == blocks.end()) {
      blocks.push_back(b);
      before.insert(before.end(), sc + b * KV, sc + (b + 1) * KV);
    }
  }
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < KV; h++) {
      const float* v = xp + (t * KV + h) * D;
      float amax = 0;
      for (int64_t i = 0; i < D; i++) amax = std::max(amax, std::fabs(v[i]));
      float& s = sc[sl[t] / bs * KV + h];
      s = std::max(s, amax / 127.0f);
    }
  for (size_t u = 0; u < blocks.size(); u++)
    for (int64_t h = 0; h < KV; h++) {
      const float old = before[u * KV + h], now = sc[blocks[u] * KV + h];
      if (!(old > 0 && now > old)) continue;
      const float ratio = old / now;
      for (int64_t o = 0; o < bs; o++) {
        int8_t* p = c + ((blocks[u] * bs + o) * KV + h) * D;
        for (int64_t i = 0; i < D; i++) p[i] = int8_t(std::nearbyint(float(p[i]) * ratio));
      }
    }
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < KV; h++) {
      const float s = std::max(sc[sl[t] / bs * KV + h], std::numeric_limits<float>::min());
      const float* v = xp + (t * KV + h) * D;
      int8_t* p = c + (sl[t] * KV + h) * D;
      for (int64_t i = 0; i < D; i++) p[i] = int8_t(std::clamp(std::nearbyint(v[i] / s), -127.0f, 127.0f));
    }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window,
                                  double scale, double softcap, const std::string& isa,
                                  const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous fp32 [B, H, D]");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->dim() == 1 && sinks->size(0) == q.size(1)),
              "sinks must be contiguous fp32 [H]");
  const auto type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == type &&
              (type == at::kFloat || type == at::kBFloat16 || type == at::kChar),
              "caches must be contiguous fp32, bf16 or int8 [blocks, block_size, KV, D], both alike");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(2);
  const bool int8 = type == at::kChar;
  TORCH_CHECK(int8 == k_scale.has_value() && int8 == v_scale.has_value(), "int8 caches, and only they, need scales");
  if (int8)
    for (const auto& s : {*k_scale, *v_scale})
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 &&
                  s.size(0) == k_cache.size(0) && s.size(1) == KV, "scales must be contiguous fp32 [blocks, KV]");
  TORCH_CHECK(k_cache.size(3) == D && H % KV == 0, "head sizes disagree");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.scalar_type() == at::kLong &&
              block_tables.is_contiguous(), "block_tables must be contiguous int64 [B, width]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == B && seq_lens.scalar_type() == at::kLong &&
              seq_lens.is_contiguous(), "seq_lens must be contiguous int64 [B]");
  const int64_t bs = k_cache.size(1), width = block_tables.size(1);
  // every block a sequence reads must be in the cache (plain loops: a few torch reductions cost more than the rest)
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * bs, "seq_lens out of range of the block tables");
    for (int64_t i = 0; i < width; i++)
      TORCH_CHECK(tables[b * width + i] >= 0 && tables[b * width + i] < k_cache.size(0), "block id out of range");
  }
  at::Tensor out = at::empty_like(q);
  const int64_t chunk_keys = pipellm::DECODE_CHUNK_BLOCKS * bs;
  int64_t num_chunks = 1;
  for (int64_t b = 0; b < B; b++) num_chunks = std::max(num_chunks, (lens[b] - 1) / chunk_keys + 1);
  at::Tensor partial = num_chunks > 1 ? at::empty({B, num_chunks, H, D + 2}, q.options()) : at::Tensor();
  const int kind = int8 ? pipellm::CACHE_I8 : type == at::kBFloat16 ? pipellm::CACHE_BF16 : pipellm::CACHE_F32;
  pipellm::DecodeArgs a{q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
                        int8 ? k_scale->data_ptr<float>() : nullptr, int8 ? v_scale->data_ptr<float>() : nullptr, kind,
                        block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                        width, bs, window, H, KV, D, float(scale), chunk_keys, num_chunks,
                        num_chunks > 1 ? partial.data_ptr<float>() : nullptr, float(softcap),
                        sinks.has_value() ? sinks->data_ptr<float>() : nullptr};
  const Isa& impl = pick(isa);
  // Units (sequence b, chunk c) in contiguous spans of about equal keys, one a thread: split by count, the threads
  // holding the longer sequences finish last (a 4,096-token context among short ones: the others wait).
  const int64_t units = B * num_chunks, threads = std::min<int64_t>(at::get_num_threads(), units);
  std::vector<int64_t> keys(units + 1, 0);  // keys[u]: the keys of the units before u, 16 more a unit (its setup)
  for (int64_t u = 0; u < units; u++) {
    const int64_t b = u / num_chunks, c = u % num_chunks, first = pipellm::first_key(lens[b], window);
    const int64_t n = std::min(lens[b], (c + 1) * chunk_keys) - std::max(first, c * chunk_keys);
    keys[u + 1] = keys[u] + (n > 0 ? n + 16 : 0);
  }
  std::vector<int64_t> spans(threads + 1, units);
  for (int64_t t = 0, u = 0; t < threads; t++) {
    while (u < units && keys[u] * threads < keys[units] * t) u++;
    spans[t] = u;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) impl.decode_attention(a, spans[t], spans[t + 1]);
  });
  if (num_chunks > 1)  // a sequence over several chunks: its chunks' results, each rescaled to the common max
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; b++) {
        const int64_t c0 = pipellm::first_key(lens[b], window) / chunk_keys, c1 = (lens[b] - 1) / chunk_keys + 1;
        if (c1 - c0 == 1) continue;  // written whole by its one unit
        for (int64_t h = 0; h < H; h++) {
          auto at = [&](int64_t c) { return a.partial + ((b * num_chunks + c) * H) * (D + 2); };
          float mx = -INFINITY, sum = 0.0f;
          for (int64_t c = c0; c < c1; c++) mx = std::max(mx, at(c)[H * D + h]);
          float* o = a.out + (b * H + h) * D;
          std::fill(o, o + D, 0.0f);
          for (int64_t c = c0; c < c1; c++) {
            const float w = std::exp(at(c)[H * D + h] - mx);
            sum += w * at(c)[H * D + H + h];
            for (int64_t i = 0; i < D; i++) o[i] += w * at(c)[h * D + i];
          }
          if (a.sinks) sum += std::exp(a.sinks[h] - mx);
          for (int64_t i = 0; i < D; i++) o[i] /= sum;
        }
      }
    });
  return out;
}

at::Tensor Linear::operator()(const at::Tensor& x) const {
  const auto type = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (type == at::kFloat || type == at::kBFloat16) && x.size(1) == K,
              "x must be fp32 or bf16 [M, ", K, "]");
  std::vector<at::Tensor> ys;
  for (const Part& p : parts) {
    if (!p.dense.defined()) {
      ys.push_back(qmatmul(x, p.w, p.N, p.fused_max_rows, p.int8_acts, p.integer_max_rows, kIsas[p.isa]));
      continue;
    }
    const at::Tensor xf = x.to(at::kFloat);  // dense parts are fp32
    const int64_t M = xf.size(0);
    if (M <= kDenseMaxRows && p.dense.is_contiguous()) {  // few rows: our kernel, columns over the threads by 16
      const int64_t N = p.N;
      at::Tensor y = at::zeros({M, N}, xf.options());
      const at::Tensor xc = xf.contiguous();
      const float *xp = xc.data_ptr<float>(), *wp = p.dense.data_ptr<float>();
      float* yp = y.data_ptr<float>();
      const auto rows = kIsas[p.isa].dense_rows;
      at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t u0, int64_t u1) {
        rows(xp, K, M, wp, K, N, yp, N, u0 * 16, std::min(N, u1 * 16));
      });
      ys.push_back((p.dense_bias.has_value() ? y + *p.dense_bias : y).to(type));
      continue;
    }
    ys.push_back((p.dense_bias.has_value() ? at::addmm(*p.dense_bias, xf, p.dense)  // as TransposedLinear did
                                           : at::mm(xf, p.dense)).to(type));
  }
  at::Tensor y = ys.size() == 1 ? ys[0] : at::cat(ys, 1);
  return bias.has_value() ? (y + *bias).to(type) : y;
}

}  // namespace pipellm

namespace {

using pipellm::Linear;

Linear compact_linear(const at::Tensor& qs, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& min,
                      int64_t kind, int64_t group, const c10::optional<at::Tensor>& super_scale,
                      const c10::optional<at::Tensor>& super_min, const c10::optional<at::Tensor>& high,
                      int64_t offset, int64_t fused_max_rows, bool int8_acts, int64_t integer_max_rows,
                      const std::string& isa) {
  Linear::Part p;
  p.w = describe(qs, scale, min, kind, group, super_scale, super_min, high, offset);
  TORCH_CHECK(!int8_acts || kind == pipellm::Q4 || kind == pipellm::Q8, "8-bit activations need Q4 or Q8 weights");
  p.keep = {qs};
  for (const auto* t : {&scale, &min, &super_scale, &super_min, &high})
    if (t->has_value()) p.keep.push_back(**t);
  p.N = qs.size(0);
  p.fused_max_rows = fused_max_rows;
  p.int8_acts = int8_acts;
  p.integer_max_rows = integer_max_rows;
  p.isa = int(&pick(isa) - kIsas);
  Linear l;
  l.K = p.w.K;
  l.parts.push_back(std::move(p));
  return l;
}

// Python's ops.qlinear: the weight bound for one call (tests and benchmarks pick the ISA and the paths with it)
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& scale,
                   const c10::optional<at::Tensor>& min, int64_t kind, int64_t group,
                   const c10::optional<at::Tensor>& super_scale, const c10::optional<at::Tensor>& super_min,
                   const c10::optional<at::Tensor>& high, int64_t offset, int64_t fused_max_rows, bool int8_acts,
                   int64_t integer_max_rows, const std::string& isa) {
  return compact_linear(qs, scale, min, kind, group, super_scale, super_min, high, offset, fused_max_rows, int8_acts,
                        integer_max_rows, isa)(x);
}

void check_bias(const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat),
              "bias must be fp32 [", N, "]");
}

Linear dense_linear(const at::Tensor& weight_t, const c10::optional<at::Tensor>& bias, const std::string& isa) {
  TORCH_CHECK(weight_t.dim() == 2 && weight_t.scalar_type() == at::kFloat, "a dense weight must be fp32 [K, N]");
  check_bias(bias, weight_t.size(1));
  Linear::Part p;
  p.dense = weight_t;
  p.dense_bias = bias;
  p.isa = int(&pick(isa) - kIsas);
  p.N = weight_t.size(1);
  Linear l;
  l.K = weight_t.size(0);
  l.parts.push_back(std::move(p));
  return l;
}

Linear concat_linear(const std::vector<Linear>& blocks, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(!blocks.empty(), "no blocks of rows");
  Linear l;
  l.K = blocks[0].K;
  for (const Linear& b : blocks) {
    TORCH_CHECK(b.K == l.K && !b.bias.has_value(), "blocks of rows must share K and have no bias of their own");
    l.parts.insert(l.parts.end(), b.parts.begin(), b.parts.end());
  }
  check_bias(bias, l.out_features());
  l.bias = bias;
  return l;
}

std::string best_isa() { return pick("").name; }

// Greedy picks: each row's index of its largest logit (the first, or the first NaN), as logits.max(-1).indices,
// which took ~0.8 ms for 32 rows of the default model's 49,152 logits on one thread (this: ~0.25)
at::Tensor argmax_rows(const at::Tensor& logits, const std::string& isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
              logits.device().is_cpu() && logits.size(1) > 0, "logits must be contiguous fp32 [rows, vocab] on a CPU");
  const int64_t R = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  const Isa& impl = pick(isa);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    impl.argmax_rows(logits.data_ptr<float>(), V, r0, r1, out.data_ptr<int64_t>());
  });
  return out;
}

// Q8 codes with a scale per 32 (Q8_0, int8 quantization), and integer products to take them as they are: the
// AMX-INT8 tiles, or, in the avx512 code without tiles, AVX512-VNNI
bool greedy_int8(const pipellm::QWeight& w, const Isa& impl) {
  return w.kind == pipellm::Q8 && w.group == 32 && !w.min &&
         (w.scale_kind == pipellm::SCALE_F16 || w.scale_kind == pipellm::SCALE_F32) &&
         (impl.amx ? amx_int8() : impl.xt && vnni());
}

// Greedy picks without every fp32 logit: each row r of x [R, K] (fp32) gets the first j of the largest L[r, j],
// where L[r, j] is x_r's fp32 dot product with weight row j, and only a few L are computed. The AMX tiles first
// multiply bf16-rounded rows by bf16-rounded weights (~2x faster than the fp32 products at 16 rows), giving a[r, j]
// with |a - L| <= b[r, j] (the bound below). A j with a + b below max_k (a - b) cannot hold the largest L, so only the
// rest (the candidates: on the default model's rows a median of 2 of its 49,152) get their L, here, in one order.
// norms [2, N]: each weight row's ||bf16(w)|| and ||w - bf16(w)||, rounded up (Python's, once, from dequant). The
// tiles must round the same fp32 weights dequant gives (QuantWeight.expands_alike), which L multiplies.
// A row whose a or L are not finite gets -1: the caller takes the full logits instead.
at::Tensor greedy_pick(const Linear& lin, const at::Tensor& x, const at::Tensor& norms) {
  TORCH_CHECK(lin.parts.size() == 1 && !lin.parts[0].dense.defined() && !lin.bias.has_value(),
              "greedy_pick takes one compact weight without bias");
  const Linear::Part& p = lin.parts[0];
  const Isa& impl = kIsas[p.isa];
  const int64_t R = x.size(0), K = lin.K, N = p.N;
  const pipellm::QWeight& w = p.w;
  const bool int8_weight = greedy_int8(w, impl);  // the int8 products take from one row
  TORCH_CHECK((impl.amx || int8_weight) && !p.int8_acts,
              "greedy_pick needs fp32 activations and the AMX tiles, or AVX512-VNNI and Q8 codes with a scale per 32");
  const int64_t min_rows = int8_weight ? 1 : kAmxMinRows;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == K &&
              R >= min_rows, "x must be contiguous fp32 [rows >= ", min_rows, ", ", K, "]");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.dim() == 2 && norms.size(0) == 2 &&
              norms.size(1) == N, "norms must be fp32 [2, ", N, "]");
  // With the tiles, up to 16 rows, Q8 codes with a scale per 32 go to the int8 tiles as they are (rows rounded to 8
  // bits); the others to the bf16 tiles expanded (rows rounded to bf16), where all of K sums in a tile: each
  // further 16 rows would pay the int8 blocks' scaling again (the default model's head, one thread: 16 rows 2.8
  // against 3.7 ms, 32 rows 5.2 against 5.1). Without tiles, those codes meet the 8-bit rows in AVX512-VNNI's
  // integer products, whatever the rows. Either way a = x_hat . w_hat, x_hat the rows as rounded.
  const bool int8 = int8_weight && (!impl.amx || R <= 16);
  at::Tensor a, x_hat;
  if (int8) {
    const int64_t nb = K / 32, groups = (R + 15) / 16;
    at::Tensor q = at::empty({R, K}, x.options().dtype(at::kChar));
    at::Tensor scales = at::empty({4 * R * nb}, x.options());  // d [R, nb], then quantize_acts' sums (unused)
    float* d = scales.data_ptr<float>();
    x_hat = at::empty({R, K}, x.options());
    impl.quantize_acts(x.data_ptr<float>(), K, 0, R, K, q.data_ptr<int8_t>(), d, d + R * nb, d + 3 * R * nb,
                       x_hat.data_ptr<float>());
    at::Tensor xp = at::empty({groups * nb * 512}, q.options());
    at::Tensor xd = at::empty({groups * nb * 16}, x.options());
    at::Tensor xc = at::empty({impl.amx ? 0 : groups * nb * 16}, x.options().dtype(at::kInt));
    avx512::pack_i8_rows(q.data_ptr<int8_t>(), d, R, K, xp.data_ptr<int8_t>(), xd.data_ptr<float>(),
                         impl.amx ? nullptr : xc.data_ptr<int32_t>());
    if (impl.amx) {
      a = at::empty({R, N}, x.options().dtype(at::kBFloat16));
      auto* a16 = reinterpret_cast<uint16_t*>(a.data_ptr<at::BFloat16>());
      at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
        avx512::gemm_q8_i8_amx(w, xp.data_ptr<int8_t>(), xd.data_ptr<float>(), R, a16, N, b0 * 16,
                               std::min(b1 * 16, N));
      });
    } else {
      a = at::empty({groups * 16, (N + 7) / 8 * 8}, x.options());  // [rows to 16, N to 8]: the kernel's tiles
      at::parallel_for(0, (N + 7) / 8, 1, [&](int64_t b0, int64_t b1) {
        avx512::gemm_q8_i8_vnni(w, xp.data_ptr<int8_t>(), xd.data_ptr<float>(), xc.data_ptr<int32_t>(), R,
                                a.data_ptr<float>(), a.size(1), b0 * 8, std::min(b1 * 8, N));
      });
    }
  } else {
    const at::Tensor xb = x.to(at::kBFloat16);  // rounded to nearest even, as the tiles take it
    a = qmatmul(xb, w, N, p.fused_max_rows, false, 0, impl);  // [R, N] bf16, through the tiles
    x_hat = xb.to(at::kFloat);
  }
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const float *xs = x.data_ptr<float>(), *n1 = norms.data_ptr<float>(), *n2 = n1 + N;
  const int64_t lda = a.size(1);
  const auto candidates = [&](int64_t r, float alpha, float beta, float c, float floor, int64_t* cand) {
    if (a.scalar_type() == at::kFloat)
      return avx512::greedy_candidates(a.data_ptr<float>() + r * lda, N, n1, n2, alpha, beta, c, floor, cand);
    const auto* ar = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()) + r * lda;
    return avx512::greedy_candidates(ar, N, n1, n2, alpha, beta, c, floor, cand);
  };
  // ||x|| and ||x - x_hat|| a row, in fp64 (x - x_hat is exact there: x_hat is 0 or within a factor of 2 of x)
  const at::Tensor x_norms = at::linalg_vector_norm(x, 2, 1, false, at::kDouble);
  const at::Tensor err_norms =
      at::linalg_vector_norm(x.to(at::kDouble) - x_hat.to(at::kDouble), 2, 1, false, at::kDouble);
  const double *nxs = x_norms.data_ptr<double>(), *exs = err_norms.data_ptr<double>();
  // fp32 sums of K products in any order are within gamma * sum |x_i w_i| of the exact sum (Higham's gamma_K)
  const double u = std::ldexp(1.0, -24), gamma = K * u / (1 - K * u), up = 1 + std::ldexp(1.0, -10);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    constexpr int kChunk = 32, kLanes = 8;
    thread_local std::vector<float> rows;
    thread_local std::vector<int64_t> cand;
    rows.resize(kChunk * K);
    cand.resize(N);
    for (int64_t r = r0; r < r1; r++) {
      const float* xr = xs + r * K;
      const double nx = nxs[r], ex = exs[r];
      // bf16 tiles: |a - L| <= ||x - bf16(x)|| ||bf16(w)|| + ||x|| ||w - bf16(w)|| (the rounded inputs) + gamma
      // (||bf16(x)|| ||bf16(w)|| + ||x|| ||w||) (the tiles' sums, and L's) + 2^-8 |a| (a is rounded to bf16) +
      // 2^-100 (1 + sqrt(K) ||x||) (the tiles' flushed denormals); each coefficient rounded up by 2^-10, which also
      // covers the fp32 roundings of the comparisons below. int8 products: the weights as they are (||w|| <= n1 +
      // n2), exact integer sums, the fp32 sums of their scaled blocks and L's within gamma (||x_hat|| + ||x||) ||w||
      // (VNNI's a stays fp32: 2^-8 |a| holds more than it needs).
      const float alpha = float((ex + gamma * (2 * nx + ex)) * up);
      const float beta = int8 ? alpha : float(nx * (1 + gamma) * up);
      const float c = float(std::ldexp(1.0, -8) * up);
      const float floor = float(std::ldexp(1.0, -100) * (1 + std::sqrt(double(K)) * nx) * up);
      const int64_t n = candidates(r, alpha, beta, c, floor, cand.data());
      bool finite = n >= 0 && std::isfinite(nx);
      int64_t best = -1;
      float best_l = 0;
      for (int64_t c0 = 0; c0 < n && finite; c0 += kChunk) {
        const int64_t chunk = std::min<int64_t>(kChunk, n - c0);
        impl.dequant(p.w, cand.data() + c0, chunk, rows.data());
        for (int64_t k = 0; k < chunk; k++) {
          const float* w = rows.data() + k * K;
          float acc[kLanes] = {};
          for (int64_t i = 0; i < K; i += kLanes)  // K is a multiple of 32
            for (int l = 0; l < kLanes; l++) acc[l] += xr[i + l] * w[i + l];
          float dot = acc[0];
          for (int l = 1; l < kLanes; l++) dot += acc[l];
          finite = finite && std::isfinite(dot);
          if (best < 0 || dot > best_l) best = cand[c0 + k], best_l = dot;  // ascending j: the first of equals
        }
      }
      out.data_ptr<int64_t>()[r] = finite ? best : -1;
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(pipellm_kernels, m) {
  m.attr("AMX_MIN_ROWS") = kAmxMinRows;
  m.attr("AMX_F32_MIN_ROWS") = kAmxF32MinRows;
  m.attr("AMX_F32_MIN_ROWS_16") = kAmxF32MinRows16;
  m.attr("XT_MIN_ROWS") = kXtMinRows;
  m.attr("XT_MAX_ROWS") = kXtMaxRows;
  using namespace pybind11::literals;
  using namespace pipellm;
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();  // the stage's other threads run meanwhile
  m.def("qlinear", &qlinear, nogil, "x"_a, "qs"_a, "scale"_a, "min"_a, "kind"_a, "group"_a, "super_scale"_a,
        "super_min"_a, "high"_a, "offset"_a, "fused_max_rows"_a, "int8_acts"_a, "integer_max_rows"_a, "isa"_a);
  m.def("dequant_rows", &dequant_rows, nogil);
  m.def("best_isa", &best_isa);
  m.def("paged_decode_attention", &paged_decode_attention, nogil, "q"_a, "k_cache"_a, "v_cache"_a, "k_scale"_a,
        "v_scale"_a, "block_tables"_a, "seq_lens"_a, "window"_a, "scale"_a, "softcap"_a, "isa"_a,
        "sinks"_a = pybind11::none());
  m.def("kv_cache_write", &kv_cache_write);
  m.def("kv_cache_write_int8", &kv_cache_write_int8);
  m.def("rms_norm", &rms_norm);
  m.def("argmax_rows", &argmax_rows, nogil, "logits"_a, "isa"_a = "");
  m.def("rotary_", &rotary_);
  m.def("greedy_pick", &greedy_pick, nogil, "linear"_a, "x"_a, "norms"_a);
  m.def("greedy_int8",
        [](const Linear& lin) { return lin.parts.size() == 1 && greedy_int8(lin.parts[0].w, kIsas[lin.parts[0].isa]); },
        "whether greedy_pick takes this weight's codes as they are to integer products (AMX-INT8: up to 16 rows)");
  pybind11::class_<Linear>(m, "Linear", "y = x @ W^T + b, the weight's arguments checked and bound once")
      .def(pybind11::init(&compact_linear), "qs"_a, "scale"_a, "min"_a, "kind"_a, "group"_a, "super_scale"_a,
           "super_min"_a, "high"_a, "offset"_a, "fused_max_rows"_a, "int8_acts"_a, "integer_max_rows"_a, "isa"_a)
      .def_static("dense", &dense_linear, "weight_t"_a, "bias"_a = pybind11::none(), "isa"_a = "")
      .def_static("concat", &concat_linear, "blocks"_a, "bias"_a = pybind11::none())
      .def("__call__", &Linear::operator(), nogil);
  pipellm::bind_layers(m);
}
