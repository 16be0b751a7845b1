// The public entry points: validate, pick a backend, check the workspace, run.
#include <cstdint>
#include <string>

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

Status check_workspace(const char* call, const Workspace& ws, std::size_t required) {
  if (required == 0) return Status::success();
  const std::string prefix = std::string("flash_dmattn.") + call + ": argument 'workspace': ";
  if (ws.data == nullptr || ws.bytes < required) {
    return Status::error(StatusCode::invalid_argument, prefix + "expected at least " + std::to_string(required) +
                                                           " bytes, got " + std::to_string(ws.data ? ws.bytes : 0) +
                                                           (ws.data ? "" : " (null pointer)"));
  }
  if (reinterpret_cast<std::uintptr_t>(ws.data) % kWorkspaceAlignment != 0) {
    return Status::error(StatusCode::invalid_argument,
                         prefix + "expected a pointer aligned to " + std::to_string(kWorkspaceAlignment) + " bytes");
  }
  return Status::success();
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
  return (*backend)->check_settings(*problem, pass);
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

Status forward(const ForwardArgs& args) {
  Problem problem;
  const BackendImpl* backend = nullptr;
  Status status = prepare("forward", args, validate_forward, kForward, &problem, &backend);
  if (!status.ok()) return status;
  status = check_workspace("forward", args.workspace, backend->forward_workspace_size(args, problem));
  if (!status.ok()) return status;
  return backend->forward(args, problem);
}

Status backward(const BackwardArgs& args) {
  Problem problem;
  const BackendImpl* backend = nullptr;
  Status status = prepare("backward", args, validate_backward, kBackward, &problem, &backend);
  if (!status.ok()) return status;
  status = check_workspace("backward", args.workspace, backend->backward_workspace_size(args, problem));
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
