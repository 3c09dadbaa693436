// fwd kernel, fp16, head dim 64, with the relative attention bias. One file per (dtype, head dim, direction,
// bias) so builds parallelise.
#include "launch.h"

namespace hstu {
template cudaError_t run_hstu_fwd<cutlass::half_t, 64, true>(HstuParams&, cudaStream_t);
}  // namespace hstu

HSTU_REGISTER_FWD(cutlass::half_t, ::hstu::DType::kFp16, 64, Any)
