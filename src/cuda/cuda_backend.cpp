// The CUDA backends behind the public API: fill the kernels' plain parameter structs from the
// validated views, build the mask's tile summary in the caller's workspace, launch on the
// caller's stream. Nothing here allocates or synchronizes.
#include <cuda_runtime.h>

#include <climits>
#include <string>

#include "../backend.h"
#include <algorithm>

#include "kernels/common/split_combine.h"
#include "kernels/common/tile_summary.h"
#include "kernels/params.h"
#include "kernels/sm80/forward.h"
#include "kernels/sm80/tile_size.h"

namespace flash_dmattn {
namespace {

using kernels::BroadcastOperand;
using kernels::ElementType;

constexpr std::size_t align_up(std::size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

ElementType element_type(DType dtype) {
  switch (dtype) {
    case DType::bfloat16: return ElementType::bfloat16;
    case DType::float32: return ElementType::float32;
    default: return ElementType::float16;
  }
}

// Reads a size-1 dimension through stride 0, so kernels never test for broadcasting.
BroadcastOperand broadcast_operand(const TensorView& t, std::int64_t heads) {
  BroadcastOperand op;
  op.ptr = t.data;
  op.type = element_type(t.dtype);
  op.batch_stride = t.shape[0] == 1 ? 0 : t.stride[0];
  op.head_stride = t.shape[1] == 1 ? 0 : t.stride[1];
  op.row_stride = t.shape[2] == 1 ? 0 : t.stride[2];
  op.col_stride = t.shape[3] == 1 ? 0 : t.stride[3];
  op.head_divisor = static_cast<int>(heads / t.shape[1]);
  return op;
}

kernels::MaskExtent mask_extent(const TensorView& mask, std::int64_t heads) {
  kernels::MaskExtent m;
  m.ptr = static_cast<const std::uint8_t*>(mask.data);
  m.batches = mask.shape[0];
  m.heads = mask.shape[1];
  m.rows = mask.shape[2];
  m.cols = mask.shape[3];
  m.batch_stride = mask.stride[0];
  m.head_stride = mask.stride[1];
  m.row_stride = mask.stride[2];
  m.col_stride = mask.stride[3];
  m.head_divisor = static_cast<int>(heads / mask.shape[1]);
  return m;
}

kernels::ForwardParams forward_params(const ForwardArgs& a, const Problem& p) {
  kernels::ForwardParams f;
  f.q = a.q.data;
  f.k = a.k.data;
  f.v = a.v.data;
  f.out = a.out.data;
  f.lse = static_cast<float*>(a.lse.data);
  f.element = element_type(p.dtype);
  f.q_batch_stride = a.q.stride[0];
  f.q_row_stride = a.q.stride[1];
  f.q_head_stride = a.q.stride[2];
  f.k_batch_stride = a.k.stride[0];
  f.k_row_stride = a.k.stride[1];
  f.k_head_stride = a.k.stride[2];
  f.v_batch_stride = a.v.stride[0];
  f.v_row_stride = a.v.stride[1];
  f.v_head_stride = a.v.stride[2];
  f.out_batch_stride = a.out.stride[0];
  f.out_row_stride = a.out.stride[1];
  f.out_head_stride = a.out.stride[2];
  f.lse_batch_stride = a.lse.stride[0];
  f.lse_head_stride = a.lse.stride[1];
  if (a.mask) f.mask = broadcast_operand(*a.mask, p.heads);
  if (a.bias) f.bias = broadcast_operand(*a.bias, p.heads);
  f.batch = static_cast<int>(p.batch);
  f.seqlen_q = static_cast<int>(p.seqlen_q);
  f.seqlen_k = static_cast<int>(p.seqlen_k);
  f.heads = static_cast<int>(p.heads);
  f.kv_heads = static_cast<int>(p.kv_heads);
  f.head_dim = static_cast<int>(p.head_dim);
  f.scale = static_cast<float>(p.scale);
  f.softcap = static_cast<float>(p.softcap);
  f.causal = p.causal;
  return f;
}

// How a forward runs: GQA packing and split-KV when the grid would not fill the GPU (decode),
// and the workspace layout that follows: [tile summary][partial outputs][partial LSEs].
struct ForwardPlan {
  int pack_group = 1;
  int num_splits = 1;
  std::size_t summary_bytes = 0, partial_out_bytes = 0, partial_lse_bytes = 0;

  std::size_t workspace_bytes() const {
    return align_up(summary_bytes) + align_up(partial_out_bytes) + align_up(partial_lse_bytes);
  }
};

ForwardPlan plan_forward(const ForwardArgs& a, const Problem& p) {
  ForwardPlan plan;
  if (a.mask) plan.summary_bytes = kernels::tile_summary_bytes(mask_extent(*a.mask, p.heads));
  // Packing puts the query heads of one KV head into one CTA's rows, so they share each K/V
  // load. A tile then reads one mask summary, so a mask with a head per query head is not packed.
  const std::int64_t group = p.group_size();
  const bool mask_per_query_head = a.mask && a.mask->shape[1] == p.heads && group > 1;
  if (group > 1 && p.seqlen_q <= 16 && !mask_per_query_head) plan.pack_group = static_cast<int>(group);

  // Split the keys when the grid has fewer CTAs than the GPU runs at once: aim at two waves.
  const auto tile = kernels::sm80::forward_tile(static_cast<int>(p.head_dim));
  const std::int64_t rows = p.seqlen_q * plan.pack_group;
  const std::int64_t ctas = (rows + tile.block_m - 1) / tile.block_m *
                            (plan.pack_group > 1 ? p.kv_heads : p.heads) * p.batch;
  const std::int64_t key_tiles = (p.seqlen_k + tile.block_n - 1) / tile.block_n;
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p.device.index) != cudaSuccess) {
    cudaGetLastError();  // consume it: without the count the plan simply does not split
    sms = 0;
  }
  const std::int64_t slots = std::int64_t(sms) * tile.ctas_per_sm;
  if (ctas > 0 && ctas < slots && key_tiles > 1) {
    plan.num_splits = static_cast<int>(
        std::min<std::int64_t>({(2 * slots + ctas - 1) / ctas, key_tiles, kernels::kMaxSplits}));
  }
  if (plan.num_splits > 1) {
    const std::size_t row_count = static_cast<std::size_t>(plan.num_splits) * p.batch * p.heads * p.seqlen_q;
    plan.partial_out_bytes = row_count * p.head_dim * sizeof(float);
    plan.partial_lse_bytes = row_count * sizeof(float);
  }
  return plan;
}

// Makes the tensors' device current for the duration of a call, and restores the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int current = previous_;
    cudaGetDevice(&current);
    if (current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

Status cuda_failure(const char* what, cudaError_t error) {
  return Status::error(StatusCode::backend_error,
                       std::string("flash_dmattn: ") + what + " failed: " + cudaGetErrorString(error));
}

class CudaSm80Backend final : public BackendImpl {
 public:
  Backend id() const override { return Backend::cuda_sm80; }

  std::optional<std::string> cannot_run(const Problem& p, Pass pass) const override {
    if (p.device.type != DeviceType::cuda) return "runs on CUDA tensors, got tensors on " + device_name(p.device);
    if (pass == Pass::backward) return std::string("the sm80 backward is not implemented yet");
    const int arch = arch_of(p.device.index);
    if (arch < 0) return "cannot query CUDA device " + std::to_string(p.device.index);
    if (arch < 80) return "needs compute capability 8.0 or newer, device has " + std::to_string(arch / 10) + "." +
                          std::to_string(arch % 10);
    const ElementType element = element_type(p.dtype);
    if (kernels::sm80::forward_head_dim_bucket(element, static_cast<int>(p.head_dim)) == 0) {
      return "head dim " + std::to_string(p.head_dim) + " (" + dtype_name(p.dtype) + ") needs the head-dim " +
             std::to_string(kernels::sm80::head_dim_bucket(static_cast<int>(p.head_dim))) +
             " kernel, which this build does not include (FLASH_DMATTN_HEAD_DIMS, FLASH_DMATTN_DTYPES)";
    }
    if (!p.rows_aligned_16) {
      return std::string(
          "needs q, k, v and out with 16-byte aligned rows: base pointers aligned to 16 bytes and batch, row and "
          "head strides that are multiples of 8 elements");
    }
    if (p.batch > 65535 || p.heads > 65535) return std::string("supports at most 65535 batches and 65535 heads");
    if (p.seqlen_q > INT_MAX / 2 || p.seqlen_k > INT_MAX / 2) return std::string("supports lengths below 2^30");
    return std::nullopt;
  }

  int arch(const Problem& p) const override { return arch_of(p.device.index); }

  std::string describe(const Problem& p) const override {
    return "cuda_sm80: mma.sync kernels on cuda:" + std::to_string(p.device.index) + " (sm_" +
           std::to_string(arch_of(p.device.index)) + ")";
  }

  std::size_t forward_workspace_size(const ForwardArgs& a, const Problem& p) const override {
    return p.empty() ? 0 : plan_forward(a, p).workspace_bytes();
  }

  std::size_t backward_workspace_size(const BackwardArgs&, const Problem&) const override { return 0; }

  Status forward(const ForwardArgs& a, const Problem& p) const override {
    if (p.empty()) return Status::success();
    const DeviceGuard guard(p.device.index);
    const auto stream = static_cast<cudaStream_t>(a.options.stream);
    kernels::ForwardParams params = forward_params(a, p);
    const ForwardPlan plan = plan_forward(a, p);
    char* workspace = static_cast<char*>(a.workspace.data);
    params.pack_group = plan.pack_group;
    params.num_splits = plan.num_splits;
    if (plan.num_splits > 1) {
      params.partial_out = reinterpret_cast<float*>(workspace + align_up(plan.summary_bytes));
      params.partial_lse =
          reinterpret_cast<float*>(workspace + align_up(plan.summary_bytes) + align_up(plan.partial_out_bytes));
    }
    if (a.mask) {
      const cudaError_t e = kernels::build_tile_summary(mask_extent(*a.mask, p.heads), workspace, stream,
                                                        &params.summary);
      if (e != cudaSuccess) return cuda_failure("the tile summary launch", e);
    }
    cudaError_t e = kernels::sm80::forward(params, stream);
    if (e != cudaSuccess) return cuda_failure("the sm80 forward launch", e);
    if (plan.num_splits > 1) {
      e = kernels::combine_split_partials(params, stream);
      if (e != cudaSuccess) return cuda_failure("the split-KV combine launch", e);
    }
    return Status::success();
  }

  Status backward(const BackwardArgs&, const Problem&) const override {
    return Status::error(StatusCode::unsupported, "flash_dmattn.backward: the sm80 backward is not implemented yet");
  }

 private:
  static int arch_of(int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      cudaGetLastError();  // consume the error so that the caller's next cudaGetLastError does not see it
      return -1;
    }
    return major * 10 + minor;
  }
};

}  // namespace

const BackendImpl& cuda_sm80_backend() {
  static const CudaSm80Backend backend;
  return backend;
}

}  // namespace flash_dmattn
