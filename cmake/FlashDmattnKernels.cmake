# The one generator of kernel instantiations (see src/kernels/manifest.cmake).
include(${PROJECT_SOURCE_DIR}/src/kernels/manifest.cmake)

set(FLASH_DMATTN_HEAD_DIMS "${FLASH_DMATTN_ALL_HEAD_DIMS}" CACHE STRING
    "Head-dim buckets to compile (subset of ${FLASH_DMATTN_ALL_HEAD_DIMS}); fewer means a faster build")
set(FLASH_DMATTN_DTYPES "${FLASH_DMATTN_ALL_DTYPES}" CACHE STRING
    "Element types to compile (subset of ${FLASH_DMATTN_ALL_DTYPES})")

# Sets `out_var` to the generated sources; the manifest header lands in `include_dir`.
function(flash_dmattn_generate_kernels out_var include_dir)
  set(gen "${CMAKE_CURRENT_BINARY_DIR}/generated")
  set(sources "")
  set(entries "")
  foreach(dtype IN LISTS FLASH_DMATTN_DTYPES)
    if(NOT dtype IN_LIST FLASH_DMATTN_ALL_DTYPES)
      message(FATAL_ERROR "FLASH_DMATTN_DTYPES: '${dtype}' is not one of ${FLASH_DMATTN_ALL_DTYPES}")
    endif()
    set(CUTLASS_TYPE "${FLASH_DMATTN_CUTLASS_TYPE_${dtype}}")
    foreach(HEAD_DIM IN LISTS FLASH_DMATTN_HEAD_DIMS)
      if(NOT HEAD_DIM IN_LIST FLASH_DMATTN_ALL_HEAD_DIMS)
        message(FATAL_ERROR "FLASH_DMATTN_HEAD_DIMS: '${HEAD_DIM}' is not one of ${FLASH_DMATTN_ALL_HEAD_DIMS}")
      endif()
      set(file "${gen}/fwd_sm80_${dtype}_hdim${HEAD_DIM}.cu")
      configure_file("${PROJECT_SOURCE_DIR}/src/kernels/sm80/fwd_instantiation.cu.in" "${file}" @ONLY)
      list(APPEND sources "${file}")
      string(APPEND entries "  X(${dtype}, ${CUTLASS_TYPE}, ${HEAD_DIM}) \\\n")
    endforeach()
  endforeach()
  set(FWD_SM80_ENTRIES "${entries}")
  configure_file("${PROJECT_SOURCE_DIR}/src/kernels/kernel_manifest.h.in" "${gen}/kernel_manifest.h" @ONLY)
  set(${out_var} "${sources}" PARENT_SCOPE)
  set(${include_dir} "${gen}" PARENT_SCOPE)
endfunction()
