// fwd kernel, bf16, head dim 32, with the relative attention bias. One file per (dtype, head dim, direction,
// bias) so builds parallelise.
#include "launch.h"

namespace hstu {
template cudaError_t run_hstu_fwd<cutlass::bfloat16_t, 32, true>(HstuParams&, cudaStream_t);
}  // namespace hstu

HSTU_REGISTER_FWD(cutlass::bfloat16_t, ::hstu::DType::kBf16, 32, Any)
