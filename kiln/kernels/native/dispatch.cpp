// `kiln::packed_linear` on CPU tensors without a hop through Python. The op's Python implementation
// (kiln/quant/ops.py) looks up the kernel bound to the weight for the call's row count and calls it: ~9 µs a call
// on a 2-core EPYC, about 1 ms of a batch-1 decode step's 121 products. Here the bindings whose kernel is a native
// op are kept in C++ (keyed by the codes' address, checked against their storage, which may have died), and the
// op's CPU kernel calls that op through the dispatcher; any other binding (a compiled candidate, BLAS, the
// reference) runs `kiln::packed_linear_bound`, the same Python implementation as before. A kernel over a form of
// the weight of its own (a bf16 copy for the matrix unit) is kept as its op and that form, called without Python.
//
// Every tier's object holds this code; kiln installs one tier's (`install_packed_dispatch`, once per process) and
// binds through that tier (`bind_packed`), so one registry serves the op.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/linear.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

namespace {

using Product = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Handle = c10::TypedOperatorHandle<Product>;

// kiln/quant/ops.py ROW_CLASSES: the largest row count of each kernel entry; more rows use the last entry (LARGE)
constexpr int64_t ROW_CLASSES[] = {1, 2, 16, 64, 256};
constexpr size_t ENTRIES = sizeof(ROW_CLASSES) / sizeof(ROW_CLASSES[0]) + 1;

size_t entry_of(int64_t rows) {
  for (size_t i = 0; i + 1 < ENTRIES; ++i)
    if (rows <= ROW_CLASSES[i]) return i;
  return ENTRIES - 1;
}

// A kernel over a form of the weight of its own (kiln/kernels/compute_forms.py): op(x, form, outputs).
using FormProduct = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
struct FormCall {
  c10::TypedOperatorHandle<FormProduct> op;
  at::Tensor form;
};

struct Binding {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // the codes' storage: a freed weight's address may be reused
  std::vector<std::optional<Handle>> kernels;         // by entry; none: a form's op, or the Python-bound kernel
  std::vector<std::optional<FormCall>> forms;         // by entry: the kernel runs over this form of the weight
};

std::shared_mutex registry_mutex;
std::unordered_map<const void*, Binding> registry;

// whether a binding (Binding, DenseBinding) was made for this tensor's storage, which is still alive
template <typename B>
bool same_storage(const B& b, const at::Tensor& tensor) {
  return !b.storage.expired() && b.storage._unsafe_get_target() == tensor.storage().unsafeGetStorageImpl();
}

// `binding` for the weight at `key`, in place of any before it; the bindings of weights that are gone dropped.
template <typename Entry>
void store(std::unordered_map<const void*, Entry>& bindings, const void* key, Entry binding) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex);
  for (auto it = bindings.begin(); it != bindings.end();)
    it = it->second.storage.expired() ? bindings.erase(it) : std::next(it);
  bindings.insert_or_assign(key, std::move(binding));
}

// `Kernel` as the CPU kernel of kiln::`name`, registered once per process (each kernel its own flag and library,
// which stays registered for the process's life).
template <auto* Kernel>
void install_cpu_kernel(const char* name) {
  static std::once_flag once;
  static std::unique_ptr<torch::Library> library;
  std::call_once(once, [name] {
    library = std::make_unique<torch::Library>(torch::Library::IMPL, "kiln", c10::DispatchKey::CPU, __FILE__,
                                               __LINE__);
    library->impl(name, TORCH_FN(Kernel));
  });
}

at::Tensor python_bound(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& offset) {
  static const Handle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kiln::packed_linear_bound", "").typed<Product>();
  return op.call(x, codes, scale, offset);
}

at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                             const at::Tensor& offset) {
  std::optional<Handle> kernel;
  std::optional<FormCall> form;
  {
    std::shared_lock<std::shared_mutex> lock(registry_mutex);
    const auto found = registry.find(codes.data_ptr());
    if (found != registry.end() && same_storage(found->second, codes) && x.dim() == 2) {
      kernel = found->second.kernels[entry_of(x.size(0))];
      form = found->second.forms[entry_of(x.size(0))];
    }
  }
  if (form && x.scalar_type() == at::kFloat) return form->op.call(x, form->form, codes.size(0));
  return kernel ? kernel->call(x, codes, scale, offset) : python_bound(x, codes, scale, offset);
}

// Bind the native op of each entry ("namespace::name", or "" where the kernel is not a native op) to these codes;
// where an entry has a form, its op takes (x, form, outputs) instead.
void bind_packed(const at::Tensor& codes, std::vector<std::string> kernels,
                 const c10::List<std::optional<at::Tensor>>& forms) {
  TORCH_CHECK(kernels.size() == ENTRIES && forms.size() == ENTRIES, "kiln native bind_packed: one kernel name and "
              "form per row class (", ENTRIES, "), got ", kernels.size(), " and ", forms.size());
  Binding binding{codes.storage().getWeakStorageImpl(), {}, {}};
  for (size_t i = 0; i < ENTRIES; ++i) {
    const std::string& name = kernels[i];
    const std::optional<at::Tensor> form = forms.get(i);
    binding.kernels.emplace_back(std::nullopt);
    binding.forms.emplace_back(std::nullopt);
    if (name.empty()) continue;
    const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
    if (form)
      binding.forms.back() = FormCall{op.typed<FormProduct>(), *form};
    else
      binding.kernels.back() = op.typed<Product>();
  }
  store(registry, codes.data_ptr(), std::move(binding));
}

// Register the CPU kernel of kiln::packed_linear (once: the Python side calls this for one tier per process).
void install_packed_dispatch() { install_cpu_kernel<&packed_linear_cpu>("packed_linear"); }

// `kiln::dense_linear` (kiln/kernels/dense.py) the same way: each weight's prepacked oneDNN copy by row class is
// kept here, and the op's CPU kernel calls `mkldnn::_linear_pointwise` on it (boxed: its C++ signature is
// torch's own business), and a row class bound to no kernel `at::linear`; a kernel of Python's own, or a weight
// not bound here, runs `kiln::dense_linear_bound`, the Python implementation (5 us a call more at one row).
struct DenseBinding {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // the weight's
  std::vector<std::optional<at::Tensor>> packed;       // by entry; none: at::linear
  std::vector<bool> python;                            // by entry: the Python-bound kernel instead
};

using DenseProduct = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);

std::unordered_map<const void*, DenseBinding> dense_registry;  // under registry_mutex

at::Tensor dense_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  std::optional<at::Tensor> packed;
  bool python = true;
  if (x.dim() >= 1 && x.size(-1) > 0) {
    std::shared_lock<std::shared_mutex> lock(registry_mutex);
    const auto found = dense_registry.find(weight.data_ptr());
    if (found != dense_registry.end() && same_storage(found->second, weight)) {
      const size_t entry = entry_of(x.numel() / x.size(-1));
      packed = found->second.packed[entry];
      python = found->second.python[entry];
    }
  }
  if (python) {
    static const auto bound =
        c10::Dispatcher::singleton().findSchemaOrThrow("kiln::dense_linear_bound", "").typed<DenseProduct>();
    return bound.call(x, weight, bias);
  }
  if (!packed) return at::linear(x, weight, bias);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(*packed);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<c10::Scalar>>());
  stack.emplace_back(std::string());
  op.callBoxed(stack);
  return stack[0].toTensor();
}

// Bind each entry's prepacked copy of `weight` (none: at::linear) or, where `python` says so, the Python-bound
// kernel.
void bind_dense(const at::Tensor& weight, const c10::List<std::optional<at::Tensor>>& packed,
                const c10::List<bool>& python) {
  TORCH_CHECK(packed.size() == ENTRIES && python.size() == ENTRIES, "kiln native bind_dense: one entry per row "
              "class (", ENTRIES, "), got ", packed.size(), " and ", python.size());
  DenseBinding binding{weight.storage().getWeakStorageImpl(), {}, {}};
  for (const std::optional<at::Tensor>& copy : packed) binding.packed.push_back(copy);
  for (const bool p : python) binding.python.push_back(p);
  store(dense_registry, weight.data_ptr(), std::move(binding));
}

// Register the CPU kernel of kiln::dense_linear (once per process, as install_packed_dispatch).
void install_dense_dispatch() { install_cpu_kernel<&dense_linear_cpu>("dense_linear"); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("bind_packed(Tensor codes, str[] kernels, Tensor?[] forms) -> ()", TORCH_FN(bind_packed));
  m.def("install_packed_dispatch() -> ()", TORCH_FN(install_packed_dispatch));
  m.def("bind_dense(Tensor weight, Tensor?[] packed, bool[] python) -> ()", TORCH_FN(bind_dense));
  m.def("install_dense_dispatch() -> ()", TORCH_FN(install_dense_dispatch));
}
