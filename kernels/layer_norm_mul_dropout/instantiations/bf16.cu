// bf16 instantiation of the LayerNorm * u * dropout kernels (forward and backward).
#include "../launch_impl.h"

namespace lnmd {
template void run_fwd<__nv_bfloat16>(const FwdParams&, int, cudaStream_t);
template int grid_bwd<__nv_bfloat16>(int, int64_t, int);
template void run_bwd<__nv_bfloat16>(const BwdParams&, int, cudaStream_t);
}  // namespace lnmd
