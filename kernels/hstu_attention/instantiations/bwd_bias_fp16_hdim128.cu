// bwd kernel, fp16, head dim 128, with the relative attention bias. One file per (dtype, head dim, direction,
// bias) so builds parallelise.
#include "launch.h"

namespace hstu {
template cudaError_t run_hstu_bwd<cutlass::half_t, 128, true>(HstuParams&, cudaStream_t);
}  // namespace hstu

HSTU_REGISTER_BWD(cutlass::half_t, ::hstu::DType::kFp16, 128, Any)
