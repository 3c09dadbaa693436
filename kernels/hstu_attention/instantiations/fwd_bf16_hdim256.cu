// fwd kernel, bf16, head dim 256. One file per (dtype, head dim, direction) so builds parallelise.
#include "launch.h"

namespace hstu {
template cudaError_t run_hstu_fwd<cutlass::bfloat16_t, 256>(HstuParams&, cudaStream_t);
}  // namespace hstu

HSTU_REGISTER_FWD(cutlass::bfloat16_t, ::hstu::DType::kBf16, 256)
