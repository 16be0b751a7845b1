// What the CUDA backend reads about a device on every call: its architecture, SM count and
// opt-in shared memory per block. Queried once per device and kept: they do not change while the
// process runs, and a call read them a dozen or more times (about 0.3 us each on an H200 host,
// torch's profiler; docs/architecture.md, "Host time").
#pragma once

namespace flash_dmattn {

struct DeviceInfo {
  int arch = -1;                // major * 10 + minor; -1: the device could not be queried
  int multiprocessors = 0;      // 0: unknown (the plans then do not split)
  int smem_per_block_optin = 0; // bytes of dynamic shared memory one block may opt into
};

// The attributes of CUDA device `device`. A query that fails is not kept (the next call asks
// again) and leaves no error pending for the caller's cudaGetLastError.
DeviceInfo device_info(int device);

}  // namespace flash_dmattn
