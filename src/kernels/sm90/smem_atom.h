// The shared-memory swizzle atom of a wgmma operand.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>

namespace flash_dmattn::kernels::sm90 {

// The widest swizzle whose 8-row atom spans a whole number of `kContiguous`-element rows:
// wgmma reads it without bank conflicts and its descriptors describe it exactly.
template <typename Element, int kContiguous, cute::GMMA::Major kMajor>
constexpr auto smem_atom() {
  using namespace cute::GMMA;
  constexpr int kRowElems = 128 / sizeof(Element);  // elements in 128 bytes
  if constexpr (kMajor == Major::K) {
    if constexpr (kContiguous % kRowElems == 0) return Layout_K_SW128_Atom<Element>{};
    else if constexpr (kContiguous % (kRowElems / 2) == 0) return Layout_K_SW64_Atom<Element>{};
    else return Layout_K_SW32_Atom<Element>{};
  } else {
    if constexpr (kContiguous % kRowElems == 0) return Layout_MN_SW128_Atom<Element>{};
    else if constexpr (kContiguous % (kRowElems / 2) == 0) return Layout_MN_SW64_Atom<Element>{};
    else return Layout_MN_SW32_Atom<Element>{};
  }
}

}  // namespace flash_dmattn::kernels::sm90
