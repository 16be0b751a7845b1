// Picks the compiled sm90a instantiation for a call, from the generated kernel_manifest.h (empty
// when the build leaves the sm90a family out).
#include <cutlass/numeric_types.h>

#include "kernel_manifest.h"
#include "kernels/sm80/entry_points.h"
#include "kernels/sm90/entry_points.h"

namespace flash_dmattn::kernels::sm90 {

// Defined in fwd_kernel.h and bwd_kernel.h, instantiated once per manifest entry in translation
// units of their own, compiled for sm_90a.
template <typename Element, int kHeadDim>
cudaError_t run_forward(const ForwardParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
cudaError_t run_gather_forward(const ForwardParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
cudaError_t run_backward(const BackwardParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
cudaError_t run_gather_backward(const BackwardParams& params, cudaStream_t stream);

bool has_forward(ElementType element, int head_dim) {
  [[maybe_unused]] const int bucket = sm80::head_dim_bucket(head_dim);
#define FDMA_SM90_HAS(dtype, cutlass_type, hdim) \
  if (element == ElementType::dtype && bucket == hdim) return true;
  FDMA_SM90_FORWARD_KERNELS(FDMA_SM90_HAS)
  return false;
}

bool has_gather_forward(ElementType element, int head_dim) {
  [[maybe_unused]] const int bucket = sm80::head_dim_bucket(head_dim);
  FDMA_SM90_GATHER_FORWARD_KERNELS(FDMA_SM90_HAS)
  return false;
}

bool has_backward(ElementType element, int head_dim) {
  [[maybe_unused]] const int bucket = sm80::head_dim_bucket(head_dim);
  FDMA_SM90_BACKWARD_KERNELS(FDMA_SM90_HAS)
  return false;
}

bool has_gather_backward(ElementType element, int head_dim) {
  [[maybe_unused]] const int bucket = sm80::head_dim_bucket(head_dim);
  FDMA_SM90_GATHER_BACKWARD_KERNELS(FDMA_SM90_HAS)
#undef FDMA_SM90_HAS
  return false;
}

cudaError_t forward(const ForwardParams& params, cudaStream_t stream) {
  [[maybe_unused]] const int bucket = sm80::head_dim_bucket(params.head_dim);
#define FDMA_SM90_RUN(dtype, cutlass_type, hdim) \
  if (params.element == ElementType::dtype && bucket == hdim) return run_forward<cutlass_type, hdim>(params, stream);
  if (params.lists.keys) {
#define FDMA_SM90_RUN_GATHER(dtype, cutlass_type, hdim) \
  if (params.element == ElementType::dtype && bucket == hdim) return run_gather_forward<cutlass_type, hdim>(params, stream);
    FDMA_SM90_GATHER_FORWARD_KERNELS(FDMA_SM90_RUN_GATHER)
#undef FDMA_SM90_RUN_GATHER
    return cudaErrorNotSupported;
  }
  FDMA_SM90_FORWARD_KERNELS(FDMA_SM90_RUN)
#undef FDMA_SM90_RUN
  return cudaErrorNotSupported;
}

cudaError_t backward(const BackwardParams& params, cudaStream_t stream) {
  [[maybe_unused]] const int bucket = sm80::head_dim_bucket(params.fwd.head_dim);
#define FDMA_SM90_RUN(dtype, cutlass_type, hdim) \
  if (params.fwd.element == ElementType::dtype && bucket == hdim) return run_backward<cutlass_type, hdim>(params, stream);
  if (params.fwd.lists.keys) {
#define FDMA_SM90_RUN_GATHER(dtype, cutlass_type, hdim) \
  if (params.fwd.element == ElementType::dtype && bucket == hdim) return run_gather_backward<cutlass_type, hdim>(params, stream);
    FDMA_SM90_GATHER_BACKWARD_KERNELS(FDMA_SM90_RUN_GATHER)
#undef FDMA_SM90_RUN_GATHER
    return cudaErrorNotSupported;
  }
  FDMA_SM90_BACKWARD_KERNELS(FDMA_SM90_RUN)
#undef FDMA_SM90_RUN
  return cudaErrorNotSupported;
}

}  // namespace flash_dmattn::kernels::sm90
