// bwd kernel, fp16, head dim 32, no attention bias. One file per (dtype, head dim, direction,
// bias) so builds parallelise.
#include "launch.h"

namespace hstu {
template cudaError_t run_hstu_bwd<cutlass::half_t, 32, false>(HstuParams&, cudaStream_t);
}  // namespace hstu

HSTU_REGISTER_BWD(cutlass::half_t, ::hstu::DType::kFp16, 32, None)
