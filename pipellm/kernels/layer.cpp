// A decode step through a stack of Llama-family layers in one call: the kernels and torch ops that
// models/llama.py's layers run, in the same order on the same values, without ~15 Python calls a layer (a decode
// step of the default model spent more time in them than in its matmuls: BENCHMARKS.md). The Python layers stay
// the reference, and the path of every step that is not all decodes.
#include <ATen/ATen.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "ops.h"

namespace pipellm {
namespace {

struct DecoderLayer {
  at::Tensor input_norm, post_norm;  // RMSNorm weights [hidden]
  Linear qkv, o, gate_up, down;
  double eps, scale;
  int64_t heads, kv_heads, head_dim;
  at::Tensor k_cache, v_cache;  // [blocks, block_size, KV, D]
  c10::optional<at::Tensor> k_scale, v_scale;  // int8 caches only

  // x [T, hidden]: one new token per sequence, cos/sin [T, 1, rotated], the step's slots [T], the sequences' block
  // tables [T, width] and lengths [T] (new token included). Returns the layer's output [T, hidden].
  at::Tensor decode(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                    const at::Tensor& tables, const at::Tensor& lens) const {
    const int64_t T = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    at::Tensor qkv_out = qkv(rms_norm(x, input_norm, eps));                      // [T, (H + 2 KV) * D]
    at::Tensor q = qkv_out.narrow(1, 0, q_size).view({T, heads, head_dim});
    at::Tensor k = qkv_out.narrow(1, q_size, kv_size).view({T, kv_heads, head_dim});
    at::Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads, head_dim});
    const int64_t rotated = cos.size(-1);
    rotary_(q.narrow(2, 0, rotated), k.narrow(2, 0, rotated), cos, sin);
    if (k_scale.has_value()) {  // as KVCache.write
      kv_cache_write_int8(k_cache, *k_scale, slots, k.contiguous());
      kv_cache_write_int8(v_cache, *v_scale, slots, v.contiguous());
    } else {
      const auto type = k_cache.scalar_type();
      kv_cache_write(k_cache, v_cache, slots, k.to(type), v.to(type));
    }
    at::Tensor attn = paged_decode_attention(q.contiguous(), k_cache, v_cache, k_scale, v_scale, tables, lens, 0,
                                             scale, "");                         // [T, H, D]
    at::Tensor h = x + o(attn.view({T, q_size}));
    at::Tensor gu = gate_up(rms_norm(h, post_norm, eps));                        // [T, 2 * intermediate]
    const int64_t inter = gu.size(1) / 2;
    return h + down(at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter));
  }
};

struct DecoderStack {
  std::vector<DecoderLayer> layers;

  at::Tensor decode(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                    const at::Tensor& tables, const at::Tensor& lens) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [T, hidden]");
    TORCH_CHECK(slots.numel() == x.size(0) && lens.numel() == x.size(0) && tables.size(0) == x.size(0),
                "one slot, length and block table a token: every row must be a decode");
    for (const DecoderLayer& layer : layers) x = layer.decode(x, cos, sin, slots, tables, lens);
    return x;
  }
};

}  // namespace

void bind_layers(pybind11::module_& m) {
  using namespace pybind11::literals;
  pybind11::class_<DecoderLayer>(m, "DecoderLayer", "a Llama-family layer's weights and caches, for decode steps")
      .def(pybind11::init([](at::Tensor input_norm, at::Tensor post_norm, Linear qkv, Linear o, Linear gate_up,
                             Linear down, double eps, double scale, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             at::Tensor k_cache, at::Tensor v_cache, c10::optional<at::Tensor> k_scale,
                             c10::optional<at::Tensor> v_scale) {
             const int64_t hidden = input_norm.numel();
             TORCH_CHECK(post_norm.numel() == hidden && qkv.K == hidden && gate_up.K == hidden &&
                         qkv.out_features() == (heads + 2 * kv_heads) * head_dim && o.K == heads * head_dim &&
                         o.out_features() == hidden && gate_up.out_features() == 2 * down.K &&
                         down.out_features() == hidden, "the layer's weights disagree on their sizes");
             return DecoderLayer{input_norm, post_norm, qkv, o, gate_up, down, eps, scale, heads, kv_heads, head_dim,
                                 k_cache, v_cache, k_scale, v_scale};
           }),
           "input_norm"_a, "post_norm"_a, "qkv"_a, "o"_a, "gate_up"_a, "down"_a, "eps"_a, "scale"_a, "heads"_a,
           "kv_heads"_a, "head_dim"_a, "k_cache"_a, "v_cache"_a, "k_scale"_a, "v_scale"_a);
  pybind11::class_<DecoderStack>(m, "DecoderStack", "a stage's layers, run on a decode step in one call")
      .def(pybind11::init([](const std::vector<DecoderLayer>& layers) { return DecoderStack{layers}; }), "layers"_a)
      .def("decode", &DecoderStack::decode, pybind11::call_guard<pybind11::gil_scoped_release>(), "x"_a, "cos"_a,
           "sin"_a, "slots"_a, "block_tables"_a, "seq_lens"_a);
}

}  // namespace pipellm
