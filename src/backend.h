// What a backend provides to the dispatcher. The CPU reference is always compiled in; the CUDA
// backends register themselves in backend_registry.cpp when the library is built with CUDA.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flash_dmattn/attention.h"
#include "problem.h"

namespace flash_dmattn {

class BackendImpl {
 public:
  virtual ~BackendImpl() = default;

  enum class Pass { forward, backward };

  virtual Backend id() const = 0;
  // Why this backend cannot run a validated problem, or nullopt when it can.
  virtual std::optional<std::string> cannot_run(const Problem& problem, Pass pass) const = 0;
  // Compute capability the problem's device would run at (0 for the CPU).
  virtual int arch(const Problem& problem) const = 0;
  virtual std::string describe(const Problem& problem) const = 0;
  // An environment setting this backend reads that it cannot honour for the problem (an error
  // naming it), reported before workspace sizes, which may depend on the setting, are computed.
  virtual Status check_settings(const Problem& /*problem*/, Pass /*pass*/) const { return Status::success(); }

  virtual std::size_t forward_workspace_size(const ForwardArgs& args, const Problem& problem) const = 0;
  virtual std::size_t backward_workspace_size(const BackwardArgs& args, const Problem& problem) const = 0;
  // The mask preparation (attention.h PreparedMask): what the backend's masked calls would build
  // per call. None by default. prepared: the preparation a call reads (its size follows what it
  // holds), or nullptr for the one prepare_mask() would build now, of `what`.
  virtual std::size_t prepared_mask_size(const ForwardArgs& /*args*/, const Problem& /*problem*/,
                                         const PreparedMask* /*prepared*/, MaskPreparation /*what*/) const {
    return 0;
  }
  // Builds it into prepared->memory (of at least the reported size) and sets prepared's gather flags.
  virtual Status prepare_mask(const ForwardArgs& /*args*/, const Problem& /*problem*/, PreparedMask* prepared,
                              MaskPreparation /*what*/) const {
    prepared->gather_forward = prepared->gather_backward = prepared->gather_backward_unpaired = false;
    prepared->sm90a_forward_lists = prepared->choice_pending = false;
    return Status::success();
  }
  // MaskPreparation::deferred_choice's lists' sizes in prepared.memory: {offset, bytes}, {0, 0}
  // where it holds none.
  virtual std::pair<std::size_t, std::size_t> prepared_list_sizes(const ForwardArgs& /*args*/,
                                                                  const Problem& /*problem*/,
                                                                  const PreparedMask& /*prepared*/) const {
    return {0, 0};
  }
  // Sets a deferred preparation's paths from a host copy of those bytes (as many as reported).
  virtual Status choose_mask_paths(const ForwardArgs& /*args*/, const Problem& /*problem*/,
                                   PreparedMask* /*prepared*/, const void* /*sizes*/) const {
    return Status::success();
  }
  // Both run on validated arguments with a workspace of at least the reported size.
  virtual Status forward(const ForwardArgs& args, const Problem& problem) const = 0;
  virtual Status backward(const BackwardArgs& args, const Problem& problem) const = 0;
};

// The forward's arguments inside a backward's (its inputs, out, lse, options and prepared mask).
ForwardArgs forward_view(const BackwardArgs& args);

// Every backend compiled in, best first.
const std::vector<const BackendImpl*>& compiled_backends();

const BackendImpl& cpu_reference_backend();
#ifdef FLASH_DMATTN_HAS_CUDA
const BackendImpl& cuda_sm80_backend();
#endif

}  // namespace flash_dmattn
