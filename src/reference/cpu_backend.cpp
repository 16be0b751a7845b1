// The CPU backend of the public API: the fp64 reference, with results rounded once into the
// caller's output dtypes. It recomputes the forward inside the backward in fp64 and reads the
// given `out` and `lse` only for rows whose lse differs from its own (reference::backward).
#include <string>

#include "../backend.h"
#include "../host_numeric.h"
#include "../parallel.h"
#include "reference.h"

namespace flash_dmattn {
namespace {

template <typename Args>
reference::Inputs reference_inputs(const Args& a, const Problem& p) {
  reference::Inputs in;
  in.q = a.q;
  in.k = a.k;
  in.v = a.v;
  in.mask = a.mask ? &*a.mask : nullptr;
  in.indices = a.indices ? &*a.indices : nullptr;
  in.bias = a.bias ? &*a.bias : nullptr;
  in.scale = p.scale;
  in.causal = p.causal;
  in.softcap = p.softcap;
  return in;
}

reference::Sequences sequences(const PackedSequences& s) { return {&s.cu_seqlens_q, &s.cu_seqlens_k}; }
reference::Cache cache(const KeyValueCache& c) { return {&c.seqlens_k, c.block_table ? &*c.block_table : nullptr}; }

// Key lists hold keys in [0, Sk) or -1: the values are read here, where reading them is free (the
// validation before the backends reads shapes alone).
Status check_indices(const char* call, const std::optional<TensorView>& indices, const Problem& p) {
  if (!indices) return Status::success();
  const TensorView& t = *indices;
  for (std::int64_t b = 0; b < t.shape[0]; ++b)
    for (std::int64_t h = 0; h < t.shape[1]; ++h)
      for (std::int64_t i = 0; i < t.shape[2]; ++i)
        for (std::int64_t e = 0; e < t.shape[3]; ++e) {
          const double key = host::load(t, host::offset4(t, b, h, i, e));
          if (key < -1 || key >= static_cast<double>(p.seqlen_k)) {
            return Status::error(StatusCode::invalid_argument,
                                 std::string("flash_dmattn.") + call + ": argument 'indices': expected key indices in [0, " +
                                     std::to_string(p.seqlen_k) + ") or -1 (padding), got " +
                                     std::to_string(static_cast<long long>(key)) + " at (" + std::to_string(b) + ", " +
                                     std::to_string(h) + ", " + std::to_string(i) + ", " + std::to_string(e) + ")");
          }
        }
  return Status::success();
}

// Writes a contiguous buffer of the view's shape into the (strided) view.
void store_all(const TensorView& view, const std::vector<double>& values) {
  std::int64_t shape[kMaxRank] = {1, 1, 1, 1};
  std::int64_t stride[kMaxRank] = {0, 0, 0, 0};
  const int pad = kMaxRank - view.rank;
  for (int d = 0; d < view.rank; ++d) {
    shape[pad + d] = view.shape[d];
    stride[pad + d] = view.stride[d];
  }
  std::int64_t e = 0;
  for (std::int64_t a = 0; a < shape[0]; ++a)
    for (std::int64_t b = 0; b < shape[1]; ++b)
      for (std::int64_t c = 0; c < shape[2]; ++c)
        for (std::int64_t d = 0; d < shape[3]; ++d)
          host::store(view, a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3], values[e++]);
}

class CpuReferenceBackend final : public BackendImpl {
 public:
  Backend id() const override { return Backend::cpu_reference; }

  std::optional<std::string> cannot_run(const Problem& p, Pass) const override {
    if (p.device.type != DeviceType::cpu) return "runs on CPU tensors, got tensors on " + device_name(p.device);
    return std::nullopt;
  }

  int arch(const Problem&) const override { return 0; }

  std::string describe(const Problem& p) const override {
    return "cpu_reference: fp64 CPU reference, " + std::to_string(host::worker_count(p.batch * p.heads, 4.0 * p.batch * p.heads * p.seqlen_q * p.seqlen_k * p.head_dim)) + " threads";
  }

  std::size_t forward_workspace_size(const ForwardArgs&, const Problem&) const override { return 0; }
  std::size_t backward_workspace_size(const BackwardArgs&, const Problem&) const override { return 0; }

  Status forward(const ForwardArgs& a, const Problem& p) const override {
    const Status lists = check_indices("forward", a.indices, p);
    if (!lists.ok() || p.empty()) return lists;
    const reference::Inputs inputs = reference_inputs(a, p);
    const reference::ForwardResult r = a.sequences ? reference::forward(inputs, sequences(*a.sequences))
                                       : a.cache   ? reference::forward(inputs, cache(*a.cache))
                                                   : reference::forward(inputs);
    store_all(a.out, r.out);
    store_all(a.lse, r.lse);
    return Status::success();
  }

  Status backward(const BackwardArgs& a, const Problem& p) const override {
    const Status lists = check_indices("backward", a.indices, p);
    if (!lists.ok()) return lists;
    const reference::GivenRows given{&a.out, &a.lse};
    const reference::Gradients g = a.sequences
                                       ? reference::backward(reference_inputs(a, p), sequences(*a.sequences), a.dout, given)
                                       : reference::backward(reference_inputs(a, p), a.dout, given);
    store_all(a.dq, g.dq);
    store_all(a.dk, g.dk);
    store_all(a.dv, g.dv);
    if (a.dbias) store_all(*a.dbias, g.dbias);
    return Status::success();
  }
};

}  // namespace

const BackendImpl& cpu_reference_backend() {
  static const CpuReferenceBackend backend;
  return backend;
}

}  // namespace flash_dmattn
