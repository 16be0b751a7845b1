// Validation shared by every backend. It runs before dispatch, so a call that is wrong is wrong
// everywhere, and it reports the first problem found with the argument's name, the expected and
// the actual value.
#pragma once

#include "flash_dmattn/attention.h"
#include "kernels/params.h"
#include "problem.h"

namespace flash_dmattn {

Status validate_forward(const ForwardArgs& args, Problem* problem);
Status validate_backward(const BackwardArgs& args, Problem* problem);

// Head dims every backend runs (the Python front pads other sizes).
using kernels::kHeadDimMultiple;
using kernels::kMaxHeadDim;

}  // namespace flash_dmattn
