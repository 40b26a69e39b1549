// A whole decode step's forward of the Llama decoder in one call: the same ops, in the same order,
// as LlamaModel._forward_fused (pdd/engine/model.py) for a step whose rows are all decode tokens
// and all sampled, so the logits are bit-identical to it.
//
// Why: that forward is ~140 op calls a step from Python (at a decode batch of 16 on the benchmark
// model, ~0.5 ms of an ~8.5 ms step), and each call takes and drops the GIL. Here the step drops
// the GIL once: in a service the event loop thread (token streams, KV transfers) runs beside it
// instead of between its ops.
//
// Per layer (weights[6 l ...]: input norm, qkv, o, post-attention norm, gate_up, down — the
// projections oneDNN-prepacked; biases[4 l ...] and panels[4 l ...]: qkv, o, gate_up, down, each
// optional, panels[4 L] the LM head's; a projection with panels multiplies on them, as
// linear.Linear does):
//   qkv = x @ Wqkv                      [N, H + 2 KV, D]
//   rope_(qkv[:, :H + KV])              q and k rotated in place
//   kv_pool[l] slots <- qkv[:, H:]      [N, 2, KV, D]
//   attn = paged_decode(q, kv_pool[l])  [N, H, D]
//   x = add_rms_norm_(residual, attn @ Wo, post_norm)
//   x = add_rms_norm_(residual, silu_mul(x @ Wgate_up) @ Wdown, next layer's input norm | final norm)
// then logits = x @ Wlm_head [N, V]. Inputs taller than MAX_EXACT_ROWS are zero-padded to
// `padded_rows` for every projection, as linear.Linear pads them (one oneDNN primitive per count).
// Registered as torch.ops.pdd.decode_forward (no pybind, so Python headers are not needed).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/embedding.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string_view>

#include "ops.h"

namespace {

constexpr int64_t kWeightsPerLayer = 6;
constexpr int64_t kBiasesPerLayer = 4;  // and panels: qkv, o, gate_up, down (+ the LM head's last)

// mkldnn::_linear_pointwise(X, W_packed, B?, attr, scalars, algorithm): what linear.Linear calls.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>();
  return op.call(x, w, b, "none", c10::List<std::optional<at::Scalar>>(), std::optional<std::string_view>(""));
}

// x [rows, in] -> [rows, out], as linear.Linear.forward: on the weight's panels (panel_gemm.cpp)
// when given them (the caller gives none past Linear.MAX_EXACT_ROWS rows), else oneDNN's,
// multiplied as `padded` rows.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                  const std::optional<at::Tensor>& panels, int64_t padded) {
  const int64_t rows = x.size(0);
  if (panels) return pdd_ops::panel_linear(x, *panels, b, w.size(0));
  if (padded == rows) return onednn_linear(x, w, b);
  return onednn_linear(at::constant_pad_nd(x, {0, 0, 0, padded - rows}), w, b).narrow(0, 0, rows);
}

at::Tensor decode_forward(const at::Tensor& ids, const at::Tensor& cos, const at::Tensor& signed_sin,
                          const at::Tensor& embed, at::TensorList weights,
                          const c10::List<std::optional<at::Tensor>>& biases,
                          const c10::List<std::optional<at::Tensor>>& panels, const at::Tensor& final_norm,
                          const at::Tensor& lm_head, at::Tensor& kv, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t num_heads,
                          int64_t padded_rows, double eps) {
  TORCH_CHECK(kv.dim() == 6 && kv.is_contiguous(), "decode_forward: kv must be a contiguous [L, NB+1, bs, 2, KV, D]");
  const int64_t L = kv.size(0), KV = kv.size(4), D = kv.size(5), H = num_heads;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * L,
              "decode_forward: weights must hold 6 tensors per layer, got ", weights.size(), " for ", L, " layers");
  TORCH_CHECK(static_cast<int64_t>(biases.size()) == kBiasesPerLayer * L,
              "decode_forward: biases must hold 4 entries per layer, got ", biases.size(), " for ", L, " layers");
  TORCH_CHECK(static_cast<int64_t>(panels.size()) == kBiasesPerLayer * L + 1,
              "decode_forward: panels must hold 4 entries per layer and the LM head's, got ", panels.size());
  TORCH_CHECK(H > 0 && H % KV == 0, "decode_forward: num_heads must be a multiple of the KV heads");
  TORCH_CHECK(ids.dim() == 1, "decode_forward: ids must be [N]");
  const int64_t N = ids.size(0);
  TORCH_CHECK(padded_rows >= N, "decode_forward: padded_rows must be >= N");
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const at::Tensor slots = kv.view({L, -1, 2, KV, D});  // [L, S, 2, KV, D]: the pool slot by slot
  at::Tensor residual = at::embedding(embed, ids);       // [N, hidden]: fresh, ours to update
  at::Tensor x = pdd_ops::rms_norm(residual, weights[0], eps);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + kWeightsPerLayer * l;
    const int64_t b = kBiasesPerLayer * l;
    at::Tensor qkv = linear(x, w[1], biases.get(b), panels.get(b), padded_rows).view({N, H + 2 * KV, D});
    at::Tensor qk = qkv.narrow(1, 0, H + KV);  // [N, H + KV, D]
    pdd_ops::rope_(qk, cos, signed_sin);
    slots[l].index_copy_(0, slot_mapping, qkv.narrow(1, H, 2 * KV).view({N, 2, KV, D}));
    const at::Tensor attn = pdd_ops::paged_decode(qkv.narrow(1, 0, H), kv[l], block_tables, context_lens, scale);
    x = pdd_ops::add_rms_norm_(
        residual, linear(attn.reshape({N, H * D}), w[2], biases.get(b + 1), panels.get(b + 1), padded_rows), w[3], eps);
    const at::Tensor& next_norm = l + 1 < L ? weights[kWeightsPerLayer * (l + 1)] : final_norm;
    const at::Tensor up = pdd_ops::silu_mul(linear(x, w[4], biases.get(b + 2), panels.get(b + 2), padded_rows));
    x = pdd_ops::add_rms_norm_(residual, linear(up, w[5], biases.get(b + 3), panels.get(b + 3), padded_rows),
                               next_norm, eps);
  }
  return linear(x, lm_head, std::nullopt, panels.get(kBiasesPerLayer * L), padded_rows);  // [N, V]
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdd, m) {
  m.def(
      "decode_forward(Tensor ids, Tensor cos, Tensor signed_sin, Tensor embed, Tensor[] weights, Tensor?[] biases, "
      "Tensor?[] panels, Tensor final_norm, Tensor lm_head, Tensor(a!) kv, Tensor slot_mapping, Tensor block_tables, "
      "Tensor context_lens, int num_heads, int padded_rows, float eps) -> Tensor");
}

// NOTE: MkldnnCPU too: the prepacked weights are oneDNN tensors, and dispatch goes by the highest
// backend among the arguments.
TORCH_LIBRARY_IMPL(pdd, CPU, m) { m.impl("decode_forward", &decode_forward); }
TORCH_LIBRARY_IMPL(pdd, MkldnnCPU, m) { m.impl("decode_forward", &decode_forward); }
