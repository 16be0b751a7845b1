# The kernel instantiations a build may compile. cmake/FlashDmattnKernels.cmake reads these
# lists, writes one translation unit per (family, pass, dtype, head dim) and kernel_manifest.h, from
# which dispatch learns what exists. FLASH_DMATTN_HEAD_DIMS and FLASH_DMATTN_DTYPES pick a subset
# for fast iteration; the default is everything.
set(FLASH_DMATTN_ALL_HEAD_DIMS 32 64 96 128 192 256)
set(FLASH_DMATTN_ALL_DTYPES float16 bfloat16)
set(FLASH_DMATTN_CUTLASS_TYPE_float16 "cutlass::half_t")
set(FLASH_DMATTN_CUTLASS_TYPE_bfloat16 "cutlass::bfloat16_t")
