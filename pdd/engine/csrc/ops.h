// The engine's compiled ops, callable from C++ by the other kernels of the same library
// (each is also registered as torch.ops.pdd.<name>; see the .cpp files for what they compute).
#pragma once

#include <ATen/core/Tensor.h>

namespace pdd_ops {

// fused_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& x);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin);

// paged_decode.cpp
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& blocks, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, double scale);

}  // namespace pdd_ops
