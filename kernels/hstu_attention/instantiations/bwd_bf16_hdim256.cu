// bwd kernel, bf16, head dim 256, no attention bias. One file per (dtype, head dim, direction,
// bias) so builds parallelise.
#include "launch.h"

namespace hstu {
template cudaError_t run_hstu_bwd<cutlass::bfloat16_t, 256, false>(HstuParams&, cudaStream_t);
}  // namespace hstu

HSTU_REGISTER_BWD(cutlass::bfloat16_t, ::hstu::DType::kBf16, 256, None)
