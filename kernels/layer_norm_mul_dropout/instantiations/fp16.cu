// fp16 instantiation of the LayerNorm * u * dropout kernels and of the input LayerNorm (fwd, bwd).
#include "../launch_impl.h"

namespace lnmd {
template void run_fwd<__half>(const FwdParams&, int, cudaStream_t);
template int grid_bwd<__half>(int, int64_t, int);
template void run_bwd<__half>(const BwdParams&, int, cudaStream_t);
template void run_ln_fwd<__half>(const LnFwdParams&, int, cudaStream_t);
template int grid_ln_bwd<__half>(int, int64_t, int);
template void run_ln_bwd<__half>(const LnBwdParams&, int, cudaStream_t);
}  // namespace lnmd
