// The compiled module flash_dmattn._C: the public C++ API over plain numbers. A tensor arrives as a
// pointer, a dtype name, a shape, strides in elements and a device, so the module includes no
// framework header and links no framework library; one build serves every torch version, numpy,
// and any other caller that can name its memory. python/flash_dmattn/ turns arrays into views.
//
// Errors keep the library's messages verbatim: invalid_argument becomes ValueError, unsupported
// NotImplementedError (a RuntimeError subclass), anything else RuntimeError. Every call that does
// work releases the GIL, so CPU threads and other Python threads run meanwhile.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flash_dmattn/flash_dmattn.h"

namespace nb = nanobind;
namespace fd = flash_dmattn;

namespace {

[[noreturn]] void fail(const std::string& message) {
  throw fd::Error(fd::Status::error(fd::StatusCode::invalid_argument, message));
}

fd::DType parse_dtype(const std::string& name) {
  for (fd::DType d : {fd::DType::float16, fd::DType::bfloat16, fd::DType::float32, fd::DType::float64,
                      fd::DType::boolean, fd::DType::int32, fd::DType::uint8}) {
    if (name == fd::dtype_name(d)) return d;
  }
  fail("flash_dmattn.View: argument 'dtype': expected one of float16, bfloat16, float32, float64, bool, int32, uint8, got '" +
       name + "'");
}

fd::Device parse_device(const std::string& type, int index) {
  if (index < 0) fail("flash_dmattn.View: argument 'device_index': expected >= 0, got " + std::to_string(index));
  if (type == "cpu") return {fd::DeviceType::cpu, 0};
  if (type == "cuda") return {fd::DeviceType::cuda, index};
  fail("flash_dmattn.View: argument 'device': expected 'cpu' or 'cuda', got '" + type + "'");
}

fd::Backend parse_backend(const std::string& name) {
  for (fd::Backend b : {fd::Backend::automatic, fd::Backend::cpu_reference, fd::Backend::cuda_sm80,
                        fd::Backend::cuda_sm90}) {
    if (name == fd::backend_name(b)) return b;
  }
  fail("flash_dmattn: argument 'backend': expected one of automatic, cpu_reference, cuda_sm80, cuda_sm90, got '" +
       name + "'");
}

fd::TensorView make_view(std::uintptr_t data, const std::string& dtype, const std::vector<std::int64_t>& shape,
                         const std::vector<std::int64_t>& strides, const std::string& device, int device_index) {
  if (shape.size() != strides.size() || shape.size() > static_cast<std::size_t>(fd::kMaxRank)) {
    fail("flash_dmattn.View: arguments 'shape' and 'strides': expected the same length, at most " +
         std::to_string(fd::kMaxRank) + ", got " + std::to_string(shape.size()) + " and " +
         std::to_string(strides.size()));
  }
  fd::TensorView view;
  view.data = reinterpret_cast<void*>(data);
  view.dtype = parse_dtype(dtype);
  view.rank = static_cast<int>(shape.size());
  view.device = parse_device(device, device_index);
  for (int d = 0; d < view.rank; ++d) {
    view.shape[d] = shape[d];
    view.stride[d] = strides[d];
  }
  return view;
}

nb::tuple as_tuple(const std::int64_t* values, int rank) {
  nb::tuple tuple = nb::steal<nb::tuple>(PyTuple_New(rank));
  for (int d = 0; d < rank; ++d) PyTuple_SET_ITEM(tuple.ptr(), d, PyLong_FromLongLong(values[d]));
  return tuple;
}

fd::AttentionOptions make_options(std::optional<double> softmax_scale, bool causal, double softcap,
                                  const std::string& backend, std::uintptr_t stream) {
  fd::AttentionOptions options;
  options.softmax_scale = softmax_scale;
  options.causal = causal;
  options.softcap = softcap;
  options.backend = parse_backend(backend);
  options.stream = reinterpret_cast<void*>(stream);
  return options;
}

std::optional<fd::TensorView> optional_view(const fd::TensorView* view) {
  return view ? std::optional<fd::TensorView>(*view) : std::nullopt;
}

fd::Workspace workspace(std::uintptr_t data, std::size_t bytes) { return {reinterpret_cast<void*>(data), bytes}; }

nb::dict capability_dict(const fd::Capability& c) {
  nb::dict d;
  d["backend"] = fd::backend_name(c.backend);
  d["arch"] = c.arch;
  d["description"] = c.description;
  return d;
}

// Tensors read from the torch front's tensors themselves. Building a View per tensor in Python
// (pointer, dtype name, shape, strides, device) took about 9 us of a decode call's host time for
// the seven of a forward; reading the same attributes here takes a fraction of that. The module
// still imports nothing of torch: it reads attributes every torch.Tensor has (dtype, shape,
// stride(), data_ptr(), is_cuda, get_device(), is_cpu), and the package tells it which dtype
// objects are which (register_dtypes).
struct TensorAttributes {
  // Interned once; the references are kept for the life of the process.
  PyObject* dtype = PyUnicode_InternFromString("dtype");
  PyObject* shape = PyUnicode_InternFromString("shape");
  PyObject* stride = PyUnicode_InternFromString("stride");
  PyObject* data_ptr = PyUnicode_InternFromString("data_ptr");
  PyObject* is_cuda = PyUnicode_InternFromString("is_cuda");
  PyObject* get_device = PyUnicode_InternFromString("get_device");
  PyObject* is_cpu = PyUnicode_InternFromString("is_cpu");
};

const TensorAttributes& tensor_attributes() {
  static const TensorAttributes names;  // (first made under the GIL, by the first read)
  return names;
}

// (dtype object, DType) pairs from register_dtypes; the objects are kept alive for the process.
std::vector<std::pair<PyObject*, fd::DType>>& registered_dtypes() {
  static std::vector<std::pair<PyObject*, fd::DType>> dtypes;
  return dtypes;
}

nb::object attribute(nb::handle t, PyObject* name) {
  PyObject* value = PyObject_GetAttr(t.ptr(), name);
  if (!value) throw nb::python_error();
  return nb::steal(value);
}

nb::object method_result(nb::handle t, PyObject* name) {
  PyObject* value = PyObject_CallMethodObjArgs(t.ptr(), name, nullptr);
  if (!value) throw nb::python_error();
  return nb::steal(value);
}

int read_sizes(nb::handle sizes, std::int64_t* out, const char* argument) {
  if (!PyTuple_Check(sizes.ptr()) || PyTuple_GET_SIZE(sizes.ptr()) > fd::kMaxRank) {
    fail(std::string("flash_dmattn: argument '") + argument + "': expected a tensor of at most " +
         std::to_string(fd::kMaxRank) + " dims");
  }
  const int rank = static_cast<int>(PyTuple_GET_SIZE(sizes.ptr()));
  for (int d = 0; d < rank; ++d) {
    out[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes.ptr(), d));
    if (out[d] == -1 && PyErr_Occurred()) throw nb::python_error();
  }
  return rank;
}

fd::TensorView read_tensor(nb::handle t, const char* argument) {
  const TensorAttributes& names = tensor_attributes();
  fd::TensorView view;
  const nb::object dtype = attribute(t, names.dtype);
  bool known = false;
  for (const auto& [object, type] : registered_dtypes()) {
    if (object == dtype.ptr()) {
      view.dtype = type;
      known = true;
      break;
    }
  }
  if (!known) {
    fail(std::string("flash_dmattn: argument '") + argument + "': expected dtype float16, bfloat16, float32, bool, "
         "int32 or uint8, got " + nb::repr(dtype).c_str());
  }
  view.rank = read_sizes(attribute(t, names.shape), view.shape, argument);
  if (read_sizes(method_result(t, names.stride), view.stride, argument) != view.rank) {
    fail(std::string("flash_dmattn: argument '") + argument + "': stride() and shape differ in length");
  }
  view.data = PyLong_AsVoidPtr(method_result(t, names.data_ptr).ptr());
  if (PyErr_Occurred()) throw nb::python_error();
  if (attribute(t, names.is_cuda).ptr() == Py_True) {
    const long index = PyLong_AsLong(method_result(t, names.get_device).ptr());
    if (index == -1 && PyErr_Occurred()) throw nb::python_error();
    view.device = {fd::DeviceType::cuda, static_cast<int>(index)};
  } else if (attribute(t, names.is_cpu).ptr() == Py_True) {
    view.device = {fd::DeviceType::cpu, 0};
  } else {
    fail(std::string("flash_dmattn: argument '") + argument + "': expected a CPU or CUDA tensor");
  }
  return view;
}

std::optional<fd::TensorView> read_optional_tensor(nb::handle t, const char* argument) {
  return t.is_none() ? std::nullopt : std::optional<fd::TensorView>(read_tensor(t, argument));
}

// Whether the CUDA kernels can load t's rows as 16-byte vectors (flash_dmattn::rows_aligned_16).
bool rows_aligned(nb::handle t) { return fd::rows_aligned_16(read_tensor(t, "tensor")); }

// Whether the rows the kernels load as 16-byte vectors are aligned for it: q, k, v and out, and
// the backward's dout. Read from the views the args already hold, so that the torch front checks
// its tensors without reading them a second time.
bool args_rows_aligned(const fd::ForwardArgs& a) {
  return fd::rows_aligned_16(a.q) && fd::rows_aligned_16(a.k) && fd::rows_aligned_16(a.v) &&
         fd::rows_aligned_16(a.out);
}
bool args_rows_aligned(const fd::BackwardArgs& a) {
  return fd::rows_aligned_16(a.q) && fd::rows_aligned_16(a.k) && fd::rows_aligned_16(a.v) &&
         fd::rows_aligned_16(a.out) && fd::rows_aligned_16(a.dout);
}

// The tensors ForwardArgs and BackwardArgs share, read into args.
template <typename Args>
void read_shared_tensors(Args& args, nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                         nb::handle mask, nb::handle indices, nb::handle bias) {
  args.q = read_tensor(q, "q");
  args.k = read_tensor(k, "k");
  args.v = read_tensor(v, "v");
  args.out = read_tensor(out, "out");
  args.lse = read_tensor(lse, "lse");
  args.mask = read_optional_tensor(mask, "mask");
  args.indices = read_optional_tensor(indices, "indices");
  args.bias = read_optional_tensor(bias, "bias");
}

// The offsets of packed sequences (torch tensors) on args: ForwardArgs or BackwardArgs.
template <typename Args>
void set_sequences(Args& args, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, std::int64_t max_seqlen_q,
                   std::int64_t max_seqlen_k) {
  args.sequences = fd::PackedSequences{read_tensor(cu_seqlens_q, "cu_seqlens_q"),
                                       read_tensor(cu_seqlens_k, "cu_seqlens_k"), max_seqlen_q, max_seqlen_k};
}

// A KV cache's lengths and optional block table (int32 torch tensors) on a forward's args.
void set_cache(fd::ForwardArgs& args, nb::handle seqlens_k, nb::handle block_table) {
  args.cache = fd::KeyValueCache{read_tensor(seqlens_k, "cache_seqlens"), read_optional_tensor(block_table, "block_table")};
}

void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const fd::Error& e) {
    PyObject* type = PyExc_RuntimeError;
    if (e.code() == fd::StatusCode::invalid_argument) type = PyExc_ValueError;
    if (e.code() == fd::StatusCode::unsupported) type = PyExc_NotImplementedError;
    PyErr_SetString(type, e.what());
  }
}

using Release = nb::call_guard<nb::gil_scoped_release>;

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "flash_dmattn's C++ API over pointers, shapes and strides (see flash_dmattn/core.py)";
  nb::register_exception_translator(translate_error);

#ifdef FLASH_DMATTN_PYTHON_WITH_CUDA
  m.attr("cuda_compiled") = true;
#else
  m.attr("cuda_compiled") = false;
#endif
  m.attr("workspace_alignment") = fd::kWorkspaceAlignment;

  nb::class_<fd::TensorView>(m, "View", "One tensor: pointer, dtype, shape, strides in elements, device")
      .def(
          "__init__",
          [](fd::TensorView* self, std::uintptr_t data, const std::string& dtype,
             const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& strides,
             const std::string& device, int device_index) {
            new (self) fd::TensorView(make_view(data, dtype, shape, strides, device, device_index));
          },
          nb::arg("data"), nb::arg("dtype"), nb::arg("shape"), nb::arg("strides"), nb::arg("device") = "cpu",
          nb::arg("device_index") = 0)
      .def_prop_ro("data", [](const fd::TensorView& v) { return reinterpret_cast<std::uintptr_t>(v.data); })
      .def_prop_ro("dtype", [](const fd::TensorView& v) { return std::string(fd::dtype_name(v.dtype)); })
      .def_prop_ro("shape", [](const fd::TensorView& v) { return as_tuple(v.shape, v.rank); })
      .def_prop_ro("strides", [](const fd::TensorView& v) { return as_tuple(v.stride, v.rank); })
      .def_prop_ro("device", [](const fd::TensorView& v) { return fd::device_name(v.device); })
      .def("__repr__", [](const fd::TensorView& v) {
        return "View(" + std::string(fd::dtype_name(v.dtype)) + ", shape=" + v.shape_string() +
               ", strides=" + v.stride_string() + ", " + fd::device_name(v.device) + ")";
      });

  // paths: bit 0 gather_forward, bit 1 gather_backward, bit 2 sm90a_forward_lists, bit 3
  // gather_backward_unpaired, bit 4 choice_pending (one int through the torch ops' schemas).
  nb::class_<fd::PreparedMask>(m, "PreparedMask",
                               "A mask prepared for the calls that share it (attention.h PreparedMask): its memory, "
                               "and the fingerprint and gather paths prepare_mask() sets")
      .def(
          "__init__",
          [](fd::PreparedMask* self, std::uintptr_t data, std::size_t bytes, std::uint64_t fingerprint, int paths) {
            auto* prepared = new (self) fd::PreparedMask();
            prepared->memory = workspace(data, bytes);
            prepared->fingerprint = fingerprint;
            prepared->gather_forward = (paths & 1) != 0;
            prepared->gather_backward = (paths & 2) != 0;
            prepared->sm90a_forward_lists = (paths & 4) != 0;
            prepared->gather_backward_unpaired = (paths & 8) != 0;
            prepared->choice_pending = (paths & 16) != 0;
          },
          nb::arg("data") = 0, nb::arg("bytes") = 0, nb::arg("fingerprint") = 0, nb::arg("paths") = 0)
      .def_prop_ro("fingerprint", [](const fd::PreparedMask& p) { return p.fingerprint; })
      .def_prop_ro("paths", [](const fd::PreparedMask& p) {
        return (p.gather_forward ? 1 : 0) | (p.gather_backward ? 2 : 0) | (p.sm90a_forward_lists ? 4 : 0) |
               (p.gather_backward_unpaired ? 8 : 0) | (p.choice_pending ? 16 : 0);
      });

  nb::class_<fd::ForwardArgs>(m, "ForwardArgs", "The arguments of one forward call (attention.h)")
      .def(
          "__init__",
          [](fd::ForwardArgs* self, const fd::TensorView& q, const fd::TensorView& k, const fd::TensorView& v,
             const fd::TensorView& out, const fd::TensorView& lse, const fd::TensorView* mask,
             const fd::TensorView* bias, std::optional<double> softmax_scale, bool causal, double softcap,
             const std::string& backend, std::uintptr_t stream, const fd::PreparedMask* prepared_mask) {
            auto* args = new (self) fd::ForwardArgs();
            args->prepared_mask = prepared_mask;
            args->q = q;
            args->k = k;
            args->v = v;
            args->out = out;
            args->lse = lse;
            args->mask = optional_view(mask);
            args->bias = optional_view(bias);
            args->options = make_options(softmax_scale, causal, softcap, backend, stream);
          },
          nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::kw_only(),
          nb::arg("mask").none() = nb::none(), nb::arg("bias").none() = nb::none(),
          nb::arg("softmax_scale").none() = nb::none(), nb::arg("causal") = false, nb::arg("softcap") = 0.0,
          nb::arg("backend") = "automatic", nb::arg("stream") = 0, nb::arg("prepared_mask").none() = nb::none(),
          nb::keep_alive<1, 14>())
      .def_prop_ro("rows_aligned", [](const fd::ForwardArgs& a) { return args_rows_aligned(a); },
                   "Whether q, k, v and out suit the CUDA kernels' 16-byte row loads");

  nb::class_<fd::BackwardArgs>(m, "BackwardArgs", "The arguments of one backward call (attention.h)")
      .def(
          "__init__",
          [](fd::BackwardArgs* self, const fd::TensorView& q, const fd::TensorView& k, const fd::TensorView& v,
             const fd::TensorView& out, const fd::TensorView& lse, const fd::TensorView& dout,
             const fd::TensorView& dq, const fd::TensorView& dk, const fd::TensorView& dv,
             const fd::TensorView* mask, const fd::TensorView* bias, const fd::TensorView* dbias,
             std::optional<double> softmax_scale, bool causal, double softcap, bool deterministic,
             const std::string& backend, std::uintptr_t stream, const fd::PreparedMask* prepared_mask) {
            auto* args = new (self) fd::BackwardArgs();
            args->prepared_mask = prepared_mask;
            args->q = q;
            args->k = k;
            args->v = v;
            args->out = out;
            args->lse = lse;
            args->dout = dout;
            args->dq = dq;
            args->dk = dk;
            args->dv = dv;
            args->mask = optional_view(mask);
            args->bias = optional_view(bias);
            args->dbias = optional_view(dbias);
            args->options = make_options(softmax_scale, causal, softcap, backend, stream);
            args->deterministic = deterministic;
          },
          nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("dout"), nb::arg("dq"),
          nb::arg("dk"), nb::arg("dv"), nb::kw_only(), nb::arg("mask").none() = nb::none(),
          nb::arg("bias").none() = nb::none(), nb::arg("dbias").none() = nb::none(),
          nb::arg("softmax_scale").none() = nb::none(), nb::arg("causal") = false, nb::arg("softcap") = 0.0,
          nb::arg("deterministic") = false, nb::arg("backend") = "automatic", nb::arg("stream") = 0,
          nb::arg("prepared_mask").none() = nb::none(), nb::keep_alive<1, 20>())
      .def_prop_ro("rows_aligned", [](const fd::BackwardArgs& a) { return args_rows_aligned(a); },
                   "Whether q, k, v, out and dout suit the CUDA kernels' 16-byte row loads");

  m.def(
      "register_dtypes",
      [](nb::dict mapping) {
        auto& dtypes = registered_dtypes();
        for (auto [object, name] : mapping) {
          const fd::DType dtype = parse_dtype(nb::cast<std::string>(name));
          dtypes.emplace_back(object.inc_ref().ptr(), dtype);
        }
      },
      nb::arg("mapping"),
      "Tells forward_args and backward_args which dtype objects their tensors' dtypes are: {dtype: name}");
  // The torch front's ForwardArgs and BackwardArgs, read from its tensors (see read_tensor); the
  // arguments are positional, in the order of the classes' constructors.
  m.def(
      "forward_args",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, nb::handle mask,
         nb::handle indices, nb::handle bias, std::optional<double> softmax_scale, bool causal, double softcap,
         std::uintptr_t stream, const fd::PreparedMask* prepared_mask) {
        fd::ForwardArgs args;
        read_shared_tensors(args, q, k, v, out, lse, mask, indices, bias);
        args.options = make_options(softmax_scale, causal, softcap, "automatic", stream);
        args.prepared_mask = prepared_mask;
        return args;
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("mask").none(),
      nb::arg("indices").none(), nb::arg("bias").none(), nb::arg("softmax_scale").none(), nb::arg("causal"),
      nb::arg("softcap"), nb::arg("stream"), nb::arg("prepared_mask").none(), nb::keep_alive<0, 13>(),
      "ForwardArgs of torch tensors (register_dtypes first)");
  m.def(
      "backward_args",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, nb::handle dout, nb::handle dq,
         nb::handle dk, nb::handle dv, nb::handle mask, nb::handle indices, nb::handle bias, nb::handle dbias,
         std::optional<double> softmax_scale, bool causal, double softcap, bool deterministic, std::uintptr_t stream,
         const fd::PreparedMask* prepared_mask) {
        fd::BackwardArgs args;
        read_shared_tensors(args, q, k, v, out, lse, mask, indices, bias);
        args.dout = read_tensor(dout, "dout");
        args.dq = read_tensor(dq, "dq");
        args.dk = read_tensor(dk, "dk");
        args.dv = read_tensor(dv, "dv");
        args.dbias = read_optional_tensor(dbias, "dbias");
        args.options = make_options(softmax_scale, causal, softcap, "automatic", stream);
        args.deterministic = deterministic;
        args.prepared_mask = prepared_mask;
        return args;
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("dout"), nb::arg("dq"),
      nb::arg("dk"), nb::arg("dv"), nb::arg("mask").none(), nb::arg("indices").none(), nb::arg("bias").none(),
      nb::arg("dbias").none(), nb::arg("softmax_scale").none(), nb::arg("causal"), nb::arg("softcap"),
      nb::arg("deterministic"), nb::arg("stream"), nb::arg("prepared_mask").none(), nb::keep_alive<0, 19>(),
      "BackwardArgs of torch tensors (register_dtypes first)");

  // Packed sequences (attention.h PackedSequences) on args that forward_args or backward_args made.
  m.def("set_sequences", &set_sequences<fd::ForwardArgs>, nb::arg("args"), nb::arg("cu_seqlens_q"),
        nb::arg("cu_seqlens_k"), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
        "Makes a forward's args packed sequences (torch tensors, register_dtypes first)");
  m.def("set_sequences", &set_sequences<fd::BackwardArgs>, nb::arg("args"), nb::arg("cu_seqlens_q"),
        nb::arg("cu_seqlens_k"), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), "The same for a backward's args");

  // A KV cache (attention.h KeyValueCache) on args that forward_args made: k and v are the cache.
  m.def("set_cache", &set_cache, nb::arg("args"), nb::arg("seqlens_k"), nb::arg("block_table").none(),
        "Makes a forward's k and v a KV cache (torch tensors, register_dtypes first)");

  m.def("rows_aligned", &rows_aligned, nb::arg("tensor"),
        "Whether a torch tensor's rows suit the CUDA kernels' 16-byte loads (register_dtypes first)");

  m.def(
      "forward_workspace_size",
      [](const fd::ForwardArgs& args) {
        std::size_t bytes = 0;
        fd::throw_if_error(fd::forward_workspace_size(args, &bytes));
        return bytes;
      },
      nb::arg("args"), Release(), "Bytes of scratch memory forward() needs for these arguments");
  m.def(
      "backward_workspace_size",
      [](const fd::BackwardArgs& args) {
        std::size_t bytes = 0;
        fd::throw_if_error(fd::backward_workspace_size(args, &bytes));
        return bytes;
      },
      nb::arg("args"), Release(), "Bytes of scratch memory backward() needs for these arguments");

  // what: the MaskPreparation by name.
  auto preparation = [](const std::string& what) {
    if (what == "full") return fd::MaskPreparation::full;
    if (what == "tile_summary") return fd::MaskPreparation::tile_summary;
    if (what == "deferred_choice") return fd::MaskPreparation::deferred_choice;
    if (what == "deferred_choice_with_lists") return fd::MaskPreparation::deferred_choice_with_lists;
    throw nb::value_error(("flash_dmattn: argument 'what': expected 'full', 'tile_summary', 'deferred_choice' or "
                           "'deferred_choice_with_lists', got '" + what + "'")
                              .c_str());
  };
  m.def(
      "prepared_mask_size",
      [preparation](const fd::ForwardArgs& args, const std::string& what) {
        std::size_t bytes = 0;
        fd::throw_if_error(fd::prepared_mask_size(args, &bytes, preparation(what)));
        return bytes;
      },
      nb::arg("args"), nb::arg("what") = "full", Release(),
      "Bytes of memory prepare_mask() needs for these (masked forward) arguments");
  m.def(
      "prepare_mask",
      [preparation](const fd::ForwardArgs& args, fd::PreparedMask& prepared, const std::string& what) {
        fd::throw_if_error(fd::prepare_mask(args, &prepared, preparation(what)));
      },
      nb::arg("args"), nb::arg("prepared"), nb::arg("what") = "full", Release(),
      "Builds args.mask's preparation into prepared's memory and sets its fingerprint and paths; asynchronous on "
      "the stream for CUDA tensors (attention.h prepare_mask); what: the MaskPreparation ('full', 'tile_summary': "
      "the summary alone, no lists, no wait; 'deferred_choice': summary and the lists that may pay, no wait, the "
      "paths chosen later by choose_mask_paths; 'deferred_choice_with_lists': every list)");
  m.def(
      "prepared_list_sizes",
      [](const fd::ForwardArgs& args, const fd::PreparedMask& prepared) {
        std::size_t offset = 0, bytes = 0;
        fd::throw_if_error(fd::prepared_list_sizes(args, prepared, &offset, &bytes));
        return std::make_pair(offset, bytes);
      },
      nb::arg("args"), nb::arg("prepared"),
      "(offset, bytes): where a deferred preparation's key-list sizes lie in its memory (attention.h "
      "prepared_list_sizes)");
  m.def(
      "choose_mask_paths",
      [](const fd::ForwardArgs& args, fd::PreparedMask& prepared, std::uintptr_t sizes, std::size_t bytes) {
        fd::throw_if_error(fd::choose_mask_paths(args, &prepared, reinterpret_cast<const void*>(sizes), bytes));
      },
      nb::arg("args"), nb::arg("prepared"), nb::arg("sizes"), nb::arg("bytes"),
      "Chooses a deferred preparation's paths from a host copy of its key-list sizes at address `sizes` (attention.h "
      "choose_mask_paths); sets prepared.paths");

  m.def(
      "forward",
      [](const fd::ForwardArgs& args, std::uintptr_t data, std::size_t bytes) {
        fd::ForwardArgs call = args;
        call.workspace = workspace(data, bytes);
        fd::throw_if_error(fd::forward(call));
      },
      nb::arg("args"), nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0, Release(),
      "Writes out and lse; asynchronous on the stream for CUDA tensors");
  m.def(
      "backward",
      [](const fd::BackwardArgs& args, std::uintptr_t data, std::size_t bytes) {
        fd::BackwardArgs call = args;
        call.workspace = workspace(data, bytes);
        fd::throw_if_error(fd::backward(call));
      },
      nb::arg("args"), nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0, Release(),
      "Writes dq, dk, dv and, when given, dbias; asynchronous on the stream for CUDA tensors");

  m.def(
      "query_forward",
      [](const fd::ForwardArgs& args) {
        fd::Capability capability;
        {
          nb::gil_scoped_release release;
          fd::throw_if_error(fd::query_forward(args, &capability));
        }
        return capability_dict(capability);
      },
      nb::arg("args"), "Which backend and architecture would run this forward: {backend, arch, description}");
  m.def(
      "query_backward",
      [](const fd::BackwardArgs& args) {
        fd::Capability capability;
        {
          nb::gil_scoped_release release;
          fd::throw_if_error(fd::query_backward(args, &capability));
        }
        return capability_dict(capability);
      },
      nb::arg("args"), "Which backend and architecture would run this backward: {backend, arch, description}");

  m.def(
      "available_backends",
      []() {
        std::vector<std::string> names;
        for (fd::Backend b : fd::available_backends()) names.emplace_back(fd::backend_name(b));
        return names;
      },
      "The backends compiled in that can run on this machine now, best first");
  m.def("version", []() { return std::string(fd::version()); });
}
