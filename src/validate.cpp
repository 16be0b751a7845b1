#include "validate.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace flash_dmattn {
namespace {

// Returns early from the enclosing function when a check fails.
#define FDMA_CHECK_OK(expr)              \
  do {                                   \
    Status status_ = (expr);             \
    if (!status_.ok()) return status_;   \
  } while (false)

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

// "flash_dmattn.forward: argument 'k': expected ..., got ..."
class Checker {
 public:
  explicit Checker(const char* call) : call_(call) {}

  template <typename... Parts>
  Status fail(const char* argument, const Parts&... parts) const {
    return Status::error(StatusCode::invalid_argument,
                         concat("flash_dmattn.", call_, ": argument '", argument, "': ", parts...));
  }

 private:
  const char* call_;
};

struct Named {
  const char* name;
  const TensorView* view;  // nullptr when the optional argument is absent
};

bool multiply_overflows(std::int64_t a, std::int64_t b, std::int64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}
bool add_overflows(std::int64_t a, std::int64_t b, std::int64_t* out) { return __builtin_add_overflow(a, b, out); }

// Structure of one view on its own: rank, non-negative sizes and strides, contiguous last dim,
// a pointer for non-empty views, and byte offsets that fit in int64.
Status check_view(const Checker& c, const Named& t, int rank, const char* layout) {
  const TensorView& v = *t.view;
  if (v.rank != rank) {
    return c.fail(t.name, "expected rank ", rank, " ", layout, ", got rank ", v.rank, " with shape ",
                  v.shape_string());
  }
  for (int d = 0; d < rank; ++d) {
    if (v.shape[d] < 0) return c.fail(t.name, "expected non-negative sizes, got shape ", v.shape_string());
    if (v.stride[d] < 0) return c.fail(t.name, "expected non-negative strides, got strides ", v.stride_string());
  }
  if (v.shape[rank - 1] > 1 && v.stride[rank - 1] != 1) {
    return c.fail(t.name, "expected a contiguous last dimension (stride 1), got strides ", v.stride_string(),
                  " for shape ", v.shape_string());
  }
  std::int64_t numel = 1;
  for (int d = 0; d < rank; ++d) {
    if (multiply_overflows(numel, v.shape[d], &numel)) {
      return c.fail(t.name, "expected an element count that fits in int64, got shape ", v.shape_string());
    }
  }
  if (numel == 0) return Status::success();
  if (v.data == nullptr) return c.fail(t.name, "expected a non-null pointer for shape ", v.shape_string(), ", got null");
  std::int64_t last = 0;
  for (int d = 0; d < rank; ++d) {
    std::int64_t term = 0;
    if (multiply_overflows(v.shape[d] - 1, v.stride[d], &term) || add_overflows(last, term, &last)) {
      return c.fail(t.name, "expected element offsets that fit in int64, got shape ", v.shape_string(),
                    " with strides ", v.stride_string());
    }
  }
  std::int64_t bytes = 0;
  if (add_overflows(last, 1, &bytes) ||
      multiply_overflows(bytes, static_cast<std::int64_t>(dtype_size(v.dtype)), &bytes)) {
    return c.fail(t.name, "expected byte offsets that fit in int64, got shape ", v.shape_string(), " with strides ",
                  v.stride_string());
  }
  return Status::success();
}

Status check_dtype(const Checker& c, const Named& t, DType expected, const char* why) {
  if (t.view->dtype != expected) {
    return c.fail(t.name, "expected dtype ", dtype_name(expected), " (", why, "), got ", dtype_name(t.view->dtype));
  }
  return Status::success();
}

Status check_shape(const Checker& c, const Named& t, const std::vector<std::int64_t>& expected, const char* layout) {
  int d = 0;
  for (std::int64_t e : expected) {
    if (t.view->shape[d] != e) {
      std::ostringstream want;
      want << '(';
      int i = 0;
      for (std::int64_t x : expected) want << (i++ ? ", " : "") << x;
      want << ')';
      return c.fail(t.name, "expected shape ", want.str(), " ", layout, ", got ", t.view->shape_string());
    }
    ++d;
  }
  return Status::success();
}

// A mask or bias: each dimension is 1 or full; heads are 1, Hk or H. Key lists (indices) check
// their first three dimensions so (`dims` 3): the last one is the list.
Status check_broadcast_operand(const Checker& c, const Named& t, const Problem& p, int dims = 4) {
  const TensorView& v = *t.view;
  const char* dim_names[4] = {"batch", "heads", "query", "key"};
  const std::int64_t full[4] = {p.batch, p.heads, p.seqlen_q, p.seqlen_k};
  for (int d = 0; d < dims; ++d) {
    if (d == 1) {
      if (v.shape[1] != 1 && v.shape[1] != p.kv_heads && v.shape[1] != p.heads) {
        return c.fail(t.name, "expected heads (dim 1) in {1, Hk=", p.kv_heads, ", H=", p.heads, "}, got ",
                      v.shape[1], " in shape ", v.shape_string());
      }
      continue;
    }
    if (v.shape[d] != 1 && v.shape[d] != full[d]) {
      return c.fail(t.name, "expected ", dim_names[d], " size (dim ", d, ") 1 or ", full[d], ", got ", v.shape[d],
                    " in shape ", v.shape_string());
    }
  }
  return Status::success();
}

Status check_same_device(const Checker& c, const std::vector<Named>& views) {
  const Device device = views.front().view->device;
  for (const Named& t : views) {
    if (t.view && t.view->device != device) {
      return c.fail(t.name, "expected device ", device_name(device), " (the device of '", views.front().name,
                    "'), got ", device_name(t.view->device));
    }
  }
  return Status::success();
}

Status resolve_options(const Checker& c, const AttentionOptions& o, Problem* p) {
  if (o.softmax_scale) {
    const double s = *o.softmax_scale;
    if (!std::isfinite(s) || s <= 0.0) return c.fail("softmax_scale", "expected a finite value > 0, got ", s);
    p->scale = s;
  } else {
    p->scale = 1.0 / std::sqrt(static_cast<double>(p->head_dim));
  }
  if (!std::isfinite(o.softcap) || o.softcap < 0.0) {
    return c.fail("softcap", "expected a finite value >= 0 (0 disables it), got ", o.softcap);
  }
  p->causal = o.causal;
  p->softcap = o.softcap;
  return Status::success();
}

// [first, last) bytes a view can touch.
std::pair<std::uintptr_t, std::uintptr_t> byte_range(const TensorView& v) {
  std::int64_t last = 0;
  for (int d = 0; d < v.rank; ++d) last += (v.shape[d] - 1) * v.stride[d];
  const auto first = reinterpret_cast<std::uintptr_t>(v.data);
  return {first, first + static_cast<std::uintptr_t>(last + 1) * dtype_size(v.dtype)};
}

// An output whose elements alias each other (a zero stride on a dimension of size > 1, say) would
// be written by several threads at once. Sufficient test: ordered by stride, each stride steps
// past everything the smaller dimensions span.
bool has_internal_overlap(const TensorView& v) {
  std::vector<int> dims;
  for (int d = 0; d < v.rank; ++d)
    if (v.shape[d] > 1) dims.push_back(d);
  std::sort(dims.begin(), dims.end(), [&](int a, int b) { return v.stride[a] < v.stride[b]; });
  std::int64_t span = 1;  // elements covered by the dimensions visited so far
  for (int d : dims) {
    if (v.stride[d] < span) return true;
    span = v.stride[d] * (v.shape[d] - 1) + span;
  }
  return false;
}

// Outputs must not alias each other or any input. Compares byte ranges, which is conservative:
// outputs interleaved in one buffer (a packed dqkv) are reported as overlapping.
Status check_no_overlap(const Checker& c, const std::vector<Named>& inputs, const std::vector<Named>& outputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Named& o = outputs[i];
    if (!o.view || o.view->numel() == 0) continue;
    if (has_internal_overlap(*o.view)) {
      return c.fail(o.name, "expected an output whose elements do not alias each other, got shape ",
                    o.view->shape_string(), " with strides ", o.view->stride_string());
    }
    const auto [lo, hi] = byte_range(*o.view);
    auto overlaps = [&](const Named& other) {
      if (!other.view || other.view->numel() == 0) return false;
      const auto [olo, ohi] = byte_range(*other.view);
      return lo < ohi && olo < hi;
    };
    for (const Named& in : inputs) {
      if (overlaps(in)) return c.fail(o.name, "expected memory disjoint from input '", in.name, "', got overlapping memory");
    }
    for (size_t j = 0; j < i; ++j) {
      if (overlaps(outputs[j])) {
        return c.fail(o.name, "expected memory disjoint from output '", outputs[j].name, "', got overlapping memory");
      }
    }
  }
  return Status::success();
}

bool all_rows_aligned_16(std::initializer_list<const TensorView*> views) {
  for (const TensorView* v : views) {
    if (!rows_aligned_16(*v)) return false;
  }
  return true;
}

const char* kMaskLayout = "(B|1, H|Hk|1, Sq|1, Sk|1)";
const char* kPackedMaskLayout = "(B|1, H|Hk|1, Sq|1, ceil(Sk/8)) uint8";
const char* kIndicesLayout = "(B|1, H|Hk|1, Sq|1, K)";

// The layouts of q (out, dout, dq), of k (v, dk, dv) and of lse: batched or packed (attention.h).
struct Layouts {
  int rows_rank, lse_rank;
  const char *q, *k, *lse;
  explicit Layouts(bool packed)
      : rows_rank(packed ? 3 : 4), lse_rank(packed ? 2 : 3), q(packed ? "(total_q, H, D)" : "(B, Sq, H, D)"),
        k(packed ? "(total_k, Hk, D)" : "(B, Sk, Hk, D)"), lse(packed ? "(H, total_q)" : "(B, H, Sq)") {}
};

std::vector<std::int64_t> q_shape(const Problem& p) {
  if (p.packed) return {p.total_q, p.heads, p.head_dim};
  return {p.batch, p.seqlen_q, p.heads, p.head_dim};
}
std::vector<std::int64_t> k_shape(const Problem& p) {
  if (p.packed) return {p.total_k, p.kv_heads, p.head_dim};
  if (p.page_size > 0) return {p.num_pages, p.page_size, p.kv_heads, p.head_dim};
  return {p.batch, p.seqlen_k, p.kv_heads, p.head_dim};
}
std::vector<std::int64_t> lse_shape(const Problem& p) {
  if (p.packed) return {p.heads, p.total_q};
  return {p.batch, p.heads, p.seqlen_q};
}

// The offsets' structure (their values are read by check_offset_values, on the CPU).
Status check_offsets(const Checker& c, const PackedSequences& s, Problem* p) {
  const Named nq{"cu_seqlens_q", &s.cu_seqlens_q}, nk{"cu_seqlens_k", &s.cu_seqlens_k};
  for (const Named& t : {nq, nk}) {
    FDMA_CHECK_OK(check_view(c, t, 1, "(B + 1,)"));
    FDMA_CHECK_OK(check_dtype(c, t, DType::int32, "offsets of the packed sequences"));
  }
  if (s.cu_seqlens_q.shape[0] < 1) {
    return c.fail("cu_seqlens_q", "expected B + 1 >= 1 offsets (0, len_0, len_0 + len_1, ...), got shape ",
                  s.cu_seqlens_q.shape_string());
  }
  FDMA_CHECK_OK(check_shape(c, nk, {s.cu_seqlens_q.shape[0]}, "(the shape of cu_seqlens_q)"));
  // The offsets are int32: no sequence is longer than 2^31 - 1.
  constexpr std::int64_t kLongest = 2147483647;
  if (s.max_seqlen_q < 0 || s.max_seqlen_q > kLongest) {
    return c.fail("max_seqlen_q", "expected a length in [0, 2^31 - 1], got ", s.max_seqlen_q);
  }
  if (s.max_seqlen_k < 0 || s.max_seqlen_k > kLongest) {
    return c.fail("max_seqlen_k", "expected a length in [0, 2^31 - 1], got ", s.max_seqlen_k);
  }
  p->packed = true;
  p->batch = s.cu_seqlens_q.shape[0] - 1;
  p->seqlen_q = s.max_seqlen_q;
  p->seqlen_k = s.max_seqlen_k;
  return Status::success();
}

// Offsets on the CPU, read before any work: rising from 0 to the packed length, no sequence
// longer than its maximum.
Status check_offset_values(const Checker& c, const PackedSequences& s, const Problem& p) {
  if (p.device.type != DeviceType::cpu) return Status::success();  // not readable without waiting
  struct Offsets {
    const char* name;
    const TensorView* view;
    std::int64_t total, max_length;
    const char* total_name;
    const char* max_name;
  };
  for (const Offsets& o : {Offsets{"cu_seqlens_q", &s.cu_seqlens_q, p.total_q, p.seqlen_q, "total_q", "max_seqlen_q"},
                           Offsets{"cu_seqlens_k", &s.cu_seqlens_k, p.total_k, p.seqlen_k, "total_k", "max_seqlen_k"}}) {
    const auto* values = static_cast<const std::int32_t*>(o.view->data);
    const std::int64_t stride = o.view->stride[0];
    if (values[0] != 0) return c.fail(o.name, "expected offsets that start at 0, got ", o.name, "[0] = ", values[0]);
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const std::int64_t length = static_cast<std::int64_t>(values[(b + 1) * stride]) - values[b * stride];
      if (length < 0 || length > o.max_length) {
        return c.fail(o.name, "expected sequence lengths in [0, ", o.max_name, "=", o.max_length, "], got ", o.name,
                      "[", b + 1, "] - ", o.name, "[", b, "] = ", length);
      }
    }
    if (values[p.batch * stride] != o.total) {
      return c.fail(o.name, "expected offsets that end at ", o.total_name, "=", o.total, " (the packed rows), got ",
                    o.name, "[", p.batch, "] = ", values[p.batch * stride]);
    }
  }
  return Status::success();
}

// A KV cache's structure (its values are read by check_cache_values, on the CPU). k: the cache.
Status check_cache(const Checker& c, const KeyValueCache& cache, const TensorView& k, Problem* p) {
  const Named ns{"seqlens_k", &cache.seqlens_k};
  FDMA_CHECK_OK(check_view(c, ns, 1, "(B,)"));
  FDMA_CHECK_OK(check_dtype(c, ns, DType::int32, "the cached keys of each sequence"));
  FDMA_CHECK_OK(check_shape(c, ns, {p->batch}, "(B,)"));
  p->cached = true;
  if (!cache.block_table) return Status::success();
  const TensorView& table = *cache.block_table;
  const Named nt{"block_table", &table};
  FDMA_CHECK_OK(check_view(c, nt, 2, "(B, max_pages)"));
  FDMA_CHECK_OK(check_dtype(c, nt, DType::int32, "page indices"));
  if (table.shape[0] != p->batch) {
    return c.fail("block_table", "expected shape (B=", p->batch, ", max_pages), got ", table.shape_string());
  }
  p->num_pages = k.shape[0];
  p->page_size = k.shape[1];
  if (p->page_size < 1) {
    return c.fail("k", "expected pages of at least one key (dim 1) with a block table, got shape ", k.shape_string());
  }
  if (multiply_overflows(table.shape[1], p->page_size, &p->seqlen_k)) {
    return c.fail("block_table", "expected max_pages x page_size keys that fit in int64, got ", table.shape[1], " x ",
                  p->page_size);
  }
  return Status::success();
}

// A KV cache's lengths and the pages they read, on the CPU, before any work.
Status check_cache_values(const Checker& c, const KeyValueCache& cache, const Problem& p) {
  if (p.device.type != DeviceType::cpu) return Status::success();  // not readable without waiting
  const TensorView& lengths = cache.seqlens_k;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t length = static_cast<const std::int32_t*>(lengths.data)[b * lengths.stride[0]];
    if (length < 0 || length > p.seqlen_k) {
      return c.fail("seqlens_k", "expected lengths in [0, K=", p.seqlen_k, "] (the cache's logical keys), got ",
                    length, " for sequence ", b);
    }
    if (!cache.block_table) continue;
    const TensorView& table = *cache.block_table;
    for (std::int64_t page = 0; page * p.page_size < length; ++page) {
      const std::int64_t index = static_cast<const std::int32_t*>(table.data)[b * table.stride[0] + page * table.stride[1]];
      if (index < 0 || index >= p.num_pages) {
        return c.fail("block_table", "expected page indices in [0, num_pages=", p.num_pages,
                      ") where a sequence reads them, got ", index, " at (", b, ", ", page, ")");
      }
    }
  }
  return Status::success();
}

// Checks shared by forward and backward: q, k, v, mask, bias and the options; fills the problem.
Status check_operands(const Checker& c, const TensorView& q, const TensorView& k, const TensorView& v,
                      const std::optional<PackedSequences>& sequences, const KeyValueCache* cache,
                      const std::optional<TensorView>& mask, const std::optional<TensorView>& indices,
                      const std::optional<TensorView>& bias, const AttentionOptions& options, Problem* p) {
  if (sequences && cache) return c.fail("cache", "expected no KV cache with packed sequences, got both");
  const Layouts layouts(sequences.has_value());
  const Named nq{"q", &q}, nk{"k", &k}, nv{"v", &v};
  FDMA_CHECK_OK(check_view(c, nq, layouts.rows_rank, layouts.q));
  FDMA_CHECK_OK(check_view(c, nk, layouts.rows_rank, layouts.k));
  FDMA_CHECK_OK(check_view(c, nv, layouts.rows_rank, layouts.k));
  if (q.dtype != DType::float16 && q.dtype != DType::bfloat16) {
    return c.fail("q", "expected dtype float16 or bfloat16, got ", dtype_name(q.dtype));
  }
  FDMA_CHECK_OK(check_dtype(c, nk, q.dtype, "the dtype of q"));
  FDMA_CHECK_OK(check_dtype(c, nv, q.dtype, "the dtype of q"));

  // Batched: (B, S, heads, D); packed: (total, heads, D), B and the lengths from the offsets.
  const int row_dims = layouts.rows_rank - 3;  // 1 batched, 0 packed: q's dims are (.., rows, heads, D)
  if (sequences) {
    FDMA_CHECK_OK(check_offsets(c, *sequences, p));
    p->total_q = q.shape[0];
    p->total_k = k.shape[0];
  } else {
    p->batch = q.shape[0];
    p->seqlen_q = q.shape[1];
    p->seqlen_k = k.shape[1];
  }
  p->heads = q.shape[row_dims + 1];
  p->head_dim = q.shape[row_dims + 2];
  p->kv_heads = k.shape[row_dims + 1];
  p->dtype = q.dtype;
  p->device = q.device;

  const int heads_dim = row_dims + 1;  // the index of the heads dim in q and k
  if (p->heads < 1) return c.fail("q", "expected at least one head (dim ", heads_dim, "), got shape ", q.shape_string());
  if (p->head_dim < kHeadDimMultiple || p->head_dim > kMaxHeadDim || p->head_dim % kHeadDimMultiple != 0) {
    return c.fail("q", "expected head dim (dim ", heads_dim + 1, ") a multiple of ", kHeadDimMultiple, " in [",
                  kHeadDimMultiple, ", ", kMaxHeadDim, "], got ", p->head_dim, " (pad the head dim; the Python front does)");
  }
  if (cache) FDMA_CHECK_OK(check_cache(c, *cache, k, p));
  const bool paged = p->page_size > 0;
  if ((!sequences && !paged && k.shape[0] != p->batch) || k.shape[row_dims + 2] != p->head_dim) {
    const std::string expected = sequences ? concat("(total_k, Hk, D=", p->head_dim, ") ", layouts.k)
                                 : paged   ? concat("(num_pages, page_size, Hk, D=", p->head_dim, ") (a paged cache)")
                                           : concat("(B=", p->batch, ", Sk, Hk, D=", p->head_dim, ") ", layouts.k);
    return c.fail("k", "expected shape ", expected, ", got ", k.shape_string());
  }
  if (p->kv_heads < 1) return c.fail("k", "expected at least one head (dim ", heads_dim, "), got shape ", k.shape_string());
  if (p->heads % p->kv_heads != 0) {
    return c.fail("k", "expected a head count (dim ", heads_dim, ") that divides q's H=", p->heads, ", got Hk=", p->kv_heads);
  }
  FDMA_CHECK_OK(check_shape(c, nv, k_shape(*p), "(the shape of k)"));

  if (mask) {
    const Named nm{"mask", &*mask};
    p->mask_packed = mask->dtype == DType::uint8;
    FDMA_CHECK_OK(check_view(c, nm, 4, p->mask_packed ? kPackedMaskLayout : kMaskLayout));
    if (!p->mask_packed) FDMA_CHECK_OK(check_dtype(c, nm, DType::boolean, "True keeps a key; uint8: bit-packed"));
    FDMA_CHECK_OK(check_broadcast_operand(c, nm, *p, p->mask_packed ? 3 : 4));
    const std::int64_t packed_keys = p->seqlen_k / 8 + (p->seqlen_k % 8 != 0);  // ceil, without overflow
    if (p->mask_packed && mask->shape[3] != packed_keys) {
      return c.fail("mask", "expected ceil(Sk/8)=", packed_keys, " bytes of key bits (dim 3) in a bit-packed mask ",
                    kPackedMaskLayout, ", got ", mask->shape[3], " in shape ", mask->shape_string());
    }
    p->has_mask = true;
  }
  if (indices) {
    const Named ni{"indices", &*indices};
    if (sequences) {
      return c.fail("indices", "expected no key indices with packed sequences (not supported yet), got shape ",
                    indices->shape_string());
    }
    FDMA_CHECK_OK(check_view(c, ni, 4, kIndicesLayout));
    FDMA_CHECK_OK(check_dtype(c, ni, DType::int32, "key indices, -1 pads"));
    FDMA_CHECK_OK(check_broadcast_operand(c, ni, *p, 3));
    p->has_indices = true;
    p->indices_rows = indices->shape[2];
    p->indices_entries = indices->shape[3];
  }
  if (bias) {
    const Named nb{"bias", &*bias};
    FDMA_CHECK_OK(check_view(c, nb, 4, kMaskLayout));
    if (bias->dtype != q.dtype && bias->dtype != DType::float32) {
      return c.fail("bias", "expected dtype ", dtype_name(q.dtype), " (the dtype of q) or float32, got ",
                    dtype_name(bias->dtype));
    }
    FDMA_CHECK_OK(check_broadcast_operand(c, nb, *p));
    p->has_bias = true;
  }
  return resolve_options(c, options, p);
}

void add_offsets(const std::optional<PackedSequences>& sequences, std::vector<Named>* inputs) {
  if (!sequences) return;
  inputs->push_back({"cu_seqlens_q", &sequences->cu_seqlens_q});
  inputs->push_back({"cu_seqlens_k", &sequences->cu_seqlens_k});
}

}  // namespace

Status validate_forward(const ForwardArgs& a, Problem* p) {
  const Checker c("forward");
  *p = Problem{};
  FDMA_CHECK_OK(check_operands(c, a.q, a.k, a.v, a.sequences, a.cache ? &*a.cache : nullptr, a.mask, a.indices,
                               a.bias, a.options, p));
  const Layouts layouts(p->packed);
  const Named out{"out", &a.out}, lse{"lse", &a.lse};
  FDMA_CHECK_OK(check_view(c, out, layouts.rows_rank, layouts.q));
  FDMA_CHECK_OK(check_dtype(c, out, p->dtype, "the dtype of q"));
  FDMA_CHECK_OK(check_shape(c, out, q_shape(*p), "(the shape of q)"));
  FDMA_CHECK_OK(check_view(c, lse, layouts.lse_rank, layouts.lse));
  FDMA_CHECK_OK(check_dtype(c, lse, DType::float32, "the log-sum-exp is fp32"));
  FDMA_CHECK_OK(check_shape(c, lse, lse_shape(*p), layouts.lse));

  const Named mask{"mask", a.mask ? &*a.mask : nullptr}, bias{"bias", a.bias ? &*a.bias : nullptr};
  const Named indices{"indices", a.indices ? &*a.indices : nullptr};
  std::vector<Named> inputs = {{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, mask, indices, bias};
  add_offsets(a.sequences, &inputs);
  if (a.cache) {
    inputs.push_back({"seqlens_k", &a.cache->seqlens_k});
    if (a.cache->block_table) inputs.push_back({"block_table", &*a.cache->block_table});
  }
  const std::vector<Named> outputs = {out, lse};
  p->rows_aligned_16 = all_rows_aligned_16({&a.q, &a.k, &a.v, &a.out});
  std::vector<Named> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  FDMA_CHECK_OK(check_same_device(c, all));
  FDMA_CHECK_OK(check_no_overlap(c, inputs, outputs));
  if (a.cache) return check_cache_values(c, *a.cache, *p);
  return a.sequences ? check_offset_values(c, *a.sequences, *p) : Status::success();
}

Status validate_backward(const BackwardArgs& a, Problem* p) {
  const Checker c("backward");
  *p = Problem{};
  FDMA_CHECK_OK(check_operands(c, a.q, a.k, a.v, a.sequences, nullptr, a.mask, a.indices, a.bias, a.options, p));
  p->deterministic = a.deterministic;
  const Layouts layouts(p->packed);
  const Named out{"out", &a.out}, lse{"lse", &a.lse}, dout{"dout", &a.dout};
  const Named dq{"dq", &a.dq}, dk{"dk", &a.dk}, dv{"dv", &a.dv};
  for (const Named& t : {out, dout, dq}) {
    FDMA_CHECK_OK(check_view(c, t, layouts.rows_rank, layouts.q));
    FDMA_CHECK_OK(check_dtype(c, t, p->dtype, "the dtype of q"));
    FDMA_CHECK_OK(check_shape(c, t, q_shape(*p), "(the shape of q)"));
  }
  for (const Named& t : {dk, dv}) {
    FDMA_CHECK_OK(check_view(c, t, layouts.rows_rank, layouts.k));
    FDMA_CHECK_OK(check_dtype(c, t, p->dtype, "the dtype of q"));
    FDMA_CHECK_OK(check_shape(c, t, k_shape(*p), "(the shape of k)"));
  }
  FDMA_CHECK_OK(check_view(c, lse, layouts.lse_rank, layouts.lse));
  FDMA_CHECK_OK(check_dtype(c, lse, DType::float32, "the log-sum-exp is fp32"));
  FDMA_CHECK_OK(check_shape(c, lse, lse_shape(*p), layouts.lse));

  const Named dbias{"dbias", a.dbias ? &*a.dbias : nullptr};
  if (a.dbias) {
    if (!a.bias) return c.fail("dbias", "expected no dbias when no bias is given, got shape ", a.dbias->shape_string());
    FDMA_CHECK_OK(check_view(c, dbias, 4, "(the shape of bias)"));
    FDMA_CHECK_OK(check_dtype(c, dbias, a.bias->dtype, "the dtype of bias"));
    const TensorView& b = *a.bias;
    FDMA_CHECK_OK(check_shape(c, dbias, {b.shape[0], b.shape[1], b.shape[2], b.shape[3]}, "(the shape of bias)"));
    p->has_dbias = true;
  }

  const Named mask{"mask", a.mask ? &*a.mask : nullptr}, bias{"bias", a.bias ? &*a.bias : nullptr};
  const Named indices{"indices", a.indices ? &*a.indices : nullptr};
  std::vector<Named> inputs = {{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, mask, indices, bias, out, lse, dout};
  add_offsets(a.sequences, &inputs);
  const std::vector<Named> outputs = {dq, dk, dv, dbias};
  p->rows_aligned_16 = all_rows_aligned_16({&a.q, &a.k, &a.v, &a.out, &a.dout, &a.dq, &a.dk, &a.dv});
  std::vector<Named> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  FDMA_CHECK_OK(check_same_device(c, all));
  FDMA_CHECK_OK(check_no_overlap(c, inputs, outputs));
  return a.sequences ? check_offset_values(c, *a.sequences, *p) : Status::success();
}

}  // namespace flash_dmattn
