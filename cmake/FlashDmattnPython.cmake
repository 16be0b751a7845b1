# The compiled module flash_dmattn._C (src/python/module.cpp), made with nanobind. It links the
# static library and no framework: tensors cross as pointers, shapes and strides, so one build
# serves every torch version. pyproject.toml drives this file through scikit-build-core, which
# installs the module next to the Python sources of python/flash_dmattn/.
find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)
if(NOT nanobind_DIR)
  # Outside scikit-build-core (a plain CMake build), ask the Python that CMake found.
  execute_process(COMMAND "${Python_EXECUTABLE}" -m nanobind --cmake_dir
                  OUTPUT_VARIABLE nanobind_DIR OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
find_package(nanobind CONFIG REQUIRED)

# NB_DOMAIN keeps our bindings apart from other nanobind modules loaded in the same process.
nanobind_add_module(flash_dmattn_python NB_STATIC NB_DOMAIN flash_dmattn src/python/module.cpp)
set_target_properties(flash_dmattn_python PROPERTIES OUTPUT_NAME _C)
target_link_libraries(flash_dmattn_python PRIVATE flash_dmattn)
# Our warning flags apply to our code only: nanobind's headers are included as system headers.
target_include_directories(flash_dmattn_python SYSTEM PRIVATE "${NB_DIR}/include")
flash_dmattn_set_warnings(flash_dmattn_python)
if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
  # Keep the static libraries' symbols (ours and the static CUDA runtime) out of the module's
  # dynamic symbol table, so they never collide with the CUDA runtime torch loads.
  target_link_options(flash_dmattn_python PRIVATE "LINKER:--exclude-libs,ALL")
endif()

if(FLASH_DMATTN_WITH_CUDA)
  target_compile_definitions(flash_dmattn_python PRIVATE FLASH_DMATTN_PYTHON_WITH_CUDA)
else()
  # pip shows this with `pip install -v`; at run time a CUDA tensor gets the same explanation.
  message(WARNING "flash_dmattn: the Python module is built WITHOUT the CUDA backends (no nvcc found, or "
                  "FLASH_DMATTN_CUDA=OFF); it runs CPU tensors only. Put nvcc on PATH and reinstall for GPU support.")
endif()

install(TARGETS flash_dmattn_python LIBRARY DESTINATION flash_dmattn)
