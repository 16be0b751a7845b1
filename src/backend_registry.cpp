#include "backend.h"

namespace flash_dmattn {

const std::vector<const BackendImpl*>& compiled_backends() {
  static const std::vector<const BackendImpl*> backends = {
#ifdef FLASH_DMATTN_HAS_CUDA
      &cuda_sm80_backend(),
#endif
      &cpu_reference_backend(),
  };
  return backends;
}

}  // namespace flash_dmattn
