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

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "lora.h"

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

namespace {

using Product = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Handle = c10::TypedOperatorHandle<Product>;

std::shared_mutex registry_mutex;

// kiln/quant/ops.py ROW_CLASSES, handed over by the install calls: the largest row count of each kernel entry; more
// rows use the last entry (LARGE). Set once per process, before any binding; read under registry_mutex.
std::vector<int64_t> row_classes;

size_t entries() { return row_classes.size() + 1; }

size_t entry_of(int64_t rows) {
  for (size_t i = 0; i < row_classes.size(); ++i)
    if (rows <= row_classes[i]) return i;
  return row_classes.size();
}

void set_row_classes(const std::vector<int64_t>& tops) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex);
  TORCH_CHECK(row_classes.empty() || row_classes == tops, "kiln native dispatch: the row classes were set already, "
              "to others");
  TORCH_CHECK(!tops.empty() && std::is_sorted(tops.begin(), tops.end()), "kiln native dispatch: row classes must be "
              "ascending row counts");
  row_classes = tops;
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
  TORCH_CHECK(kernels.size() == entries() && forms.size() == entries(), "kiln native bind_packed: one kernel name "
              "and form per row class (", entries(), "), got ", kernels.size(), " and ", forms.size());
  Binding binding{codes.storage().getWeakStorageImpl(), {}, {}};
  for (size_t i = 0; i < entries(); ++i) {
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
void install_packed_dispatch(std::vector<int64_t> tops) {
  set_row_classes(tops);
  install_cpu_kernel<&packed_linear_cpu>("packed_linear");
}

// `kiln::packed_linear_lora(x, codes, scale, offset, slots)` (kiln/kernels/lora.py): a packed layer's product as
// `kiln::packed_linear` computes it, and the products of the LoRA adapters bound to the same codes (`bind_lora`: the
// layer's static A and B buffers, which loading an adapter copies into, never replaces) added in place for each
// token's slot (lora.cpp). One call from the graph with one more operand, the step's slots, where a product and a
// separate LoRA op with the buffers as operands measured ~1 ms more a batch-1 decode token (120 adapted products:
// the graph's Python wrapper passes every operand of every call).
struct LoRABinding {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // the codes'
  at::Tensor a, b;
  std::vector<int64_t> part_rows;
  int64_t max_loras, rank;
};

std::unordered_map<const void*, LoRABinding> lora_registry;  // under registry_mutex

// Whether any of a step's first `n` tokens has an adapter slot (a step of the base alone: the product only, with no
// registry lookup and no operand check: what a LoRA engine's steps without adapters cost over a plain one's).
bool any_adapted(const at::Tensor& slots, int64_t n) {
  if (!(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) >= n))
    return true;  // let lora_accumulate refuse it, naming what it expected
  const int64_t* slot = slots.data_ptr<int64_t>();
  return std::any_of(slot, slot + n, [](int64_t s) { return s != -1; });
}

at::Tensor packed_linear_lora_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                  const at::Tensor& offset, const at::Tensor& slots) {
  if (x.dim() == 2 && !any_adapted(slots, x.size(0))) return packed_linear_cpu(x, codes, scale, offset);
  std::optional<LoRABinding> lora;
  {
    std::shared_lock<std::shared_mutex> lock(registry_mutex);
    const auto found = lora_registry.find(codes.data_ptr());
    if (found != lora_registry.end() && same_storage(found->second, codes)) lora = found->second;
  }
  at::Tensor y = packed_linear_cpu(x, codes, scale, offset);
  // a weight with no buffers bound: the product alone. Only the compile cache's check of a loaded graph calls the op
  // so, on weights of its own making (the graph and the compiled code then agree); a layer's form takes this op only
  // for the codes it bound (kiln/kernels/lora.py)
  if (!lora) return y;
  const bool in_place = y.scalar_type() == at::kFloat && y.is_contiguous();
  at::Tensor sums = in_place ? y : y.to(at::kFloat).contiguous();
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);  // no dispatch where it is float
  KILN_TIER_NS::lora_accumulate(sums, xf, lora->a, lora->b, slots, lora->part_rows, lora->max_loras, lora->rank);
  return in_place ? sums : sums.to(y.scalar_type());
}

// Bind a layer's LoRA buffers to its packed codes, in place of any bound before.
void bind_lora(const at::Tensor& codes, const at::Tensor& a, const at::Tensor& b, std::vector<int64_t> part_rows,
               int64_t max_loras, int64_t rank) {
  store(lora_registry, codes.data_ptr(),
        LoRABinding{codes.storage().getWeakStorageImpl(), a, b, std::move(part_rows), max_loras, rank});
}

// Register the CPU kernel of kiln::packed_linear_lora (once per process; the op is defined in Python).
void install_lora_dispatch() { install_cpu_kernel<&packed_linear_lora_cpu>("packed_linear_lora"); }

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
  TORCH_CHECK(packed.size() == entries() && python.size() == entries(), "kiln native bind_dense: one entry per row "
              "class (", entries(), "), got ", packed.size(), " and ", python.size());
  DenseBinding binding{weight.storage().getWeakStorageImpl(), {}, {}};
  for (const std::optional<at::Tensor>& copy : packed) binding.packed.push_back(copy);
  for (const bool p : python) binding.python.push_back(p);
  store(dense_registry, weight.data_ptr(), std::move(binding));
}

// Register the CPU kernel of kiln::dense_linear (once per process, as install_packed_dispatch).
void install_dense_dispatch(std::vector<int64_t> tops) {
  set_row_classes(tops);
  install_cpu_kernel<&dense_linear_cpu>("dense_linear");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("bind_packed(Tensor codes, str[] kernels, Tensor?[] forms) -> ()", TORCH_FN(bind_packed));
  m.def("install_packed_dispatch(int[] row_classes) -> ()", TORCH_FN(install_packed_dispatch));
  m.def("bind_dense(Tensor weight, Tensor?[] packed, bool[] python) -> ()", TORCH_FN(bind_dense));
  m.def("install_dense_dispatch(int[] row_classes) -> ()", TORCH_FN(install_dense_dispatch));
  m.def("bind_lora(Tensor codes, Tensor a, Tensor b, int[] part_rows, int max_loras, int rank) -> ()",
        TORCH_FN(bind_lora));
  m.def("install_lora_dispatch() -> ()", TORCH_FN(install_lora_dispatch));
}
