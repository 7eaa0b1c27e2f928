// The ops' CUDA dispatch kernel: replays a recorded call's launches without running Python.
//
// Every kvops op is registered here (``install``) as one boxed kernel. A call computes its
// signature (each tensor's dispatch keys, dtype, device, sizes, strides, requires_grad and
// address modulo 16; every other argument's value; the current device, stream and thread).
// A signature with a recipe replays it: the outputs are allocated with ``at::empty_strided``
// and the recorded compiled kernels are launched with ``cuLaunchKernelEx``, their parameters
// packed as triton's launcher packs them (each parameter's bytes at its own address, the two
// scratch pointers last, null). Any other call goes to the Python ``miss`` function with the
// op's name, the signature (bytes, or None where the call must not be recorded) and the
// arguments; it runs the op's Python implementation and returns ``(result, recipe or None)``.
// kvops/ops/_replay.py builds recipes and says when a call is not replayed.
//
// The same file builds against a CPU-only torch (it needs no CUDA library: the driver is
// opened at run time, the current stream read through c10's device guard): there is then no
// current stream and no capture, and launches can only be taken in dry mode, which records
// each launch's configuration and parameter bytes instead of launching (the CPU tests read
// them).

#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <cuda.h>   // types only (triton's copy of the header); the driver is opened with dlopen
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace py = pybind11;

namespace {

// A launch parameter: where its 8 bytes come from.
enum Kind : int64_t {
  ARG = 0,   // the address of argument `index` (a tensor) plus `value` bytes
  OUT = 1,   // the address of output `index` plus `value` bytes
  ABS = 2,   // the address `value` (kept scratch)
  VAL = 3,   // the bits `value` (an integer, or a float's storage bits), little-endian
  DESC = 4,  // the tensor map of the launch's descriptor `index` (passed by value, 128 bytes)
};

struct Param {
  int64_t kind, index, value;
};

constexpr uint64_t NO_ADDRESS = ~0ull;   // an Encoded whose map is not valid

struct alignas(64) Encoded {   // cuTensorMapEncodeTiled writes to 64-byte aligned memory
  CUtensorMap map;
  uint64_t address = NO_ADDRESS;
};

// A tensor descriptor (TMA) parameter: the tensor it describes (`source` ARG or OUT, `index`,
// `offset` bytes) and cuTensorMapEncodeTiled's other arguments, innermost dimension first, as
// triton's fill_tma_descriptor passes them. Only the address changes between calls with one
// signature, so the last encodings are kept by address.
struct Desc {
  int64_t source, index, offset;
  int elem_type, swizzle, fill;
  unsigned rank;
  uint64_t dims[5], strides[5];
  unsigned box[5];
  static constexpr size_t KEEP = 8;
  mutable std::mutex mutex;
  mutable std::vector<Encoded> kept;   // at most KEEP, the next to replace at `next`
  mutable size_t next = 0;
};

struct Launch {
  uint64_t function;
  unsigned grid[3];
  unsigned block, shared;
  bool pdl, coop;
  std::vector<Param> params;
  std::vector<std::unique_ptr<Desc>> descs;
};

struct Output {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
};

struct Recipe {
  int64_t device;
  std::vector<Output> outputs;
  std::vector<Launch> launches;
  std::vector<at::Tensor> held;   // the kept scratch buffers ABS parameters point into
};

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) {
      h ^= static_cast<uint64_t>(v);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

using Recipes = std::unordered_map<Key, std::shared_ptr<const Recipe>, KeyHash>;

std::mutex g_mutex;
std::unordered_map<const c10::FunctionSchema*, Recipes> g_recipes;   // under g_mutex
// namespace -> its registrations (one library a dispatch key) and its miss function; entries
// are never erased, only emptied, so a miss function outlives interpreter teardown
struct Installed {
  std::vector<std::unique_ptr<torch::Library>> libraries;
  py::object* miss = nullptr;
};
std::unordered_map<std::string, Installed> g_installed;   // under the GIL
std::atomic<bool> g_enabled{true};     // false: every call goes to Python unrecorded
std::atomic<int> g_dry{0};             // 1: launches are logged in g_dry_log, not run;
                                       // 2: launches are dropped (timing the rest on a CPU)
std::atomic<int64_t> g_hits{0}, g_misses{0}, g_bad_recipes{0};
std::string g_last_bad;                // why the last dropped recipe did not parse (GIL held)
std::mutex g_dry_mutex;
auto* g_dry_log = new std::vector<py::tuple>();   // under g_dry_mutex and the GIL; never freed
                                                  // (no Python object is released at exit)
constexpr size_t MAX_RECIPES = 4096;   // recipes an op keeps before it starts over

// Tags keep one argument's entries from reading as another's.
enum Tag : int64_t { T_TENSOR = 1, T_UNDEF, T_NONE, T_INT, T_DOUBLE, T_BOOL, T_STR, T_INTS };

// The signature of the arguments on `stack` (the last `n` entries); false where an argument
// has a type this kernel does not sign (the call then runs Python unrecorded).
bool sign(const torch::jit::Stack& stack, size_t n, Key& key) {
  const size_t base = stack.size() - n;
  key.reserve(16 * n + 4);
  for (size_t i = base; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        key.push_back(T_UNDEF);
        continue;
      }
      if (t.is_sparse() || t.layout() != at::kStrided) return false;
      key.push_back(T_TENSOR);
      key.push_back(static_cast<int64_t>(t.key_set().raw_repr()));
      key.push_back(static_cast<int64_t>(t.scalar_type()));
      key.push_back(static_cast<int64_t>(t.device().type()) * 256 + t.device().index());
      key.push_back(t.dim());
      for (int64_t s : t.sizes()) key.push_back(s);
      for (int64_t s : t.strides()) key.push_back(s);
      key.push_back(t.requires_grad());
      key.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15);
    } else if (v.isNone()) {
      key.push_back(T_NONE);
    } else if (v.isInt()) {
      key.push_back(T_INT);
      key.push_back(v.toInt());
    } else if (v.isDouble()) {
      key.push_back(T_DOUBLE);
      double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      key.push_back(bits);
    } else if (v.isBool()) {
      key.push_back(T_BOOL);
      key.push_back(v.toBool());
    } else if (v.isString()) {
      const std::string& s = v.toStringRef();
      key.push_back(T_STR);
      key.push_back(static_cast<int64_t>(s.size()));
      for (size_t j = 0; j < s.size(); j += 8) {
        int64_t chunk = 0;
        std::memcpy(&chunk, s.data() + j, std::min<size_t>(8, s.size() - j));
        key.push_back(chunk);
      }
    } else if (v.isIntList()) {
      auto list = v.toIntList();
      key.push_back(T_INTS);
      key.push_back(static_cast<int64_t>(list.size()));
      for (int64_t x : list) key.push_back(x);
    } else {
      return false;
    }
  }
  return true;
}

// ---- the driver, opened once ----------------------------------------------------------------

using LaunchEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using ErrorString = CUresult (*)(CUresult, const char**);
using IsCapturing = CUresult (*)(CUstream, CUstreamCaptureStatus*);
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

struct Driver {
  LaunchEx launch = nullptr;
  ErrorString error = nullptr;
  IsCapturing capturing = nullptr;
  EncodeTiled encode = nullptr;
  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_LAZY);
    if (!lib) return;
    launch = reinterpret_cast<LaunchEx>(dlsym(lib, "cuLaunchKernelEx"));
    error = reinterpret_cast<ErrorString>(dlsym(lib, "cuGetErrorString"));
    capturing = reinterpret_cast<IsCapturing>(dlsym(lib, "cuStreamIsCapturing"));
    encode = reinterpret_cast<EncodeTiled>(dlsym(lib, "cuTensorMapEncodeTiled"));
  }
};

const Driver& driver() {
  static Driver d;
  return d;
}

// Whether this process has CUDA devices (c10's CUDA guard is registered by a CUDA build).
bool have_cuda() {
  static const bool have = c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) &&
                           c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount() > 0;
  return have;
}

// The device kernels launch on: the current CUDA device (-1 without CUDA).
int64_t current_device() {
  if (!have_cuda()) return -1;
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
}

// The current stream of `device` as a CUstream (0 without CUDA).
uint64_t current_stream(int64_t device) {
  if (device < 0) return 0;
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::Stream s = impl->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  return reinterpret_cast<uint64_t>(impl->getStreamNativeHandle(s));
}

bool capturing(uint64_t stream) {
  if (stream == 0) return false;   // the legacy default stream never captures
  const Driver& d = driver();
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (d.capturing == nullptr ||
      d.capturing(reinterpret_cast<CUstream>(stream), &status) != CUDA_SUCCESS)
    return true;                   // unknown: Python decides
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

// ---- replaying a recipe ---------------------------------------------------------------------

// The tensor map of `d` for `address`: a kept encoding, or a new one kept in place of the oldest.
const CUtensorMap* encoded(const Desc& d, uint64_t address) {
  std::lock_guard<std::mutex> lock(d.mutex);
  for (const Encoded& e : d.kept)
    if (e.address == address) return &e.map;
  if (d.kept.size() < Desc::KEEP) d.kept.emplace_back();
  Encoded& e = d.kept[d.next];
  d.next = (d.next + 1) % Desc::KEEP;
  const Driver& drv = driver();
  TORCH_CHECK(drv.encode != nullptr, "kvops replay: cuTensorMapEncodeTiled is not available");
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  e.address = NO_ADDRESS;     // until the encoding succeeds
  CUresult r = drv.encode(&e.map, static_cast<CUtensorMapDataType>(d.elem_type), d.rank,
                          reinterpret_cast<void*>(address), d.dims, d.strides, d.box, element_strides,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, static_cast<CUtensorMapSwizzle>(d.swizzle),
                          CU_TENSOR_MAP_L2_PROMOTION_L2_128B, static_cast<CUtensorMapFloatOOBfill>(d.fill));
  if (r != CUDA_SUCCESS) {
    const char* what = "unknown error";
    if (drv.error) drv.error(r, &what);
    TORCH_CHECK(false, "kvops replay: cuTensorMapEncodeTiled failed: ", what);
  }
  e.address = address;
  return &e.map;
}

void launch(const Launch& l, const std::vector<uint64_t>& slots, uint64_t stream) {
  std::vector<void*> params(slots.size());
  const int dry = g_dry.load(std::memory_order_relaxed);
  for (size_t i = 0; i < slots.size(); ++i) {
    params[i] = const_cast<uint64_t*>(&slots[i]);
    if (!dry && i < l.params.size() && l.params[i].kind == DESC)   // slots[i]: the address
      params[i] = const_cast<CUtensorMap*>(encoded(*l.descs[l.params[i].index], slots[i]));
  }
  if (dry == 2) return;
  if (dry) {
    py::gil_scoped_acquire gil;
    py::list values;
    for (uint64_t s : slots) values.append(py::int_(s));
    std::lock_guard<std::mutex> lock(g_dry_mutex);
    g_dry_log->push_back(py::make_tuple(l.function, py::make_tuple(l.grid[0], l.grid[1], l.grid[2]),
                                       l.block, l.shared, l.pdl, l.coop, values, stream));
    return;
  }
  if (static_cast<uint64_t>(l.grid[0]) * l.grid[1] * l.grid[2] == 0) return;
  const Driver& d = driver();
  TORCH_CHECK(d.launch != nullptr, "kvops replay: cuLaunchKernelEx is not available");
  CUlaunchAttribute attrs[2];
  unsigned n = 0;
  if (l.pdl) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[n].value.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (l.coop) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attrs[n].value.cooperative = 1;
    ++n;
  }
  CUlaunchConfig config;
  std::memset(&config, 0, sizeof config);
  config.gridDimX = l.grid[0];
  config.gridDimY = l.grid[1];
  config.gridDimZ = l.grid[2];
  config.blockDimX = l.block;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = l.shared;
  config.hStream = reinterpret_cast<CUstream>(stream);
  config.attrs = attrs;
  config.numAttrs = n;
  CUresult r = d.launch(&config, reinterpret_cast<CUfunction>(l.function), params.data(), nullptr);
  if (r != CUDA_SUCCESS) {
    const char* what = "unknown error";
    if (d.error) d.error(r, &what);
    TORCH_CHECK(false, "kvops replay: cuLaunchKernelEx failed: ", what);
  }
}

void replay(const Recipe& r, torch::jit::Stack* stack, size_t n, uint64_t stream) {
  const size_t base = stack->size() - n;
  at::Device device = r.device >= 0 ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(r.device))
                                    : at::Device(at::kCPU);
  std::vector<at::Tensor> outs;
  outs.reserve(r.outputs.size());
  for (const Output& o : r.outputs)
    outs.push_back(at::empty_strided(o.sizes, o.strides, at::TensorOptions().dtype(o.dtype).device(device)));
  std::vector<uint64_t> slots;
  for (const Launch& l : r.launches) {
    slots.assign(l.params.size() + 2, 0);   // the global and profile scratch pointers: null
    for (size_t i = 0; i < l.params.size(); ++i) {
      const Param& p = l.params[i];
      switch (p.kind) {
        case ARG:
          slots[i] = reinterpret_cast<uint64_t>((*stack)[base + p.index].toTensor().data_ptr()) + p.value;
          break;
        case OUT:
          slots[i] = reinterpret_cast<uint64_t>(outs[p.index].data_ptr()) + p.value;
          break;
        case DESC: {     // the described tensor's address (launch() passes its tensor map)
          const Desc& d = *l.descs[p.index];
          const at::Tensor& t = d.source == ARG ? (*stack)[base + d.index].toTensor() : outs[d.index];
          slots[i] = reinterpret_cast<uint64_t>(t.data_ptr()) + d.offset;
          break;
        }
        default:
          slots[i] = static_cast<uint64_t>(p.value);
      }
    }
    launch(l, slots, stream);
  }
  torch::jit::drop(*stack, n);
  for (at::Tensor& t : outs) stack->emplace_back(std::move(t));
}

// ---- the boxed kernel -----------------------------------------------------------------------

void push_result(const c10::FunctionSchema& schema, py::handle result, torch::jit::Stack* stack) {
  const auto& returns = schema.returns();
  if (returns.size() == 1) {
    stack->push_back(torch::jit::toIValue(result, returns[0].type()));
    return;
  }
  if (returns.empty()) return;
  TORCH_CHECK(PySequence_Check(result.ptr()), "kvops replay: ", schema.name(),
              " returned no sequence for its ", returns.size(), " results");
  py::sequence items = py::reinterpret_borrow<py::sequence>(result);
  TORCH_CHECK(items.size() == returns.size(), "kvops replay: ", schema.name(), " returned ",
              items.size(), " values, its schema says ", returns.size());
  for (size_t i = 0; i < returns.size(); ++i)
    stack->push_back(torch::jit::toIValue(items[i], returns[i].type()));
}

// A recipe that does not parse. Thrown and caught in this file only: a malformed recipe is
// dropped through a plain exception (on the device's torch 2.11 a TORCH_CHECK failure with a
// formatted message, caught here, crashed the process; one with a plain message did not).
struct BadRecipe : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Args>
void require(bool ok, const Args&... parts) {
  if (ok) return;
  std::ostringstream why;
  (why << ... << parts);
  throw BadRecipe(why.str());
}

std::shared_ptr<const Recipe> parse(py::handle spec, const torch::jit::Stack& stack, size_t n);

void kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  Key key;
  bool keyed = g_enabled.load(std::memory_order_relaxed) && sign(*stack, n, key);
  uint64_t stream = 0;
  if (keyed) {
    const int64_t device = current_device();
    stream = current_stream(device);
    if (capturing(stream)) {
      keyed = false;
    } else {
      key.push_back(device);
      key.push_back(static_cast<int64_t>(stream));
      key.push_back(static_cast<int64_t>(std::hash<std::thread::id>{}(std::this_thread::get_id())));
      std::shared_ptr<const Recipe> hit;
      {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto ops = g_recipes.find(&schema);
        if (ops != g_recipes.end()) {
          auto found = ops->second.find(key);
          if (found != ops->second.end()) hit = found->second;
        }
      }
      if (hit) {
        ++g_hits;
        replay(*hit, stack, n, stream);
        return;
      }
    }
  }
  ++g_misses;
  py::gil_scoped_acquire gil;
  const std::string& name = schema.name();
  auto installed = g_installed.find(name.substr(0, name.find("::")));
  TORCH_CHECK(installed != g_installed.end() && installed->second.miss != nullptr,
              "kvops replay: no miss function installed for ", name);
  py::object& miss = *installed->second.miss;
  const size_t base = stack->size() - n;
  py::tuple args(n);
  for (size_t i = 0; i < n; ++i) args[i] = torch::jit::toPyObject((*stack)[base + i]);
  py::object signature = keyed ? py::object(py::bytes(reinterpret_cast<const char*>(key.data()),
                                                       key.size() * sizeof(int64_t)))
                               : py::object(py::none());
  py::tuple got = miss(name, signature, args).cast<py::tuple>();
  TORCH_CHECK(got.size() == 2, "kvops replay: the miss function must return (result, recipe)");
  std::shared_ptr<const Recipe> recipe;
  if (keyed && !got[1].is_none()) {
    try {   // the op has run (and written its outputs): a recipe that does not parse is dropped
      recipe = parse(got[1], *stack, n);
    } catch (const BadRecipe& e) {
      if (PyErr_Occurred()) PyErr_Clear();
      ++g_bad_recipes;
      g_last_bad = e.what();
    } catch (const py::cast_error&) {
      ++g_bad_recipes;
      g_last_bad = "kvops replay: a recipe field of the wrong type";
    }
  }
  torch::jit::drop(*stack, n);
  push_result(schema, got[0], stack);
  if (recipe) {
    std::lock_guard<std::mutex> lock(g_mutex);
    Recipes& recipes = g_recipes[&schema];
    if (recipes.size() >= MAX_RECIPES) recipes.clear();
    recipes[std::move(key)] = std::move(recipe);
  }
}

// A recipe from Python: (device, [(sizes, strides, dtype)], [(function, (gx, gy, gz), block,
// shared, pdl, coop, [(kind, index, value)], [descriptor])]), a descriptor as Desc reads it.
std::shared_ptr<const Recipe> parse(py::handle spec, const torch::jit::Stack& stack, size_t n) {
  py::tuple t = spec.cast<py::tuple>();
  require(t.size() == 4, "kvops replay: a recipe is (device, outputs, launches, held)");
  auto r = std::make_shared<Recipe>();
  r->device = t[0].cast<int64_t>();
  const size_t base = stack.size() - n;
  auto is_tensor_arg = [&](int64_t index) {
    return index >= 0 && static_cast<size_t>(index) < n && stack[base + index].isTensor() &&
           stack[base + index].toTensor().defined();
  };
  for (py::handle h : t[3]) r->held.push_back(torch::jit::toIValue(h, c10::TensorType::get()).toTensor());
  for (py::handle o : t[1]) {
    py::tuple ot = o.cast<py::tuple>();
    PyObject* dtype = ot.size() == 3 ? ot[2].ptr() : nullptr;
    require(ot.size() == 3 && THPDtype_Check(ot[2].ptr()),
                "kvops replay: an output is (sizes, strides, torch.dtype)");
    r->outputs.push_back(Output{ot[0].cast<std::vector<int64_t>>(), ot[1].cast<std::vector<int64_t>>(),
                                reinterpret_cast<THPDtype*>(dtype)->scalar_type});
  }
  for (py::handle l : t[2]) {
    py::tuple lt = l.cast<py::tuple>();
    require(lt.size() == 8, "kvops replay: a launch is (function, grid, block, shared, pdl, coop, params, descs)");
    Launch launch;
    launch.function = lt[0].cast<uint64_t>();
    auto grid = lt[1].cast<std::vector<int64_t>>();
    require(grid.size() == 3, "kvops replay: a launch's grid must have three dimensions");
    for (int i = 0; i < 3; ++i) launch.grid[i] = static_cast<unsigned>(grid[i]);
    launch.block = lt[2].cast<unsigned>();
    launch.shared = lt[3].cast<unsigned>();
    launch.pdl = lt[4].cast<bool>();
    launch.coop = lt[5].cast<bool>();
    // descriptors: (source, index, offset, elem_type, swizzle, fill, dims, strides, box)
    for (py::handle dh : lt[7]) {
        py::tuple dt = dh.cast<py::tuple>();
        require(dt.size() == 9, "kvops replay: a descriptor has nine fields");
        auto d = std::make_unique<Desc>();
        d->source = dt[0].cast<int64_t>();
        d->index = dt[1].cast<int64_t>();
        d->offset = dt[2].cast<int64_t>();
        d->elem_type = dt[3].cast<int>();
        d->swizzle = dt[4].cast<int>();
        d->fill = dt[5].cast<int>();
        auto dims = dt[6].cast<std::vector<uint64_t>>();
        auto strides = dt[7].cast<std::vector<uint64_t>>();
        auto box = dt[8].cast<std::vector<unsigned>>();
        require(!dims.empty() && dims.size() <= 5 && strides.size() == dims.size() && box.size() == dims.size(),
                    "kvops replay: a descriptor's dims, strides and box must have one rank of 1 to 5");
        require(d->source == ARG || d->source == OUT, "kvops replay: a descriptor's source must be ARG or OUT");
        d->rank = static_cast<unsigned>(dims.size());
        for (unsigned k = 0; k < d->rank; ++k) {
          d->dims[k] = dims[k];
          d->strides[k] = strides[k];
          d->box[k] = box[k];
        }
        launch.descs.push_back(std::move(d));
      }
    for (py::handle p : lt[6]) {
      py::tuple pt = p.cast<py::tuple>();
      require(pt.size() == 3, "kvops replay: a parameter is (kind, index, value)");
      Param param{pt[0].cast<int64_t>(), pt[1].cast<int64_t>(), 0};
      // VAL and ABS carry 64 raw bits: take them from a Python int of either sign
      param.value = static_cast<int64_t>(PyLong_AsUnsignedLongLongMask(pt[2].ptr()));
      require(!PyErr_Occurred(), "kvops replay: a parameter's value must be an int");
      require(param.kind >= ARG && param.kind <= DESC, "kvops replay: unknown parameter kind ", param.kind);
      launch.params.push_back(param);
    }
    r->launches.push_back(std::move(launch));
  }
  for (const Launch& l : r->launches) {
    for (const auto& d : l.descs) {
      require(d->source != OUT || (d->index >= 0 && d->index < static_cast<int64_t>(r->outputs.size())),
                  "kvops replay: a descriptor names output ", d->index, " of ", r->outputs.size());
      require(d->source != ARG || is_tensor_arg(d->index), "kvops replay: a descriptor names argument ",
                  d->index, ", not a tensor");
    }
    for (const Param& p : l.params) {
      require(p.kind != OUT || (p.index >= 0 && p.index < static_cast<int64_t>(r->outputs.size())),
                  "kvops replay: a parameter names output ", p.index, " of ", r->outputs.size());
      require(p.kind != ARG || is_tensor_arg(p.index), "kvops replay: a parameter names argument ",
                  p.index, ", not a tensor");
      require(p.kind != DESC || (p.index >= 0 && p.index < static_cast<int64_t>(l.descs.size())),
                  "kvops replay: a parameter names descriptor ", p.index, " of ", l.descs.size());
    }
  }
  return r;
}

// ---- the module -----------------------------------------------------------------------------

void install(const std::string& ns, const std::string& dispatch_key, const std::vector<std::string>& names,
             py::object miss) {
  Installed& in = g_installed[ns];
  if (in.miss == nullptr) in.miss = new py::object();   // never freed (see Installed)
  *in.miss = std::move(miss);
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns,
                                              c10::parseDispatchKey(dispatch_key), __FILE__, __LINE__);
  for (const std::string& name : names)
    lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&kernel>());
  in.libraries.push_back(std::move(lib));
}

// Remove namespace `ns`'s registrations (its ops fall back to what was registered before) and
// every recipe.
void uninstall(const std::string& ns) {
  auto found = g_installed.find(ns);
  if (found != g_installed.end()) {
    found->second.libraries.clear();
    *found->second.miss = py::none();
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g_recipes.clear();
}

void clear() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_recipes.clear();
}

size_t recipes() {
  std::lock_guard<std::mutex> lock(g_mutex);
  size_t n = 0;
  for (const auto& op : g_recipes) n += op.second.size();
  return n;
}

py::list take_dry_launches() {
  std::lock_guard<std::mutex> lock(g_dry_mutex);
  py::list out;
  for (auto& t : *g_dry_log) out.append(t);
  g_dry_log->clear();
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvops: the ops' dispatch kernel that replays recorded launches (kvops/ops/_replay.py)";
  m.def("install", &install, "Register the replay kernel for ops `names` of namespace `ns` at `dispatch_key`");
  m.def("uninstall", &uninstall, "Remove namespace ns's registrations and every recipe");
  m.def("clear", &clear, "Forget every recipe");
  m.def("recipes", &recipes, "How many recipes are kept");
  m.def("set_enabled", [](bool on) { g_enabled = on; }, "false: every call runs Python, unrecorded");
  m.def("set_dry", [](int mode) { g_dry = mode; },
        "1 (or True): launches are logged (take_dry_launches), not run; 2: dropped; 0: run");
  m.def("take_dry_launches", &take_dry_launches);
  m.def("stats", []() { return py::make_tuple(g_hits.load(), g_misses.load()); }, "(hits, misses)");
  m.def("bad_recipes", []() { return py::make_tuple(g_bad_recipes.load(), g_last_bad); },
        "(recipes dropped because they did not parse, the last one's error)");
}
