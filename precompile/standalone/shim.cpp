// precompile's own AOTI tensor shim: the part of libtorch_cpu's C shim
// (torch/csrc/inductor/aoti_torch/c/shim.h) that a standalone CPU variant calls, so that the
// variant runs with neither libc10 nor libtorch_cpu loaded (precompile.standalone builds it and
// ships it inside the artifact; loader.native.libs opens it RTLD_GLOBAL before the variant).
//
// A tensor is a view (sizes, strides, storage offset, dtype) over a refcounted storage: memory we
// allocated (64-byte aligned, freed with the last view) or memory the caller owns (from_blob). The
// codes for dtypes, devices and layouts are torch's (c10::ScalarType, DeviceType, Layout), so a
// variant compiled against torch's headers reads them the same. Errors return 1 and keep a message
// for precompile_shim_last_error(); aoti_torch_check throws, as torch's does.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int32_t kCpu = 0, kCuda = 1;
constexpr int32_t kStrided = 0, kMkldnn = 3;
constexpr int64_t kAlign = 64;

struct Storage {
  std::atomic<int64_t> refs{1};
  void* data = nullptr;
  int64_t nbytes = 0;
  bool owned = false;
  ~Storage() {
    if (owned) std::free(data);
  }
};

struct Tensor {
  Storage* storage;
  std::vector<int64_t> sizes, strides;
  int64_t offset;
  int32_t dtype;
};

thread_local std::string last_error;

int32_t fail(const char* what) {
  last_error = what;
  return 1;
}

// Bytes per element of each c10::ScalarType code; 0: a dtype this shim does not hold.
int64_t item_size(int32_t dtype) {
  switch (dtype) {
    case 0: case 1: case 11: return 1;  // uint8, int8, bool
    case 2: case 5: case 15: return 2;  // int16, float16, bfloat16
    case 3: case 6: return 4;           // int32, float32
    case 4: case 7: return 8;           // int64, float64
    default: return 0;
  }
}

// Bytes a view of these sizes and strides reaches from its first element (0 when it is empty).
int64_t extent(int64_t ndim, const int64_t* sizes, const int64_t* strides, int64_t item) {
  int64_t last = 0;
  for (int64_t i = 0; i < ndim; ++i) {
    if (sizes[i] == 0) return 0;
    last += (sizes[i] - 1) * strides[i];
  }
  return (last + 1) * item;
}

Tensor* view(Storage* storage, int64_t ndim, const int64_t* sizes, const int64_t* strides, int64_t offset,
             int32_t dtype) {
  storage->refs.fetch_add(1, std::memory_order_relaxed);
  return new Tensor{storage, std::vector<int64_t>(sizes, sizes + ndim), std::vector<int64_t>(strides, strides + ndim),
                    offset, dtype};
}

Tensor* as_tensor(void* handle) { return static_cast<Tensor*>(handle); }

void release(Storage* storage) {
  if (storage->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete storage;
}

char* data_of(const Tensor* t) {
  return static_cast<char*>(t->storage->data) + t->offset * item_size(t->dtype);
}

// Copy src's elements (any strides) into dst's (any strides), same sizes and dtype.
void copy_elements(const Tensor* src, Tensor* dst) {
  const int64_t ndim = static_cast<int64_t>(src->sizes.size()), item = item_size(src->dtype);
  int64_t count = 1;
  for (int64_t s : src->sizes) count *= s;
  if (count == 0) return;
  std::vector<int64_t> index(ndim, 0);
  const char* from = data_of(src);
  char* to = data_of(dst);
  for (int64_t n = 0; n < count; ++n) {
    int64_t a = 0, b = 0;
    for (int64_t i = 0; i < ndim; ++i) {
      a += index[i] * src->strides[i];
      b += index[i] * dst->strides[i];
    }
    std::memcpy(to + b * item, from + a * item, item);
    for (int64_t i = ndim - 1; i >= 0; --i) {
      if (++index[i] < src->sizes[i]) break;
      index[i] = 0;
    }
  }
}

// Whether a view covers its extent exactly once (then a clone keeps its strides, as torch's
// preserve_format does); otherwise a clone is contiguous.
bool dense(const Tensor* t) {
  const int64_t ndim = static_cast<int64_t>(t->sizes.size());
  std::vector<int64_t> order;
  for (int64_t i = 0; i < ndim; ++i)
    if (t->sizes[i] != 1) order.push_back(i);
  for (size_t i = 1; i < order.size(); ++i)
    for (size_t j = i; j > 0 && t->strides[order[j]] < t->strides[order[j - 1]]; --j) std::swap(order[j], order[j - 1]);
  int64_t expected = 1;
  for (int64_t i : order) {
    if (t->sizes[i] == 0) return true;
    if (t->strides[i] != expected) return false;
    expected *= t->sizes[i];
  }
  return true;
}

}  // namespace

typedef void* AtenTensorHandle;
typedef int32_t AOTITorchError;

EXPORT const char* precompile_shim_last_error() { return last_error.c_str(); }

EXPORT int32_t aoti_torch_device_type_cpu() { return kCpu; }
EXPORT int32_t aoti_torch_device_type_cuda() { return kCuda; }
EXPORT int32_t aoti_torch_layout_strided() { return kStrided; }
EXPORT int32_t aoti_torch_layout__mkldnn() { return kMkldnn; }
EXPORT int32_t aoti_torch_dtype_uint8() { return 0; }
EXPORT int32_t aoti_torch_dtype_int8() { return 1; }
EXPORT int32_t aoti_torch_dtype_int16() { return 2; }
EXPORT int32_t aoti_torch_dtype_int32() { return 3; }
EXPORT int32_t aoti_torch_dtype_int64() { return 4; }
EXPORT int32_t aoti_torch_dtype_float16() { return 5; }
EXPORT int32_t aoti_torch_dtype_float32() { return 6; }
EXPORT int32_t aoti_torch_dtype_float64() { return 7; }
EXPORT int32_t aoti_torch_dtype_bool() { return 11; }
EXPORT int32_t aoti_torch_dtype_bfloat16() { return 15; }

namespace {
thread_local bool grad_enabled = false;  // serving never records gradients
}
EXPORT bool aoti_torch_grad_mode_is_enabled() { return grad_enabled; }
EXPORT void aoti_torch_grad_mode_set_enabled(bool enabled) { grad_enabled = enabled; }

EXPORT void aoti_torch_check(bool cond, const char* func, const char* file, uint32_t line, const char* msg) {
  if (!cond) {
    throw std::runtime_error(std::string(msg ? msg : "check failed") + " (" + (func ? func : "?") + " at " +
                             (file ? file : "?") + ":" + std::to_string(line) + ")");
  }
}

EXPORT AOTITorchError aoti_torch_create_tensor_from_blob_v2(void* data, int64_t ndim, const int64_t* sizes,
                                                            const int64_t* strides, int64_t storage_offset,
                                                            int32_t dtype, int32_t device_type, int32_t device_index,
                                                            AtenTensorHandle* ret, int32_t layout,
                                                            const uint8_t* opaque_metadata,
                                                            int64_t opaque_metadata_size) {
  (void)device_index, (void)opaque_metadata, (void)opaque_metadata_size;
  if (device_type != kCpu) return fail("create_tensor_from_blob: only CPU tensors");
  if (layout != kStrided) return fail("create_tensor_from_blob: only strided tensors (no oneDNN layout)");
  const int64_t item = item_size(dtype);
  if (item == 0) return fail("create_tensor_from_blob: unsupported dtype");
  auto* storage = new (std::nothrow) Storage();
  if (storage == nullptr) return fail("out of memory");
  // The storage begins at data, the view storage_offset elements into it, as torch's shim makes it
  // (at::for_blob(data, sizes).storage_offset(...)): AOTInductor hands each constant the start of its
  // storage's bytes and the view's offset in them (aoti_runtime/model_base.h, load_constants).
  storage->data = data;
  storage->nbytes = storage_offset * item + extent(ndim, sizes, strides, item);
  *ret = view(storage, ndim, sizes, strides, storage_offset, dtype);
  release(storage);  // the view holds the only reference
  return 0;
}

EXPORT AOTITorchError aoti_torch_create_tensor_from_blob(void* data, int64_t ndim, const int64_t* sizes,
                                                         const int64_t* strides, int64_t storage_offset,
                                                         int32_t dtype, int32_t device_type, int32_t device_index,
                                                         AtenTensorHandle* ret) {
  return aoti_torch_create_tensor_from_blob_v2(data, ndim, sizes, strides, storage_offset, dtype, device_type,
                                               device_index, ret, kStrided, nullptr, 0);
}

EXPORT AOTITorchError aoti_torch_empty_strided(int64_t ndim, const int64_t* sizes, const int64_t* strides,
                                               int32_t dtype, int32_t device_type, int32_t device_index,
                                               AtenTensorHandle* ret) {
  (void)device_index;
  if (device_type != kCpu) return fail("empty_strided: only CPU tensors");
  const int64_t item = item_size(dtype);
  if (item == 0) return fail("empty_strided: unsupported dtype");
  for (int64_t i = 0; i < ndim; ++i)
    if (sizes[i] < 0 || strides[i] < 0) return fail("empty_strided: negative size or stride");
  const int64_t nbytes = extent(ndim, sizes, strides, item);
  auto* storage = new (std::nothrow) Storage();
  if (storage == nullptr) return fail("out of memory");
  storage->nbytes = nbytes;
  storage->owned = true;
  if (nbytes > 0) {
    storage->data = std::aligned_alloc(kAlign, (nbytes + kAlign - 1) / kAlign * kAlign);
    if (storage->data == nullptr) {
      delete storage;
      return fail("out of memory");
    }
  }
  *ret = view(storage, ndim, sizes, strides, 0, dtype);
  release(storage);
  return 0;
}

EXPORT AOTITorchError aoti_torch__reinterpret_tensor(AtenTensorHandle self, int64_t ndim, const int64_t* sizes,
                                                     const int64_t* strides, int64_t storage_offset,
                                                     AtenTensorHandle* ret) {
  Tensor* t = as_tensor(self);
  *ret = view(t->storage, ndim, sizes, strides, storage_offset, t->dtype);
  return 0;
}

EXPORT AOTITorchError aoti_torch_new_tensor_handle(AtenTensorHandle orig, AtenTensorHandle* ret) {
  Tensor* t = as_tensor(orig);
  *ret = view(t->storage, static_cast<int64_t>(t->sizes.size()), t->sizes.data(), t->strides.data(), t->offset,
              t->dtype);
  return 0;
}

EXPORT AOTITorchError aoti_torch_clone(AtenTensorHandle self, AtenTensorHandle* ret) {
  Tensor* t = as_tensor(self);
  const int64_t ndim = static_cast<int64_t>(t->sizes.size());
  std::vector<int64_t> strides = t->strides;
  if (!dense(t)) {
    int64_t step = 1;
    for (int64_t i = ndim - 1; i >= 0; --i) {
      strides[i] = step;
      step *= t->sizes[i] > 1 ? t->sizes[i] : 1;
    }
  }
  AtenTensorHandle out;
  if (aoti_torch_empty_strided(ndim, t->sizes.data(), strides.data(), t->dtype, kCpu, 0, &out) != 0) return 1;
  copy_elements(t, as_tensor(out));
  *ret = out;
  return 0;
}

EXPORT AOTITorchError aoti_torch_delete_tensor_object(AtenTensorHandle tensor) {
  Tensor* t = as_tensor(tensor);
  if (t == nullptr) return 0;
  release(t->storage);
  delete t;
  return 0;
}

EXPORT AOTITorchError aoti_torch_get_data_ptr(AtenTensorHandle tensor, void** ret) {
  *ret = data_of(as_tensor(tensor));
  return 0;
}

EXPORT AOTITorchError aoti_torch_get_dim(AtenTensorHandle tensor, int64_t* ret) {
  *ret = static_cast<int64_t>(as_tensor(tensor)->sizes.size());
  return 0;
}

EXPORT AOTITorchError aoti_torch_get_numel(AtenTensorHandle tensor, int64_t* ret) {
  int64_t n = 1;
  for (int64_t s : as_tensor(tensor)->sizes) n *= s;
  *ret = n;
  return 0;
}

EXPORT AOTITorchError aoti_torch_get_sizes(AtenTensorHandle tensor, int64_t** ret) {
  *ret = as_tensor(tensor)->sizes.data();
  return 0;
}

EXPORT AOTITorchError aoti_torch_get_strides(AtenTensorHandle tensor, int64_t** ret) {
  *ret = as_tensor(tensor)->strides.data();
  return 0;
}

EXPORT AOTITorchError aoti_torch_get_storage_offset(AtenTensorHandle tensor, int64_t* ret) {
  *ret = as_tensor(tensor)->offset;
  return 0;
}

EXPORT AOTITorchError aoti_torch_get_storage_size(AtenTensorHandle tensor, int64_t* ret) {
  *ret = as_tensor(tensor)->storage->nbytes;
  return 0;
}

EXPORT AOTITorchError aoti_torch_get_dtype(AtenTensorHandle tensor, int32_t* ret) {
  *ret = as_tensor(tensor)->dtype;
  return 0;
}

EXPORT AOTITorchError aoti_torch_get_device_type(AtenTensorHandle tensor, int32_t* ret) {
  (void)tensor;
  *ret = kCpu;
  return 0;
}

EXPORT AOTITorchError aoti_torch_get_device_index(AtenTensorHandle tensor, int32_t* ret) {
  (void)tensor;
  *ret = 0;
  return 0;
}

// ---- SLEEF: the vector math ATen's Vectorized<> headers call (Sleef_expf16_u10, ...) -------------
// libtorch_cpu carries SLEEF; generated kernels that use exp, log, tanh, ... call it by these names.
// exp, the one softmax runs on every score, is vectorised here (Cody-Waite reduction and Cephes'
// degree-5 polynomial: within 2 ulp of expf over float's normal range, subnormals gradual, inf and 0 outside it, NaN kept); the
// rest apply libm to each lane: exact to libm's ulp, slower, and rare in served graphs. A function
// left out here leaves the symbol unresolved, and the build finds the variant not standalone.
#include <cmath>

namespace {

template <int N>
struct Lanes {
  typedef float F __attribute__((vector_size(N * 4)));
  typedef double D __attribute__((vector_size(N * 8)));
  typedef int32_t I __attribute__((vector_size(N * 4)));
};

template <typename V, typename S, S (*f)(S), int N>
__attribute__((always_inline)) inline V each(V x) {
  V out;
  for (int i = 0; i < N; ++i) out[i] = f(x[i]);
  return out;
}

template <typename V, typename S, S (*f)(S, S), int N>
__attribute__((always_inline)) inline V each2(V x, V y) {
  V out;
  for (int i = 0; i < N; ++i) out[i] = f(x[i], y[i]);
  return out;
}

template <int N>
__attribute__((always_inline)) inline typename Lanes<N>::F vexpf(typename Lanes<N>::F x) {
  typedef typename Lanes<N>::F F;
  typedef typename Lanes<N>::I I;
  const F hi = x > 88.72283935546875f ? F{} + 1 : F{};
  const F lo = x < -103.97208404541015625f ? F{} + 1 : F{};
  F c = x;
  c = c > 88.72283935546875f ? F{} + 88.72283935546875f : c;
  c = c < -103.97208404541015625f ? F{} + -103.97208404541015625f : c;
  // n = round(x / ln2); r = x - n ln2 (in two parts)
  F n = c * 1.44269504088896341f + 0.5f;
  I ni = __builtin_convertvector(n, I);
  F nf = __builtin_convertvector(ni, F);
  ni = nf > n ? ni - 1 : ni;  // floor
  nf = __builtin_convertvector(ni, F);
  F r = c - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  F r2 = r * r;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  // 2^n in two factors, so that n up to 128 and down to -150 (subnormal results) stay exact
  const I half = ni >> 1;
  I bits = (half + 127) << 23, rest = (ni - half + 127) << 23;
  F scale, scale2;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  __builtin_memcpy(&scale2, &rest, sizeof(scale2));
  F out = p * scale * scale2;
  const F inf = F{} + HUGE_VALF;
  out = hi != 0 ? inf : out;
  out = lo != 0 ? F{} : out;
  out = x != x ? x : out;
  return out;
}

}  // namespace

#define SLEEF_EXP(N, ISA)                                                                       \
  EXPORT __attribute__((target(ISA))) Lanes<N>::F Sleef_expf##N##_u10(Lanes<N>::F x) {         \
    return vexpf<N>(x);                                                                         \
  }
SLEEF_EXP(4, "sse4.2")
SLEEF_EXP(8, "avx2,fma")
SLEEF_EXP(16, "avx512f")

#define SLEEF_F1(NAME, FN, ULP)                                                                                 \
  EXPORT __attribute__((target("sse4.2"))) Lanes<4>::F Sleef_##NAME##f4_##ULP(Lanes<4>::F x) {                  \
    return each<Lanes<4>::F, float, FN##f, 4>(x);                                                               \
  }                                                                                                             \
  EXPORT __attribute__((target("avx2,fma"))) Lanes<8>::F Sleef_##NAME##f8_##ULP(Lanes<8>::F x) {                \
    return each<Lanes<8>::F, float, FN##f, 8>(x);                                                               \
  }                                                                                                             \
  EXPORT __attribute__((target("avx512f"))) Lanes<16>::F Sleef_##NAME##f16_##ULP(Lanes<16>::F x) {              \
    return each<Lanes<16>::F, float, FN##f, 16>(x);                                                             \
  }                                                                                                             \
  EXPORT __attribute__((target("sse4.2"))) Lanes<2>::D Sleef_##NAME##d2_##ULP(Lanes<2>::D x) {                  \
    return each<Lanes<2>::D, double, FN, 2>(x);                                                                 \
  }                                                                                                             \
  EXPORT __attribute__((target("avx2,fma"))) Lanes<4>::D Sleef_##NAME##d4_##ULP(Lanes<4>::D x) {                \
    return each<Lanes<4>::D, double, FN, 4>(x);                                                                 \
  }                                                                                                             \
  EXPORT __attribute__((target("avx512f"))) Lanes<8>::D Sleef_##NAME##d8_##ULP(Lanes<8>::D x) {                 \
    return each<Lanes<8>::D, double, FN, 8>(x);                                                                 \
  }

#define SLEEF_F2(NAME, FN, ULP)                                                                                 \
  EXPORT __attribute__((target("sse4.2"))) Lanes<4>::F Sleef_##NAME##f4##ULP(Lanes<4>::F x, Lanes<4>::F y) {    \
    return each2<Lanes<4>::F, float, FN##f, 4>(x, y);                                                           \
  }                                                                                                             \
  EXPORT __attribute__((target("avx2,fma"))) Lanes<8>::F Sleef_##NAME##f8##ULP(Lanes<8>::F x, Lanes<8>::F y) {  \
    return each2<Lanes<8>::F, float, FN##f, 8>(x, y);                                                           \
  }                                                                                                             \
  EXPORT __attribute__((target("avx512f"))) Lanes<16>::F Sleef_##NAME##f16##ULP(Lanes<16>::F x,                 \
                                                                               Lanes<16>::F y) {                \
    return each2<Lanes<16>::F, float, FN##f, 16>(x, y);                                                         \
  }                                                                                                             \
  EXPORT __attribute__((target("sse4.2"))) Lanes<2>::D Sleef_##NAME##d2##ULP(Lanes<2>::D x, Lanes<2>::D y) {    \
    return each2<Lanes<2>::D, double, FN, 2>(x, y);                                                             \
  }                                                                                                             \
  EXPORT __attribute__((target("avx2,fma"))) Lanes<4>::D Sleef_##NAME##d4##ULP(Lanes<4>::D x, Lanes<4>::D y) {  \
    return each2<Lanes<4>::D, double, FN, 4>(x, y);                                                             \
  }                                                                                                             \
  EXPORT __attribute__((target("avx512f"))) Lanes<8>::D Sleef_##NAME##d8##ULP(Lanes<8>::D x, Lanes<8>::D y) {   \
    return each2<Lanes<8>::D, double, FN, 8>(x, y);                                                             \
  }

// expf itself is vectorised above; its double forms go through libm.
EXPORT __attribute__((target("sse4.2"))) Lanes<2>::D Sleef_expd2_u10(Lanes<2>::D x) { return each<Lanes<2>::D, double, exp, 2>(x); }
EXPORT __attribute__((target("avx2,fma"))) Lanes<4>::D Sleef_expd4_u10(Lanes<4>::D x) { return each<Lanes<4>::D, double, exp, 4>(x); }
EXPORT __attribute__((target("avx512f"))) Lanes<8>::D Sleef_expd8_u10(Lanes<8>::D x) { return each<Lanes<8>::D, double, exp, 8>(x); }
SLEEF_F1(exp2, exp2, u10)
SLEEF_F1(expm1, expm1, u10)
SLEEF_F1(log, log, u10)
SLEEF_F1(log2, log2, u10)
SLEEF_F1(log10, log10, u10)
SLEEF_F1(log1p, log1p, u10)
SLEEF_F1(sin, sin, u10)
SLEEF_F1(cos, cos, u10)
SLEEF_F1(tan, tan, u10)
SLEEF_F1(asin, asin, u10)
SLEEF_F1(acos, acos, u10)
SLEEF_F1(atan, atan, u10)
SLEEF_F1(sinh, sinh, u10)
SLEEF_F1(cosh, cosh, u10)
SLEEF_F1(tanh, tanh, u10)
SLEEF_F1(asinh, asinh, u10)
SLEEF_F1(acosh, acosh, u10)
SLEEF_F1(atanh, atanh, u10)
SLEEF_F1(erf, erf, u10)
SLEEF_F1(erfc, erfc, u15)
SLEEF_F1(lgamma, lgamma, u10)
SLEEF_F2(atan2, atan2, _u10)
SLEEF_F2(pow, pow, _u10)
SLEEF_F2(hypot, hypot, _u05)
SLEEF_F2(fmod, fmod, )
SLEEF_F2(copysign, copysign, )
SLEEF_F2(nextafter, nextafter, )
