// Picks the compiled forward instantiation for a call. The list of instantiations comes from the
// generated kernel_manifest.h (cmake/FlashDmattnKernels.cmake), so a partial build dispatches to
// exactly what it compiled.
#include <cutlass/numeric_types.h>

#include "kernel_manifest.h"
#include "kernels/sm80/forward.h"

namespace flash_dmattn::kernels::sm80 {

// Defined in fwd_kernel.h and instantiated once per manifest entry in its own translation unit.
template <typename Element, int kHeadDim>
cudaError_t run_forward(const ForwardParams& params, cudaStream_t stream);

int head_dim_bucket(int head_dim) {
  for (int bucket : {32, 64, 96, 128, 192, 256})
    if (head_dim <= bucket) return bucket;
  return 0;
}

int forward_head_dim_bucket(ElementType element, int head_dim) {
  const int bucket = head_dim_bucket(head_dim);
#define FDMA_FWD_SM80_HAS(dtype, cutlass_type, hdim) \
  if (element == ElementType::dtype && bucket == hdim) return bucket;
  FDMA_FWD_SM80_KERNELS(FDMA_FWD_SM80_HAS)
#undef FDMA_FWD_SM80_HAS
  return 0;
}

cudaError_t forward(const ForwardParams& params, cudaStream_t stream) {
  const int bucket = head_dim_bucket(params.head_dim);
#define FDMA_FWD_SM80_RUN(dtype, cutlass_type, hdim) \
  if (params.element == ElementType::dtype && bucket == hdim) return run_forward<cutlass_type, hdim>(params, stream);
  FDMA_FWD_SM80_KERNELS(FDMA_FWD_SM80_RUN)
#undef FDMA_FWD_SM80_RUN
  return cudaErrorNotSupported;
}

}  // namespace flash_dmattn::kernels::sm80
