// Umbrella header of the public C++ API.
#pragma once

#include "flash_dmattn/attention.h"
#include "flash_dmattn/status.h"
#include "flash_dmattn/tensor.h"
