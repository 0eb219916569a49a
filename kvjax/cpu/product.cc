// A row-count-invariant product for XLA CPU: y[R, O] = x[R, I] W[I, O], called from JAX as
// the FFI target "kvjax_product" (kvjax/cpu/product.py builds, loads and calls it).
//
// Every output element is one chain of fused multiply-adds over the input dimension in
// index order, y[r, o] = fma(x[r, I-1], W[I-1, o], ... fma(x[r, 0], W[0, o], 0)), whatever
// the number of rows, the row's neighbours, the thread count or the vector width: lanes run
// over outputs (never over the summed dimension), rows are blocked in registers only to
// reuse each loaded weight vector, and threads split the outputs. So a row's bits depend on
// its own values alone, which is what invariant numerics need, at the cost of one pass over
// the weights per call for a handful of rows.
//
// W comes packed in panels of PANEL outputs (kvjax.cpu.product.pack): panel p holds
// W[i, p * PANEL + j] at [p, i, j], zero past O, so a panel streams contiguously.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t LANES = 16;           // one vector of outputs
constexpr int64_t VECS = 4;             // vectors per panel
constexpr int64_t PANEL = LANES * VECS;  // outputs per panel
constexpr int64_t ROW_BLOCK = 6;        // rows sharing each loaded weight vector

// Sixteen float lanes, each an independent fma chain; three builds with the same bits.
#if defined(__AVX512F__)
struct Vec {
  __m512 v;
};
inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec splat(float x) { return {_mm512_set1_ps(x)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
constexpr const char* ISA = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  __m256 lo, hi;
};
inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Vec splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec fma(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline void store(float* p, Vec a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
constexpr const char* ISA = "avx2";
#else
struct Vec {
  float f[LANES];
};
inline Vec zero() { return Vec{}; }
inline Vec load(const float* p) {
  Vec a;
  std::copy(p, p + LANES, a.f);
  return a;
}
inline Vec splat(float x) {
  Vec a;
  std::fill(a.f, a.f + LANES, x);
  return a;
}
inline Vec fma(Vec a, Vec b, Vec c) {
  for (int64_t l = 0; l < LANES; ++l) c.f[l] = std::fma(a.f[l], b.f[l], c.f[l]);
  return c;
}
inline void store(float* p, Vec a) { std::copy(a.f, a.f + LANES, p); }
constexpr const char* ISA = "scalar";
#endif

// Rows [r0, r0 + ROWS) of y for one panel of outputs [o0, o0 + PANEL) (clipped at O).
template <int64_t ROWS>
void block(const float* x, const float* panel, float* y, int64_t r0, int64_t o0,
           int64_t in, int64_t out) {
  Vec acc[ROWS][VECS];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t v = 0; v < VECS; ++v) acc[r][v] = zero();
  const float* xr = x + r0 * in;
  for (int64_t i = 0; i < in; ++i) {
    const float* w = panel + i * PANEL;
    Vec wv[VECS];
    for (int64_t v = 0; v < VECS; ++v) wv[v] = load(w + v * LANES);
    for (int64_t r = 0; r < ROWS; ++r) {
      Vec xv = splat(xr[r * in + i]);
      for (int64_t v = 0; v < VECS; ++v) acc[r][v] = fma(xv, wv[v], acc[r][v]);
    }
  }
  int64_t width = std::min(PANEL, out - o0);
  for (int64_t r = 0; r < ROWS; ++r) {
    float* yr = y + (r0 + r) * out + o0;
    if (width == PANEL) {
      for (int64_t v = 0; v < VECS; ++v) store(yr + v * LANES, acc[r][v]);
    } else {
      float tmp[PANEL];
      for (int64_t v = 0; v < VECS; ++v) store(tmp + v * LANES, acc[r][v]);
      std::copy(tmp, tmp + width, yr);
    }
  }
}

using Block = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr Block TAILS[ROW_BLOCK] = {nullptr, block<1>, block<2>, block<3>, block<4>, block<5>};

// Panels [p0, p1) for every row.
void panels(const float* x, const float* w, float* y, int64_t rows, int64_t in, int64_t out,
            int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = w + p * in * PANEL;
    int64_t r = 0;
    for (; r + ROW_BLOCK <= rows; r += ROW_BLOCK)
      block<ROW_BLOCK>(x, panel, y, r, p * PANEL, in, out);
    if (r < rows) TAILS[rows - r](x, panel, y, r, p * PANEL, in, out);
  }
}

ffi::Error Product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != PANEL ||
      wd[1] != xd[1] || yd[0] != xd[0] || (yd[1] + PANEL - 1) / PANEL != wd[0])
    return ffi::Error::InvalidArgument(
        "kvjax_product: want x[R, I], packed w[ceil(O / 64), I, 64] -> y[R, O]");
  int64_t rows = xd[0], in = xd[1], out = yd[1], count = wd[0];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // Threads split the panels; each panel's work is the same whichever thread runs it.
  int64_t tasks = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), count);
  if (tasks <= 1) {
    panels(xp, wp, yp, rows, in, out, 0, count);
    return ffi::Error::Success();
  }
  std::atomic<int64_t> done{0};
  for (int64_t t = 1; t < tasks; ++t) {
    int64_t p0 = count * t / tasks, p1 = count * (t + 1) / tasks;
    pool.Schedule([=, &done] {
      panels(xp, wp, yp, rows, in, out, p0, p1);
      done.fetch_add(1, std::memory_order_release);
    });
  }
  panels(xp, wp, yp, rows, in, out, 0, count / tasks);
  while (done.load(std::memory_order_acquire) < tasks - 1) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxProduct, Product,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" const char* kvjax_product_isa() { return ISA; }
extern "C" int64_t kvjax_product_panel() { return PANEL; }
