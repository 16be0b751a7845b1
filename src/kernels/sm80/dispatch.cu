// Picks the compiled instantiation for a call. The list of instantiations comes from the
// generated kernel_manifest.h (cmake/FlashDmattnKernels.cmake), so a partial build dispatches to
// exactly what it compiled.
#include <cutlass/numeric_types.h>

#include "kernel_manifest.h"
#include "kernels/sm80/bwd_gather_mainloop.h"
#include "kernels/sm80/bwd_traits.h"
#include "kernels/sm80/entry_points.h"
#include "kernels/sm80/fwd_mainloop.h"
#include "kernels/sm80/fwd_traits.h"

namespace flash_dmattn::kernels::sm80 {

// Defined in fwd_kernel.h and bwd_kernel.h, instantiated once per manifest entry in translation
// units of their own.
template <typename Element, int kHeadDim>
cudaError_t run_forward(const ForwardParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
cudaError_t run_backward(const BackwardParams& params, cudaStream_t stream);

int head_dim_bucket(int head_dim) {
  for (int bucket : {32, 64, 96, 128, 192, 256})
    if (head_dim <= bucket) return bucket;
  return 0;
}

int compiled_head_dim_bucket(ElementType element, int head_dim) {
  const int bucket = head_dim_bucket(head_dim);
#define FDMA_SM80_HAS(dtype, cutlass_type, hdim) \
  if (element == ElementType::dtype && bucket == hdim) return bucket;
  FDMA_SM80_KERNELS(FDMA_SM80_HAS)
#undef FDMA_SM80_HAS
  return 0;
}

int backward_smem_bytes(ElementType element, int head_dim) {
  const int bucket = head_dim_bucket(head_dim);
#define FDMA_SM80_SMEM(dtype, cutlass_type, hdim) \
  if (element == ElementType::dtype && bucket == hdim) return BackwardTraits<cutlass_type, hdim>::kSmemBytes;
  FDMA_SM80_KERNELS(FDMA_SM80_SMEM)
#undef FDMA_SM80_SMEM
  return 0;
}

int gather_forward_smem_bytes(ElementType element, int head_dim) {
  const int bucket = head_dim_bucket(head_dim);
#define FDMA_SM80_SMEM(dtype, cutlass_type, hdim) \
  if (element == ElementType::dtype && bucket == hdim) return gather_smem_bytes<ForwardTraits<cutlass_type, hdim>>();
  FDMA_SM80_KERNELS(FDMA_SM80_SMEM)
#undef FDMA_SM80_SMEM
  return 0;
}

// In a function template, so that the head dims without a gather backward, or without its paired
// heads, never instantiate those traits (a discarded `if constexpr` outside a template still
// does, and GCC 13 failed on the paired layouts' constant evaluation there).
template <typename Element, int kHeadDim>
int gather_backward_smem(int packed_heads) {
  if constexpr (kHeadDim > kMaxGatherBackwardHeadDim) {
    return 0;
  } else if constexpr (gather_backward_pairs_heads_at(kHeadDim)) {
    return packed_heads == 2 ? GatherBackwardSmem<BackwardTraits<Element, kHeadDim, 2>>::kBytes
                             : GatherBackwardSmem<BackwardTraits<Element, kHeadDim>>::kBytes;
  } else {
    return packed_heads == 1 ? GatherBackwardSmem<BackwardTraits<Element, kHeadDim>>::kBytes : 0;
  }
}

int gather_backward_smem_bytes(ElementType element, int head_dim, int packed_heads) {
  const int bucket = head_dim_bucket(head_dim);
#define FDMA_SM80_SMEM(dtype, cutlass_type, hdim) \
  if (element == ElementType::dtype && bucket == hdim) return gather_backward_smem<cutlass_type, hdim>(packed_heads);
  FDMA_SM80_KERNELS(FDMA_SM80_SMEM)
#undef FDMA_SM80_SMEM
  return 0;
}

cudaError_t forward(const ForwardParams& params, cudaStream_t stream) {
  const int bucket = head_dim_bucket(params.head_dim);
#define FDMA_SM80_RUN(dtype, cutlass_type, hdim) \
  if (params.element == ElementType::dtype && bucket == hdim) return run_forward<cutlass_type, hdim>(params, stream);
  FDMA_SM80_KERNELS(FDMA_SM80_RUN)
#undef FDMA_SM80_RUN
  return cudaErrorNotSupported;
}

cudaError_t backward(const BackwardParams& params, cudaStream_t stream) {
  const int bucket = head_dim_bucket(params.fwd.head_dim);
#define FDMA_SM80_RUN(dtype, cutlass_type, hdim) \
  if (params.fwd.element == ElementType::dtype && bucket == hdim) return run_backward<cutlass_type, hdim>(params, stream);
  FDMA_SM80_KERNELS(FDMA_SM80_RUN)
#undef FDMA_SM80_RUN
  return cudaErrorNotSupported;
}

}  // namespace flash_dmattn::kernels::sm80
