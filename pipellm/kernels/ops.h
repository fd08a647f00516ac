#pragma once
// What layer.cpp shares with ops.cpp: a weight bound once, and the kernels of a decode step, each with the checks
// it makes when Python calls it.
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>

#include <vector>

#include "qgemm.h"

namespace pipellm {

// y = x @ W^T + b for x fp32 [M, K]: W in blocks of rows, each compact codes (described once, not per call) or a
// dense fp32 [K, N] matrix, and an optional bias added to the whole, as CompactLinear adds it.
class Linear {
 public:
  struct Part {
    QWeight w{};
    std::vector<at::Tensor> keep;  // the tensors w points into
    at::Tensor dense;              // fp32 [K, N] instead of codes
    c10::optional<at::Tensor> dense_bias;  // added by the dense matmul (addmm), as TransposedLinear adds it
    int64_t N = 0, fused_max_rows = 0, integer_max_rows = 0;
    bool int8_acts = false;
    int isa = 0;                   // index into ops.cpp's instruction sets
  };
  std::vector<Part> parts;
  c10::optional<at::Tensor> bias;
  int64_t K = 0;

  at::Tensor operator()(const at::Tensor& x) const;
  int64_t out_features() const {
    int64_t n = 0;
    for (const Part& p : parts) n += p.N;
    return n;
  }
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
void kv_cache_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
                    const at::Tensor& v);
void kv_cache_write_int8(const at::Tensor& cache, const at::Tensor& scale, const at::Tensor& slots,
                         const at::Tensor& x);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window,
                                  double scale, double softcap, const std::string& isa,
                                  const c10::optional<at::Tensor>& sinks = c10::nullopt);

void bind_layers(pybind11::module_& m);  // layer.cpp's classes

}  // namespace pipellm
