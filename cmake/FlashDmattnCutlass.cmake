# Locates the CuTe/CUTLASS headers and defines the INTERFACE target flash_dmattn_cutlass.
#
# Order: the CUTLASS_DIR cache variable or environment variable (a CUTLASS checkout, or any
# folder whose include/ holds cute/ and cutlass/), then the pinned `nvidia-cutlass` wheel in the
# Python that CMake finds (its headers are under cutlass_library/source/include).
set(FLASH_DMATTN_CUTLASS_PIN "nvidia-cutlass==4.2.0.0")
set(CUTLASS_DIR "$ENV{CUTLASS_DIR}" CACHE PATH "CUTLASS root (its include/ holds cute/ and cutlass/)")

set(_cutlass_include "")
if(CUTLASS_DIR)
  set(_cutlass_include "${CUTLASS_DIR}/include")
else()
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    # find_spec locates the package without importing it (importing needs its Python dependencies).
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
        "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(os.path.dirname(s.origin), 'source', 'include') if s else '')"
      OUTPUT_VARIABLE _cutlass_include OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
endif()

if(NOT _cutlass_include OR NOT EXISTS "${_cutlass_include}/cute/tensor.hpp")
  message(FATAL_ERROR
    "flash_dmattn: CuTe/CUTLASS headers not found (looked in '${_cutlass_include}'). Install the pinned wheel "
    "with `python3 -m pip install --no-deps ${FLASH_DMATTN_CUTLASS_PIN}`, or set CUTLASS_DIR to a CUTLASS checkout, "
    "or configure with -DFLASH_DMATTN_CUDA=OFF for the CPU backend alone.")
endif()
message(STATUS "flash_dmattn: CuTe/CUTLASS headers in ${_cutlass_include}")

add_library(flash_dmattn_cutlass INTERFACE)
target_include_directories(flash_dmattn_cutlass SYSTEM INTERFACE "${_cutlass_include}")
