// A decode step through a stack of Llama-family layers in one call: the kernels and torch ops that
// models/llama.py's and models/gemma.py's layers run, in the same order on the same values, without ~15 Python
// calls a layer (a decode step of the default model spent more time in them than in its matmuls: BENCHMARKS.md).
// The Python layers stay the reference, and the path of every step that is not all decodes.
#include <ATen/ATen.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <map>
#include <variant>

#include "ops.h"

namespace pipellm {
namespace {

// What a decode step gives the layers of one kind (full or sliding attention): cos/sin [T, 1, rotated], the new
// tokens' slots [T], the sequences' block tables [T, width] and lengths [T] (new token included), the window (0: none).
using StepArgs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t>;

// A step's rows of each LoRA slot in use (pipellm/lora.py's StepRows): (slot, row indices, or none for every row).
using LoraRows = std::vector<std::pair<int64_t, c10::optional<at::Tensor>>>;

// The LoRA adapters a linear layer holds, by slot: A [in, R] and B [R, out], as lora.py's LoRALinear holds them.
using LoraSlots = std::map<int64_t, std::pair<at::Tensor, at::Tensor>>;

// y plus, for each slot's rows, (x A) B: as LoRALinear.forward adds them
at::Tensor add_lora(at::Tensor y, const at::Tensor& x, const LoraSlots& slots, const LoraRows& rows) {
  for (const auto& [slot, idx] : rows) {
    auto ab = slots.find(slot);
    if (ab == slots.end()) continue;
    const auto& [a, b] = ab->second;
    if (!idx.has_value()) y.addmm_(x.mm(a), b);
    else y.index_add_(0, *idx, x.index_select(0, *idx).mm(a).mm(b));
  }
  return y;
}

// down(act(gate(x)) * up(x)), gate and up in one matmul, as models/layers.py's GatedMLP
struct GatedMlp {
  Linear gate_up, down;
  bool gelu_tanh = false;  // GeGLU (Gemma) instead of SwiGLU
  LoraSlots gate_up_lora, down_lora;

  at::Tensor operator()(const at::Tensor& x, const LoraRows& rows = {}) const {
    at::Tensor gu = add_lora(gate_up(x), x, gate_up_lora, rows);                // [T, 2 * intermediate]
    const int64_t inter = gu.size(1) / 2;
    at::Tensor gate = gu.narrow(1, 0, inter);
    at::Tensor h = (gelu_tanh ? at::gelu(gate, "tanh") : at::silu(gate)) * gu.narrow(1, inter, inter);
    return add_lora(down(h), h, down_lora, rows);
  }
};

// A mixture of experts (Mixtral, Qwen3-MoE), as models/moe.py's SparseMoE with fp32 rows: the router's top k
// experts a token, the tokens batched per expert, each expert's output weighted and added to its tokens' rows.
struct Experts {
  Linear router;
  std::vector<GatedMlp> experts;
  int64_t top_k;
  bool norm_topk_prob;

  at::Tensor operator()(const at::Tensor& x, const LoraRows& = {}) const {  // experts take no adapters
    at::Tensor probs = at::softmax(router(x), -1, at::kFloat);                  // [T, E]
    auto [weights, chosen] = at::topk(probs, top_k, -1);                        // [T, k]
    if (norm_topk_prob) weights = weights / weights.sum({-1}, true);
    const at::Tensor flat = chosen.flatten();
    const at::Tensor order = at::argsort(flat, /*stable=*/true);                // [T * k] (token, slot) by expert
    const at::Tensor counts = at::bincount(flat, {}, int64_t(experts.size()));
    const at::Tensor tokens = at::div(order, top_k, "floor");
    const at::Tensor w = weights.flatten().index_select(0, order);
    at::Tensor out = at::zeros_like(x);
    const int64_t* count = counts.data_ptr<int64_t>();
    for (int64_t e = 0, start = 0; e < int64_t(experts.size()); start += count[e], e++) {
      if (!count[e]) continue;
      const at::Tensor rows = tokens.narrow(0, start, count[e]);
      out.index_add_(0, rows, experts[e](x.index_select(0, rows)) * w.narrow(0, start, count[e]).unsqueeze(1));
    }
    return out;
  }
};

struct DecoderLayer {
  at::Tensor input_norm, post_norm;  // RMSNorm weights [hidden] before attention and before the MLP (Gemma: 1 + w)
  Linear qkv, o;
  std::variant<GatedMlp, Experts> mlp;
  double eps, scale;
  int64_t heads, kv_heads, head_dim;
  at::Tensor k_cache, v_cache;  // [blocks, block_size, KV, D]
  c10::optional<at::Tensor> k_scale, v_scale;  // int8 caches only
  c10::optional<at::Tensor> q_norm, k_norm;    // over each head's D values (Qwen3, Gemma 3)
  c10::optional<at::Tensor> attn_out_norm, mlp_out_norm;  // Gemma's norms of the attention's and the MLP's output
  bool sliding = false;    // takes the sliding layers' StepArgs
  double softcap = 0;      // > 0: soft-capped attention scores (Gemma 2)
  bool rotary = true;      // false: q and k take no rotary positions (SmolLM3's every 4th layer)
  double residual_scale = 1;  // the attention's and the MLP's outputs times this before they join x (Granite)
  LoraSlots qkv_lora, o_lora;  // LoRA adapters (the MLP's are its own)

  static at::Tensor head_norm(const at::Tensor& x, const c10::optional<at::Tensor>& w, double eps) {
    if (!w.has_value()) return x;
    const int64_t T = x.size(0), n = x.size(1), D = x.size(2);
    return rms_norm(x.reshape({T * n, D}), *w, eps).view({T, n, D});  // [T * heads, D], as the layer's reshape
  }

  // x [T, hidden]: one new token per sequence. Returns the layer's output [T, hidden].
  at::Tensor decode(const at::Tensor& x, const StepArgs& step, const LoraRows& rows) const {
    const auto& [cos, sin, slots, tables, lens, window] = step;
    const int64_t T = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    const at::Tensor normed = rms_norm(x, input_norm, eps);
    at::Tensor qkv_out = add_lora(qkv(normed), normed, qkv_lora, rows);          // [T, (H + 2 KV) * D]
    at::Tensor q = head_norm(qkv_out.narrow(1, 0, q_size).view({T, heads, head_dim}), q_norm, eps);
    at::Tensor k = head_norm(qkv_out.narrow(1, q_size, kv_size).view({T, kv_heads, head_dim}), k_norm, eps);
    at::Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads, head_dim});
    const int64_t rotated = cos.size(-1);
    if (rotary) rotary_(q.narrow(2, 0, rotated), k.narrow(2, 0, rotated), cos, sin);
    if (k_scale.has_value()) {  // as KVCache.write
      kv_cache_write_int8(k_cache, *k_scale, slots, k.to(at::kFloat).contiguous());
      kv_cache_write_int8(v_cache, *v_scale, slots, v.to(at::kFloat).contiguous());
    } else {
      const auto type = k_cache.scalar_type();
      kv_cache_write(k_cache, v_cache, slots, k.to(type), v.to(type));
    }
    at::Tensor attn = paged_decode_attention(q.to(at::kFloat).contiguous(), k_cache, v_cache, k_scale, v_scale,
                                             tables, lens, window, scale, softcap, "")
                          .to(x.scalar_type());                                  // [T, H, D]: fp32 inside
    const at::Tensor attn_rows = attn.view({T, q_size});
    at::Tensor a = add_lora(o(attn_rows), attn_rows, o_lora, rows);
    if (attn_out_norm.has_value()) a = rms_norm(a, *attn_out_norm, eps);
    at::Tensor h = x + (residual_scale == 1 ? a : a * residual_scale);
    at::Tensor m = std::visit([&](const auto& f) { return f(rms_norm(h, post_norm, eps), rows); }, mlp);
    if (mlp_out_norm.has_value()) m = rms_norm(m, *mlp_out_norm, eps);
    return h + (residual_scale == 1 ? m : m * residual_scale);
  }
};

struct DecoderStack {
  std::vector<DecoderLayer> layers;

  void set_lora(int64_t layer, const std::string& module, const LoraSlots& slots) {
    TORCH_CHECK(layer >= 0 && layer < int64_t(layers.size()), "no layer ", layer);
    DecoderLayer& l = layers[layer];
    if (module == "qkv") l.qkv_lora = slots;
    else if (module == "o") l.o_lora = slots;
    else {
      TORCH_CHECK(std::holds_alternative<GatedMlp>(l.mlp) && (module == "gate_up" || module == "down"),
                  "LoRA modules are qkv, o, gate_up and down (an MLP's, not experts')");
      GatedMlp& m = std::get<GatedMlp>(l.mlp);
      (module == "gate_up" ? m.gate_up_lora : m.down_lora) = slots;
    }
  }

  at::Tensor decode(at::Tensor x, const StepArgs& full, const StepArgs& local, const LoraRows& rows) const {
    TORCH_CHECK(x.dim() == 2 && (layers.empty() || x.scalar_type() == layers[0].input_norm.scalar_type()),
                "x must be [T, hidden] in the norms' dtype (fp32, or bf16 for Llama's norms)");
    for (const StepArgs* s : {&full, &local}) {
      const auto& [cos, sin, slots, tables, lens, window] = *s;
      TORCH_CHECK(slots.numel() == x.size(0) && lens.numel() == x.size(0) && tables.size(0) == x.size(0),
                  "one slot, length and block table a token: every row must be a decode");
    }
    for (const DecoderLayer& layer : layers) x = layer.decode(x, layer.sliding ? local : full, rows);
    return x;
  }
};

}  // namespace

void bind_layers(pybind11::module_& m) {
  using namespace pybind11::literals;
  pybind11::class_<GatedMlp>(m, "GatedMlp", "an MLP of a gated activation, for decode steps")
      .def(pybind11::init([](Linear gate_up, Linear down, bool gelu_tanh) {
             TORCH_CHECK(gate_up.out_features() == 2 * down.K && down.out_features() == gate_up.K,
                         "the MLP's weights disagree on their sizes");
             return GatedMlp{gate_up, down, gelu_tanh};
           }),
           "gate_up"_a, "down"_a, "gelu_tanh"_a = false);
  pybind11::class_<Experts>(m, "Experts", "a mixture of experts, for decode steps")
      .def(pybind11::init([](Linear router, std::vector<GatedMlp> experts, int64_t top_k, bool norm_topk_prob) {
             TORCH_CHECK(router.out_features() == int64_t(experts.size()) && top_k >= 1 &&
                         top_k <= int64_t(experts.size()), "a router's output a expert, top_k of them at most");
             for (const GatedMlp& e : experts)
               TORCH_CHECK(e.gate_up.K == router.K, "the experts and the router disagree on the hidden size");
             return Experts{router, experts, top_k, norm_topk_prob};
           }),
           "router"_a, "experts"_a, "top_k"_a, "norm_topk_prob"_a);
  pybind11::class_<DecoderLayer>(m, "DecoderLayer", "a Llama-family layer's weights and caches, for decode steps")
      .def(pybind11::init([](at::Tensor input_norm, at::Tensor post_norm, Linear qkv, Linear o,
                             std::variant<GatedMlp, Experts> mlp, double eps, double scale, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, at::Tensor k_cache, at::Tensor v_cache,
                             c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale,
                             c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                             c10::optional<at::Tensor> attn_out_norm, c10::optional<at::Tensor> mlp_out_norm,
                             bool sliding, double softcap, bool rotary, double residual_scale) {
             const int64_t hidden = input_norm.numel();
             const int64_t mlp_in = std::visit([](const auto& f) {
               if constexpr (std::is_same_v<std::decay_t<decltype(f)>, GatedMlp>) return f.gate_up.K;
               else return f.router.K;
             }, mlp);
             TORCH_CHECK(post_norm.numel() == hidden && qkv.K == hidden && mlp_in == hidden &&
                         qkv.out_features() == (heads + 2 * kv_heads) * head_dim && o.K == heads * head_dim &&
                         o.out_features() == hidden, "the layer's weights disagree on their sizes");
             for (const auto* w : {&q_norm, &k_norm})
               TORCH_CHECK(!w->has_value() || (*w)->numel() == head_dim, "q/k norms must be [head_dim]");
             for (const auto* w : {&attn_out_norm, &mlp_out_norm})
               TORCH_CHECK(!w->has_value() || (*w)->numel() == hidden, "output norms must be [hidden]");
             return DecoderLayer{input_norm, post_norm, qkv, o, std::move(mlp), eps, scale, heads, kv_heads,
                                 head_dim, k_cache, v_cache, k_scale, v_scale, q_norm, k_norm, attn_out_norm,
                                 mlp_out_norm, sliding, softcap, rotary, residual_scale};
           }),
           "input_norm"_a, "post_norm"_a, "qkv"_a, "o"_a, "mlp"_a, "eps"_a, "scale"_a, "heads"_a, "kv_heads"_a,
           "head_dim"_a, "k_cache"_a, "v_cache"_a, "k_scale"_a, "v_scale"_a, "q_norm"_a = pybind11::none(),
           "k_norm"_a = pybind11::none(), "attn_out_norm"_a = pybind11::none(), "mlp_out_norm"_a = pybind11::none(),
           "sliding"_a = false, "softcap"_a = 0.0, "rotary"_a = true, "residual_scale"_a = 1.0);
  pybind11::class_<DecoderStack>(m, "DecoderStack", "a stage's layers, run on a decode step in one call")
      .def(pybind11::init([](const std::vector<DecoderLayer>& layers) { return DecoderStack{layers}; }), "layers"_a)
      .def("decode", &DecoderStack::decode, pybind11::call_guard<pybind11::gil_scoped_release>(), "x"_a, "full"_a,
           "local"_a, "lora_rows"_a = LoraRows{},
           "full, local: (cos, sin, slots, block_tables, seq_lens, window) of the full or the sliding layers; "
           "lora_rows: (slot, row indices or None for all) of each LoRA slot the step's rows run")
      .def("set_lora", &DecoderStack::set_lora, "layer"_a, "module"_a, "slots"_a,
           "a layer's LoRA adapters by slot, (A [in, R], B [R, out]), for module qkv, o, gate_up or down");
}

}  // namespace pipellm
