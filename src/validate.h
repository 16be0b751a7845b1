// Validation shared by every backend. It runs before dispatch, so a call that is wrong is wrong
// everywhere, and it reports the first problem found with the argument's name, the expected and
// the actual value.
#pragma once

#include "flash_dmattn/attention.h"
#include "problem.h"

namespace flash_dmattn {

Status validate_forward(const ForwardArgs& args, Problem* problem);
Status validate_backward(const BackwardArgs& args, Problem* problem);

// Head dims every backend runs: multiples of 8 up to 256 (the Python front pads other sizes).
inline constexpr std::int64_t kMaxHeadDim = 256;
inline constexpr std::int64_t kHeadDimMultiple = 8;

}  // namespace flash_dmattn
