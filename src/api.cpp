// The public entry points: validate, pick a backend, check the workspace, run.
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#include "backend.h"
#include "flash_dmattn/attention.h"
#include "validate.h"

namespace flash_dmattn {
namespace {

Status select_backend(const char* call, const Problem& problem, Backend requested, BackendImpl::Pass pass,
                      const BackendImpl** chosen) {
  std::string reasons;
  for (const BackendImpl* backend : compiled_backends()) {
    if (requested != Backend::automatic && backend->id() != requested) continue;
    const auto why_not = backend->cannot_run(problem, pass);
    if (!why_not) {
      *chosen = backend;
      return Status::success();
    }
    reasons += std::string(reasons.empty() ? "" : "; ") + backend_name(backend->id()) + ": " + *why_not;
  }
  if (reasons.empty()) {
    return Status::error(StatusCode::unsupported, std::string("flash_dmattn.") + call + ": backend '" +
                                                      backend_name(requested) + "' is not compiled into this library");
  }
  return Status::error(StatusCode::unsupported,
                       std::string("flash_dmattn.") + call + ": no backend can run this call (" + reasons + ")");
}

// What a preparation is checked against: the mask view and the call's sizes, causal flag and
// device, mixed into 64 bits (never 0, which marks a PreparedMask that was never prepared).
std::uint64_t mask_fingerprint(const TensorView& mask, const Problem& p) {
  std::uint64_t h = 0x9e3779b97f4a7c15ull;
  auto mix = [&h](std::uint64_t x) {
    h = (h ^ x) * 0x100000001b3ull;
    h ^= h >> 29;
  };
  mix(reinterpret_cast<std::uintptr_t>(mask.data));
  for (int d = 0; d < mask.rank; ++d) {
    mix(static_cast<std::uint64_t>(mask.shape[d]));
    mix(static_cast<std::uint64_t>(mask.stride[d]));
  }
  for (std::int64_t x : {p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.kv_heads, p.head_dim, p.total_q, p.total_k,
                         p.page_size, p.num_pages}) {
    mix(static_cast<std::uint64_t>(x));
  }
  mix(p.causal);
  mix(p.packed);
  mix(p.cached);
  mix(p.mask_packed);  // a bit-packed mask needs another summary than a bool view of its bytes
  mix(static_cast<std::uint64_t>(p.device.type));
  mix(static_cast<std::uint64_t>(p.device.index));
  return h == 0 ? 1 : h;
}

}  // namespace

ForwardArgs forward_view(const BackwardArgs& a) {
  ForwardArgs f;
  f.q = a.q;
  f.k = a.k;
  f.v = a.v;
  f.sequences = a.sequences;
  f.mask = a.mask;
  f.indices = a.indices;
  f.bias = a.bias;
  f.out = a.out;
  f.lse = a.lse;
  f.options = a.options;
  f.prepared_mask = a.prepared_mask;
  return f;
}

namespace {

Status check_memory(const std::string& prefix, const Workspace& memory, std::size_t required) {
  if (required == 0) return Status::success();
  if (memory.data == nullptr || memory.bytes < required) {
    return Status::error(StatusCode::invalid_argument,
                         prefix + "expected at least " + std::to_string(required) + " bytes, got " +
                             std::to_string(memory.data ? memory.bytes : 0) + (memory.data ? "" : " (null pointer)"));
  }
  if (reinterpret_cast<std::uintptr_t>(memory.data) % kWorkspaceAlignment != 0) {
    return Status::error(StatusCode::invalid_argument,
                         prefix + "expected a pointer aligned to " + std::to_string(kWorkspaceAlignment) + " bytes");
  }
  return Status::success();
}

// A call's prepared mask, if any, against the call.
template <typename Args>
Status check_prepared(const char* call, const Args& args, const Problem& problem, const BackendImpl& backend,
                      const char* argument = "prepared_mask") {
  const PreparedMask* prepared = args.prepared_mask;
  if (!prepared) return Status::success();
  const std::string prefix = std::string("flash_dmattn.") + call + ": argument '" + argument + "': ";
  if (!args.mask) {
    return Status::error(StatusCode::invalid_argument,
                         prefix + "expected the call's mask (argument 'mask') beside it, got no mask");
  }
  const std::uint64_t expected = mask_fingerprint(*args.mask, problem);
  if (prepared->fingerprint != expected) {
    return Status::error(StatusCode::invalid_argument,
                         prefix + "expected a preparation of this call's mask, lengths, heads, head dim, causal flag "
                                  "and device (fingerprint " + std::to_string(expected) + "), got fingerprint " +
                             std::to_string(prepared->fingerprint) +
                             (prepared->fingerprint == 0 ? " (never prepared: call prepare_mask)" : ""));
  }
  std::size_t required = 0;
  if constexpr (std::is_same_v<Args, BackwardArgs>) {
    required = backend.prepared_mask_size(forward_view(args), problem, prepared, MaskPreparation::full);
  } else {
    required = backend.prepared_mask_size(args, problem, prepared, MaskPreparation::full);
  }
  return check_memory(prefix + "memory: ", prepared->memory, required);
}

template <typename Args>
using Validator = Status (*)(const Args&, Problem*);

template <typename Args>
Status prepare(const char* call, const Args& args, Validator<Args> validate, BackendImpl::Pass pass,
               Problem* problem, const BackendImpl** backend) {
  Status status = validate(args, problem);
  if (!status.ok()) return status;
  status = select_backend(call, *problem, args.options.backend, pass, backend);
  if (!status.ok()) return status;
  status = (*backend)->check_settings(*problem, pass);
  if (!status.ok()) return status;
  return check_prepared(call, args, *problem, **backend);
}

constexpr auto kForward = BackendImpl::Pass::forward;
constexpr auto kBackward = BackendImpl::Pass::backward;

Capability capability_of(const BackendImpl& backend, const Problem& problem) {
  return Capability{backend.id(), backend.arch(problem), backend.describe(problem)};
}

}  // namespace

Status query_forward(const ForwardArgs& args, Capability* capability) {
  Problem problem;
  const BackendImpl* backend = nullptr;
  Status status = prepare("forward", args, validate_forward, kForward, &problem, &backend);
  if (status.ok()) *capability = capability_of(*backend, problem);
  return status;
}

Status query_backward(const BackwardArgs& args, Capability* capability) {
  Problem problem;
  const BackendImpl* backend = nullptr;
  Status status = prepare("backward", args, validate_backward, kBackward, &problem, &backend);
  if (status.ok()) *capability = capability_of(*backend, problem);
  return status;
}

Status forward_workspace_size(const ForwardArgs& args, std::size_t* bytes) {
  Problem problem;
  const BackendImpl* backend = nullptr;
  Status status = prepare("forward", args, validate_forward, kForward, &problem, &backend);
  if (status.ok()) *bytes = backend->forward_workspace_size(args, problem);
  return status;
}

Status backward_workspace_size(const BackwardArgs& args, std::size_t* bytes) {
  Problem problem;
  const BackendImpl* backend = nullptr;
  Status status = prepare("backward", args, validate_backward, kBackward, &problem, &backend);
  if (status.ok()) *bytes = backend->backward_workspace_size(args, problem);
  return status;
}

namespace {

// A preparation is of a masked forward's arguments (one handed in with them is ignored): *plain
// gets them without it, validated, with their problem and backend; *required the bytes.
Status prepare_masked(const char* call, const ForwardArgs& args, MaskPreparation what, ForwardArgs* plain,
                      Problem* problem, const BackendImpl** backend, std::size_t* required) {
  *plain = args;
  plain->prepared_mask = nullptr;
  Status status = prepare(call, *plain, validate_forward, kForward, problem, backend);
  if (!status.ok()) return status;
  if (!plain->mask) {
    return Status::error(StatusCode::invalid_argument, std::string("flash_dmattn.") + call +
                                                           ": argument 'mask': expected a mask to prepare, got none");
  }
  *required = (*backend)->prepared_mask_size(*plain, *problem, nullptr, what);
  return Status::success();
}

}  // namespace

Status prepared_mask_size(const ForwardArgs& args, std::size_t* bytes, MaskPreparation what) {
  ForwardArgs plain;
  Problem problem;
  const BackendImpl* backend = nullptr;
  return prepare_masked("prepared_mask_size", args, what, &plain, &problem, &backend, bytes);
}

Status prepare_mask(const ForwardArgs& args, PreparedMask* prepared, MaskPreparation what) {
  if (prepared == nullptr) {
    return Status::error(StatusCode::invalid_argument,
                         "flash_dmattn.prepare_mask: argument 'prepared': expected a PreparedMask, got a null pointer");
  }
  ForwardArgs plain;
  Problem problem;
  const BackendImpl* backend = nullptr;
  std::size_t required = 0;
  Status status = prepare_masked("prepare_mask", args, what, &plain, &problem, &backend, &required);
  if (!status.ok()) return status;
  status = check_memory("flash_dmattn.prepare_mask: argument 'prepared': memory: ", prepared->memory, required);
  if (!status.ok()) return status;
  prepared->fingerprint = 0;  // a preparation that fails part way is one that was never made
  status = backend->prepare_mask(plain, problem, prepared, what);
  if (status.ok()) prepared->fingerprint = mask_fingerprint(*plain.mask, problem);
  return status;
}

namespace {

// A deferred preparation's arguments, validated, with its backend, checked against the
// preparation as a call given it would be.
Status deferred_preparation(const char* call, const ForwardArgs& args, const PreparedMask& prepared,
                            ForwardArgs* plain, Problem* problem, const BackendImpl** backend) {
  std::size_t required = 0;
  Status status = prepare_masked(call, args, MaskPreparation::deferred_choice, plain, problem, backend, &required);
  if (!status.ok()) return status;
  plain->prepared_mask = &prepared;
  status = check_prepared(call, *plain, *problem, **backend, "prepared");
  plain->prepared_mask = nullptr;
  return status;
}

}  // namespace

Status prepared_list_sizes(const ForwardArgs& args, const PreparedMask& prepared, std::size_t* offset,
                           std::size_t* bytes) {
  ForwardArgs plain;
  Problem problem;
  const BackendImpl* backend = nullptr;
  Status status = deferred_preparation("prepared_list_sizes", args, prepared, &plain, &problem, &backend);
  if (!status.ok()) return status;
  std::tie(*offset, *bytes) = backend->prepared_list_sizes(plain, problem, prepared);
  return Status::success();
}

Status choose_mask_paths(const ForwardArgs& args, PreparedMask* prepared, const void* sizes, std::size_t bytes) {
  if (prepared == nullptr) {
    return Status::error(StatusCode::invalid_argument,
                         "flash_dmattn.choose_mask_paths: argument 'prepared': expected a PreparedMask, got a null "
                         "pointer");
  }
  ForwardArgs plain;
  Problem problem;
  const BackendImpl* backend = nullptr;
  Status status = deferred_preparation("choose_mask_paths", args, *prepared, &plain, &problem, &backend);
  if (!status.ok()) return status;
  const std::size_t expected = backend->prepared_list_sizes(plain, problem, *prepared).second;
  if (bytes != expected || (expected > 0 && sizes == nullptr)) {
    return Status::error(StatusCode::invalid_argument,
                         "flash_dmattn.choose_mask_paths: argument 'sizes': expected the " + std::to_string(expected) +
                             " bytes prepared_list_sizes() reports, got " + std::to_string(bytes) +
                             (sizes == nullptr ? " at a null pointer" : ""));
  }
  return backend->choose_mask_paths(plain, problem, prepared, sizes);
}

Status forward(const ForwardArgs& args) {
  Problem problem;
  const BackendImpl* backend = nullptr;
  Status status = prepare("forward", args, validate_forward, kForward, &problem, &backend);
  if (!status.ok()) return status;
  status = check_memory("flash_dmattn.forward: argument 'workspace': ", args.workspace,
                        backend->forward_workspace_size(args, problem));
  if (!status.ok()) return status;
  return backend->forward(args, problem);
}

Status backward(const BackwardArgs& args) {
  Problem problem;
  const BackendImpl* backend = nullptr;
  Status status = prepare("backward", args, validate_backward, kBackward, &problem, &backend);
  if (!status.ok()) return status;
  status = check_memory("flash_dmattn.backward: argument 'workspace': ", args.workspace,
                        backend->backward_workspace_size(args, problem));
  if (!status.ok()) return status;
  return backend->backward(args, problem);
}

std::vector<Backend> available_backends() {
  std::vector<Backend> result;
  for (const BackendImpl* backend : compiled_backends()) {
    // A backend is available when it can run the smallest valid problem on its own device kind.
    Problem probe;
    probe.batch = probe.seqlen_q = probe.seqlen_k = probe.heads = probe.kv_heads = 1;
    probe.head_dim = 64;
    probe.dtype = DType::bfloat16;
    probe.rows_aligned_16 = true;
    probe.device = backend->id() == Backend::cpu_reference ? Device{DeviceType::cpu, 0} : Device{DeviceType::cuda, 0};
    if (!backend->cannot_run(probe, kForward)) result.push_back(backend->id());
  }
  return result;
}

}  // namespace flash_dmattn
