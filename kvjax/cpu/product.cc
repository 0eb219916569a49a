// Row-count-invariant products for XLA CPU, called from JAX as FFI targets (kvjax/cpu/
// product.py builds, loads and calls them):
//   kvjax_product    y[R, O] = x[R, I] W[I, O]   (a Dense kernel as Flax stores it)
//   kvjax_product_t  y[R, O] = x[R, I] W[O, I]^T (a tied head: the embedding [V, D])
//
// What a row's bits depend on is fixed by I alone, never by the number of rows, the row's
// neighbours, the thread count or the vector width:
// - kvjax_product: each output is one chain of fused multiply-adds over the inputs in index
//   order, y = fma(x[I-1], W[I-1], ... fma(x[0], W[0], 0)). Vector lanes run over outputs;
//   rows are blocked in registers only to reuse each loaded weight vector. W comes packed
//   (kvjax.cpu.product.pack, once at load; same shape): the outputs' first O - O % 64 in
//   panels of 64, panel p holding W[i, 64p + j] at (p * I + i) * 64 + j, then the last
//   O % 64 outputs as [I, O % 64], so each thread streams its panels front to back (in
//   Flax's layout a thread's share of a row is a short piece and the stream stalls).
// - kvjax_product_t: lane l of an output's 16 accumulators sums the inputs i = l mod 16 in
//   index order by fused multiply-adds (past I a lane adds nothing), then the 16 lanes are
//   added in one fixed tree.
// Threads split the outputs. So a row's bits are its own, which is what invariant numerics
// need, and the weights pass once per call for a handful of rows.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>

#include "split.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t VECS = 4;              // vectors of outputs per tile (kvjax_product)
constexpr int64_t PANEL = LANES * VECS;  // outputs per tile
constexpr int64_t ROW_BLOCK = 6;         // rows per tile (kvjax_product)
constexpr int64_t T_ROWS = 4;  // rows per tile (kvjax_product_t; one output a tile: one
                               // stream of weights per thread streams fastest)

// Sixteen float lanes, each its own fma chain: three builds with the same bits.
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

// The first `n` floats at p, zero past them.
inline Vec load_part(const float* p, int64_t n) {
  float tmp[LANES] = {};
  std::copy(p, p + n, tmp);
  return load(tmp);
}

// ---- kvjax_product: W[I, O], packed ----------------------------------------------------

struct Dense {
  const float* x;  // [rows, in]
  const float* w;  // [in, out] (kvjax_product: packed, see the file's head)
  float* y;        // [rows, out]
  int64_t rows, in, out;
};

// y[r0 .. r0 + ROWS, p * PANEL .. + PANEL) from panel p, streamed once.
template <int64_t ROWS>
void tile(const Dense& d, int64_t r0, int64_t p) {
  Vec acc[ROWS][VECS];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t v = 0; v < VECS; ++v) acc[r][v] = zero();
  const float* panel = d.w + p * d.in * PANEL;
  const float* xr = d.x + r0 * d.in;
  for (int64_t i = 0; i < d.in; ++i) {
    Vec wv[VECS];
    for (int64_t v = 0; v < VECS; ++v) wv[v] = load(panel + i * PANEL + v * LANES);
    for (int64_t r = 0; r < ROWS; ++r) {
      Vec xv = splat(xr[r * d.in + i]);
      for (int64_t v = 0; v < VECS; ++v) acc[r][v] = fma(xv, wv[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t v = 0; v < VECS; ++v)
      store(d.y + (r0 + r) * d.out + p * PANEL + v * LANES, acc[r][v]);
}

using Tile = void (*)(const Dense&, int64_t, int64_t);
constexpr Tile TILES[ROW_BLOCK + 1] = {nullptr,  tile<1>, tile<2>,        tile<3>,
                                       tile<4>, tile<5>, tile<ROW_BLOCK>};

// Panels [p_begin, p_end) for every row; the last range also takes the outputs past the
// last full panel, one lane at a time (std::fma: the same operation as a vector lane).
void dense_outputs(const Dense& d, int64_t p_begin, int64_t p_end) {
  for (int64_t p = p_begin; p < p_end; ++p)
    for (int64_t r0 = 0; r0 < d.rows; r0 += ROW_BLOCK)
      TILES[std::min(ROW_BLOCK, d.rows - r0)](d, r0, p);
  int64_t full = d.out / PANEL, rest = d.out - full * PANEL;
  if (p_end != full || rest == 0) return;
  const float* tail = d.w + full * PANEL * d.in;  // [in, rest]
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t o = 0; o < rest; ++o) {
      float acc = 0.0f;
      for (int64_t i = 0; i < d.in; ++i) acc = std::fma(d.x[r * d.in + i], tail[i * rest + o], acc);
      d.y[r * d.out + full * PANEL + o] = acc;
    }
}

// ---- kvjax_product_t: W[O, I] ----------------------------------------------------------

// The 16 lanes of `a` added in one fixed tree.
inline float lane_sum(Vec a) {
  float f[LANES];
  store(f, a);
  for (int64_t step = LANES / 2; step > 0; step /= 2)
    for (int64_t l = 0; l < step; ++l) f[l] += f[l + step];
  return f[0];
}

// Output o of rows [r0, r0 + ROWS).
template <int64_t ROWS>
void tile_t(const Dense& d, int64_t r0, int64_t o) {
  Vec acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = zero();
  int64_t full = d.in / LANES * LANES;
  const float* w = d.w + o * d.in;
  for (int64_t i = 0; i < d.in; i += LANES) {
    int64_t n = std::min(LANES, d.in - i);
    Vec wv = i < full ? load(w + i) : load_part(w + i, n);
    for (int64_t r = 0; r < ROWS; ++r) {
      const float* p = d.x + (r0 + r) * d.in + i;
      acc[r] = fma(i < full ? load(p) : load_part(p, n), wv, acc[r]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) d.y[(r0 + r) * d.out + o] = lane_sum(acc[r]);
}

void transposed_outputs(const Dense& d, int64_t o_begin, int64_t o_end) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    int64_t r0 = 0;
    for (; r0 + T_ROWS <= d.rows; r0 += T_ROWS) tile_t<T_ROWS>(d, r0, o);
    for (; r0 < d.rows; ++r0) tile_t<1>(d, r0, o);
  }
}

// ---- the FFI handlers ------------------------------------------------------------------

// y = x . w on the pool's threads, one range of outputs per thread: each streams its own
// weights front to back.
ffi::Error Compute(ffi::ThreadPool& pool, const Dense& d, bool transposed) {
  if (d.rows == 0 || d.out == 0) return ffi::Error::Success();
  int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (transposed)
    kvjax::split(pool, d.out, threads,
                 [&d](int64_t b, int64_t e) { transposed_outputs(d, b, e); });
  else if (d.out < PANEL)  // the tail alone
    dense_outputs(d, 0, 0);
  else
    kvjax::split(pool, d.out / PANEL, threads,
                 [&d](int64_t b, int64_t e) { dense_outputs(d, b, e); });
  return ffi::Error::Success();
}

ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
               ffi::ResultBuffer<ffi::F32> y, bool transposed) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  int64_t in_axis = transposed ? 1 : 0;
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || wd[in_axis] != xd[1] ||
      wd[1 - in_axis] != yd[1] || yd[0] != xd[0])
    return ffi::Error::InvalidArgument(
        transposed ? "kvjax_product_t: want x[R, I], w[O, I] -> y[R, O]"
                   : "kvjax_product: want x[R, I], w[I, O] -> y[R, O]");
  return Compute(pool, Dense{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1],
                             yd[1]}, transposed);
}

ffi::Error Product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, x, w, y, false);
}

ffi::Error ProductT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, x, w, y, true);
}

// One layer's kernel of a stack w[L, I, O] (each layer packed), read in place: a loop over
// layers hands the whole stack and the layer's index, so no layer's weights are copied out.
ffi::Error ProductStacked(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[1] != xd[1] ||
      wd[2] != yd[1] || yd[0] != xd[0] || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "kvjax_product_stacked: want x[R, I], w[L, I, O], layer[1] -> y[R, O]");
  int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0])
    return ffi::Error::InvalidArgument("kvjax_product_stacked: layer out of range");
  return Compute(pool, Dense{x.typed_data(), w.typed_data() + l * wd[1] * wd[2],
                             y->typed_data(), xd[0], xd[1], yd[1]}, false);
}

}  // namespace

#define KVJAX_BIND                      \
  ffi::Ffi::Bind()                      \
      .Ctx<ffi::ThreadPool>()           \
      .Arg<ffi::Buffer<ffi::F32>>()     \
      .Arg<ffi::Buffer<ffi::F32>>()     \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxProduct, Product, KVJAX_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxProductT, ProductT, KVJAX_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxProductStacked, ProductStacked,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" const char* kvjax_product_isa() { return ISA; }

// Both products on the calling thread, without XLA (tests compare builds for other vector
// widths: tests/test_cpu_kernel.py). w as kvjax_product (packed) or kvjax_product_t takes it.
extern "C" void kvjax_product_raw(const float* x, const float* w, float* y, int64_t rows,
                                  int64_t in, int64_t out, int transposed) {
  Dense d{x, w, y, rows, in, out};
  if (transposed)
    transposed_outputs(d, 0, out);
  else
    dense_outputs(d, 0, out / PANEL);
}

// Sixteen-lane fused multiply-adds a second on the calling thread (12 independent chains,
// `iters` rounds): the arithmetic rate no product can pass (kvjax bench kernel).
extern "C" double kvjax_fma_rate(int64_t iters) {
  constexpr int CHAINS = 12;
  Vec acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = splat(1.0f + i * 1e-3f);
  Vec b = splat(0.999999f), c = splat(1e-7f);
  auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < CHAINS; ++i) acc[i] = fma(acc[i], b, c);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float lanes[LANES], total = 0.0f;
  for (int i = 0; i < CHAINS; ++i) {
    store(lanes, acc[i]);
    total += lanes[0];
  }
  volatile float keep = total;  // the chains' results are used: the loop stays
  (void)keep;
  return CHAINS * static_cast<double>(iters) / seconds;
}
