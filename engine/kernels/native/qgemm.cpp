// Quantized GEMV/GEMM on a GGUF's own weight blocks, for the CPU.
//
// y[m, n] = sum_k x[m, k] * W[n, k], where x is float32 and quantized here to int8
// in blocks of 32 (one float scale a block, as llama.cpp's Q8 activation blocks)
// and W is stored as the GGUF stores it (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K).
// Integer dot products a block, float accumulation a row pair, in block order.
//
// One translation unit, compiled without -march: the kernels are compiled once per
// ISA level (portable, AVX2+FMA, AVX2+AVX512-VNNI) under `#pragma GCC target` and
// picked at run time. Threads: torch's intra-op pool (at::parallel_for) over
// output rows. The step allocates nothing once the activation workspace has grown.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define QG_X86 1
#include <immintrin.h>
#else
#define QG_X86 0
#endif

namespace {

// ggml's type ids
enum QType : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Act {
  const int8_t* q;  // [M, K] codes
  const float* d;   // [M, K/32] scales
  const float* s;   // [M, K/32] d * sum of the block's codes
};

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// the 6-bit scales and mins of a Q4_K/Q5_K super-block's 8 sub-blocks
inline void k_scales(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
}

int64_t block_bytes(int qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
  }
  return 0;
}

int64_t block_elems(int qtype) { return qtype >= Q4_K ? 256 : 32; }

// Round to nearest even, scale = amax / 127: the same codes on every ISA.
void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* s) {
  const int64_t nb = k / 32;
  for (int64_t i = 0; i < m * nb; ++i) {
    const float* xb = x + i * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float dd = amax / 127.f;
    const float id = dd != 0.f ? 1.f / dd : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = (int)std::nearbyint(xb[j] * id);
      q[i * 32 + j] = (int8_t)v;
      sum += v;
    }
    d[i] = dd;
    s[i] = dd * (float)sum;
  }
}

// one weight's rows in one block type (a fused projection may hold several)
struct Part {
  const uint8_t* w;
  int64_t rows, row_bytes;
  int qtype;
};

// A decoder layer's step (layer_body.inc): its weights, the step's rows, the
// paged cache and the scratch buffers (grown by the caller, never in the step).
struct LayerArgs {
  float* x;  // [t, e] the residual stream, updated in place
  int64_t t, e, d, heads, kv_heads, inter;
  const float *norm1, *norm2;
  float eps, scale;
  const Part *qkv, *o, *gate_up, *down;
  int n_qkv, n_o, n_gate_up, n_down;
  const int64_t *positions, *slots, *tables, *limits;
  int64_t table_width, block_size, window;
  const float *cos, *sin;  // [P, d] each
  float *k_cache, *v_cache;  // [slots, kv_heads, d] each
  int two_level;  // bit i: projection i's input as int8 codes plus those of their error
  int8_t* q8;
  float *d8, *s8, *hbuf, *qkv_out, *attn, *gu, *ybuf, *wide, *resid;
};

namespace generic {
#define QG_SIMD 0
#include "qgemm_body.inc"
#include "layer_body.inc"
#undef QG_SIMD
}  // namespace generic

#if QG_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define QG_SIMD 1
#define QG_VNNI 0
#include "qgemm_body.inc"
#include "layer_body.inc"
#undef QG_VNNI
#undef QG_SIMD
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
#define QG_SIMD 1
#define QG_VNNI 1
#include "qgemm_body.inc"
#include "layer_body.inc"
#undef QG_VNNI
#undef QG_SIMD
}  // namespace vnni
#pragma GCC pop_options
#endif

enum Isa : int64_t { GENERIC = 0, AVX2 = 1, VNNI = 2 };

int64_t best_isa() {
#if QG_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return VNNI;
  if (avx2) return AVX2;
#endif
  return GENERIC;
}

int64_t detected_isa() { return best_isa(); }

struct Workspace {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

void qmatmul(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t isa,
             at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(), "qmatmul: x must be a contiguous float32 CPU matrix");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "qmatmul: w must be contiguous uint8 [N, bytes per row]");
  TORCH_CHECK(block_bytes(qtype) > 0, "qmatmul: unsupported block type ", qtype);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % block_elems(qtype) == 0, "qmatmul: ", k, " inputs are not whole blocks");
  TORCH_CHECK(w.size(1) == k / block_elems(qtype) * block_bytes(qtype),
              "qmatmul: weight rows hold ", w.size(1), " bytes, ", k, " inputs need ",
              k / block_elems(qtype) * block_bytes(qtype));
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == m &&
                  out.size(1) == n && out.stride(1) == 1,
              "qmatmul: out must be float32 [M, N] with unit column stride");
  if (isa < 0 || isa > best_isa()) isa = best_isa();
  if (m == 0 || n == 0) return;
  static thread_local Workspace ws;
  const int64_t nb = k / 32;
  if ((int64_t)ws.q.size() < m * k) ws.q.resize(m * k);
  if ((int64_t)ws.d.size() < m * nb) { ws.d.resize(m * nb); ws.s.resize(m * nb); }
  quantize_rows(x.data_ptr<float>(), m, k, ws.q.data(), ws.d.data(), ws.s.data());
  const Act a{ws.q.data(), ws.d.data(), ws.s.data()};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1), ldy = out.stride(0);
  float* y = out.data_ptr<float>();
  const int q = (int)qtype;
  // at least 32 rows a task: fewer would cost more in scheduling than they save
  at::parallel_for(0, n, 32, [&](int64_t n0, int64_t n1) {
    switch (isa) {
#if QG_X86
      case VNNI: vnni::rows(q, wp, row_bytes, a, m, nb, n0, n1, y, ldy); break;
      case AVX2: avx2::rows(q, wp, row_bytes, a, m, nb, n0, n1, y, ldy); break;
#endif
      default: generic::rows(q, wp, row_bytes, a, m, nb, n0, n1, y, ldy); break;
    }
  });
}

void quantize_act(const at::Tensor& x, at::Tensor& q, at::Tensor& d, at::Tensor& s) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) % 32 == 0, "quantize_act: x must be contiguous float32 [M, 32k]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.numel() == x.numel(),
              "quantize_act: q must be int8 like x");
  const int64_t nb = x.numel() / 32;
  TORCH_CHECK(d.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat &&
                  d.is_contiguous() && s.is_contiguous() && d.numel() == nb && s.numel() == nb,
              "quantize_act: d and s must be float32 with one value a block");
  quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), q.data_ptr<int8_t>(),
                d.data_ptr<float>(), s.data_ptr<float>());
}

#include "layer.inc"

}  // namespace

TORCH_LIBRARY(formcast_native, m) {
  m.def("qmatmul(Tensor x, Tensor w, int qtype, int isa, Tensor(a!) out) -> ()", &qmatmul);
  m.def("quantize_act(Tensor x, Tensor(a!) q, Tensor(a!) d, Tensor(a!) s) -> ()",
        &quantize_act);
  m.def("isa() -> int", &detected_isa);
  m.def("decoder_layer(Tensor(a!) x, Tensor? pending, Tensor norm1, Tensor norm2, float eps, "
        "Tensor[] weights, int[] qtypes, int[] counts, Tensor positions, Tensor cos, "
        "Tensor sin, Tensor(b!) kv_cache, Tensor slots, Tensor tables, Tensor limits, "
        "int heads, int kv_heads, float scale, int window, int two_level, int isa) -> ()", &decoder_layer);
  m.def("decoder_layers(Tensor(a!) x, Tensor[] norms, float eps, Tensor[] weights, int[] qtypes, "
        "int[] counts, Tensor positions, Tensor cos, Tensor sin, Tensor(b!)[] kv_caches, "
        "Tensor slots, Tensor tables, Tensor limits, int heads, int kv_heads, float scale, "
        "int window, int two_level, int isa) -> ()", &decoder_layers);
}
