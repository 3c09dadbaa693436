// bwd kernel, fp16, head dim 256, with the position term of the relative attention bias alone
// (the time term compiled out; api.cpp uses it for calls without a time weight). One file per
// (dtype, head dim, direction, bias kind) so builds parallelise.
#include "launch.h"

namespace hstu {
template cudaError_t run_hstu_bwd<cutlass::half_t, 256, true, false>(HstuParams&, cudaStream_t);
}  // namespace hstu

HSTU_REGISTER_BWD(cutlass::half_t, ::hstu::DType::kFp16, 256, Position)
