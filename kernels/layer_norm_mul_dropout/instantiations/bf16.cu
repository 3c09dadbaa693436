// bf16 instantiation of the LayerNorm * u * dropout kernels and of the input LayerNorm (fwd, bwd).
#include "../launch_impl.h"

namespace lnmd {
template void run_fwd<__nv_bfloat16>(const FwdParams&, int, cudaStream_t);
template int grid_bwd<__nv_bfloat16>(int, int64_t, int);
template void run_bwd<__nv_bfloat16>(const BwdParams&, int, cudaStream_t);
template void run_ln_fwd<__nv_bfloat16>(const LnFwdParams&, int, cudaStream_t);
template int grid_ln_bwd<__nv_bfloat16>(int, int64_t, int);
template void run_ln_bwd<__nv_bfloat16>(const LnBwdParams&, int, cudaStream_t);
}  // namespace lnmd
