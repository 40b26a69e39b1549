// The engine's compiled ops, callable from C++ by the other kernels of the same library
// (each is also registered as torch.ops.pdd.<name>; see the .cpp files for what they compute).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace pdd_ops {

// fused_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& x);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin);

// paged_decode.cpp
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& blocks, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, double scale);

// panel_gemm.cpp
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features);

}  // namespace pdd_ops
