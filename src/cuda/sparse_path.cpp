#include "cuda/sparse_path.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

namespace flash_dmattn {

SparsePath sparse_path(std::string* error) {
  const char* value = std::getenv(kSparsePathVariable);
  const std::string mode = value && *value ? value : "auto";
  if (mode == "tile") return SparsePath::tile;
  if (mode == "gather") return SparsePath::gather;
  if (mode != "auto" && error) {
    *error = std::string("flash_dmattn: ") + kSparsePathVariable + " must be auto, tile or gather, got '" + mode + "'";
  }
  return SparsePath::automatic;
}

bool gather_possible(const std::optional<TensorView>& mask, std::int64_t seqlen_q) {
  return mask && mask->shape[3] != 1 && (mask->shape[2] != 1 || seqlen_q == 1);
}

bool gather_applies(const std::optional<TensorView>& mask, std::int64_t seqlen_q, const PreparedMask* prepared,
                    BackendImpl::Pass pass) {
  switch (sparse_path()) {
    case SparsePath::gather: return gather_possible(mask, seqlen_q);
    case SparsePath::tile: return false;
    case SparsePath::automatic:
      return gather_possible(mask, seqlen_q) && prepared &&
             (pass == BackendImpl::Pass::forward ? prepared->gather_forward : prepared->gather_backward);
  }
  return false;
}

kernels::IndexRows index_rows(const TensorView& indices) {
  kernels::IndexRows rows;
  rows.data = static_cast<const std::int32_t*>(indices.data);
  rows.batch_stride = indices.shape[0] == 1 ? 0 : indices.stride[0];
  rows.head_stride = indices.shape[1] == 1 ? 0 : indices.stride[1];
  rows.row_stride = indices.shape[2] == 1 ? 0 : indices.stride[2];
  rows.entry_stride = indices.stride[3];
  rows.entries = static_cast<int>(indices.shape[3]);
  return rows;
}

cudaError_t listed_share(const kernels::KeyListExtent& e, const kernels::KeyLists& lists, cudaStream_t stream,
                         double* share) {
  *share = -1;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t error = cudaStreamIsCapturing(stream, &capture);
  if (error != cudaSuccess || capture != cudaStreamCaptureStatusNone) return error;
  std::vector<int> counts(static_cast<std::size_t>(e.lists()));
  if (counts.empty()) return cudaSuccess;
  error = cudaMemcpyAsync(counts.data(), lists.counts, counts.size() * sizeof(int), cudaMemcpyDeviceToHost, stream);
  if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
  if (error != cudaSuccess) return error;
  // List t of (batch, head) is query tile t % query_tiles(); its rows see keys up to the causal
  // limit of its last row, j <= rows_end - 1 + diagonal.
  const auto chunks = [&](std::int64_t keys) { return (keys + e.block_n - 1) / e.block_n; };
  std::int64_t listed = 0, span = 0;
  for (std::size_t list = 0; list < counts.size(); ++list) {
    const std::int64_t tile = static_cast<std::int64_t>(list) % e.query_tiles();
    const std::int64_t rows_end = std::min<std::int64_t>((tile + 1) * e.block_m, e.seqlen_q);
    const std::int64_t keys = e.causal ? std::clamp<std::int64_t>(rows_end + e.diagonal, 0, e.seqlen_k) : e.seqlen_k;
    listed += chunks(counts[list]);
    span += chunks(keys);
  }
  if (span > 0) *share = static_cast<double>(listed) / static_cast<double>(span);
  return cudaSuccess;
}

}  // namespace flash_dmattn
