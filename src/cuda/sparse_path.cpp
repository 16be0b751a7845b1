#include "cuda/sparse_path.h"

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
  // (A bit-packed mask always has a key dim: its bytes never broadcast, ceil(Sk/8) may be 1.)
  const bool keys = mask && (mask->shape[3] != 1 || mask->dtype == DType::uint8);
  return keys && (mask->shape[2] != 1 || seqlen_q == 1);
}

bool gather_applies(const std::optional<TensorView>& mask, std::int64_t seqlen_q, const PreparedMask* prepared,
                    BackendImpl::Pass pass, bool heads_pair) {
  switch (sparse_path()) {
    case SparsePath::gather: return gather_possible(mask, seqlen_q);
    case SparsePath::tile: return false;
    case SparsePath::automatic: {
      if (!gather_possible(mask, seqlen_q) || !prepared) return false;
      if (pass == BackendImpl::Pass::forward) return prepared->gather_forward;
      return heads_pair ? prepared->gather_backward : prepared->gather_backward_unpaired;
    }
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

cudaError_t listed_work(const kernels::KeyListExtent& e, const kernels::KeyLists& lists, cudaStream_t stream,
                        ListedWork* work) {
  *work = ListedWork{};
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t error = cudaStreamIsCapturing(stream, &capture);
  if (error != cudaSuccess || capture != cudaStreamCaptureStatusNone) return error;
  std::vector<int> sizes(list_sizes_bytes(e) / sizeof(int));
  if (!sizes.empty()) {
    error = cudaMemcpyAsync(sizes.data(), lists.counts, list_sizes_bytes(e), cudaMemcpyDeviceToHost, stream);
    if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
    if (error != cudaSuccess) return error;
  }
  *work = listed_work(e, sizes.data());
  return cudaSuccess;
}

ListedWork listed_work(const kernels::KeyListExtent& e, const int* sizes) {
  ListedWork work;
  const std::size_t n = static_cast<std::size_t>(e.lists());
  // List t of (batch, head) is query tile t % query_tiles() (choose_gather_path's kernel sums the same).
  for (std::size_t list = 0; list < n; ++list) {
    work.listed += e.chunks(sizes[list]);
    work.visible += sizes[n + list];
    work.span += e.chunks(e.span_keys(static_cast<std::int64_t>(list) % e.query_tiles()));
  }
  work.known = true;
  return work;
}

bool gather_pays(const ListedWork& work, double share) {
  return work.known && kernels::lists_pay(work.listed, work.visible, work.span, share, kSparseTilesShare);
}

}  // namespace flash_dmattn
