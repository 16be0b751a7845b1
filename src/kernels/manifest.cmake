# The kernel instantiations a build may compile. cmake/FlashDmattnKernels.cmake reads these
# lists, writes one translation unit per (family, pass, dtype, head dim) and kernel_manifest.h, from
# which dispatch learns what exists. FLASH_DMATTN_HEAD_DIMS and FLASH_DMATTN_DTYPES pick a subset
# for fast iteration; the default is everything.
set(FLASH_DMATTN_ALL_HEAD_DIMS 32 64 96 128 192 256)
set(FLASH_DMATTN_ALL_DTYPES float16 bfloat16)
# Head dims of the sm90a forward; the others run the sm80 kernels. Larger ones: a thread's
# 64 x D / 128 output accumulators and the loop's other state do not fit its registers yet. Its
# tiles: sm90/tile_size.h.
set(FLASH_DMATTN_SM90A_HEAD_DIMS 32 64 96 128)
# Head dims of the sm90a backward (sm90/tile_size.h says how its warpgroups split the work).
# Dense-equivalent backward, H200: D = 64 4.92 ms against 6.29 for sm80; D = 128 (split by query
# rows) 7.90 against 8.65; D = 32 (the seed's B1 H2/1 S16384, every causal key) 1.35 against 1.77.
# D = 96 is untried with that split.
set(FLASH_DMATTN_SM90A_BACKWARD_HEAD_DIMS 32 64 128)
# Head dims of the sm90a gather backward (sm90/bwd_gather_mainloop.h: the D128 configuration of
# the sm90a backward, two query heads per CTA).
set(FLASH_DMATTN_SM90A_GATHER_BACKWARD_HEAD_DIMS 128)
set(FLASH_DMATTN_CUTLASS_TYPE_float16 "cutlass::half_t")
set(FLASH_DMATTN_CUTLASS_TYPE_bfloat16 "cutlass::bfloat16_t")
