// Paged attention for XLA CPU that reads the pages in place, called from JAX as the FFI
// target kvjax_attention (kvjax/cpu/attention.py builds the call):
//   out[B, T, N, H] = attention of queries q[B, T, N, H] (already scaled) over the keys and
//   values a layer's paged pool [layers, K, pages, page_size, H] holds for each sequence.
//
// Each query is computed alone, its keys visited by absolute position, so its bits depend
// on its own history and nothing else: not on the batch, the chunk it came in, the page
// table's padding or the thread that ran it. The order of every sum is written out here and
// repeated by kvjax.cpu.attention.reference (numpy), which must give the same bits:
// - score(q, k): 16 lanes, lane l the running sum over h = l, l + 16, ... (ascending, H
//   zero-padded to a multiple of 16) of q[h] * k[h], each product and sum rounded on its
//   own (no fused multiply-add); then the lanes added in one fixed tree (tree16);
// - m = the largest score the query sees; e_p = expf_(score_p - m) (expf_ below);
// - l = tree16 of 16 lanes, lane p mod 16 the running sum of e_p (p the key's position);
// - acc[h] = the running sum of e_p * v_p[h] over the keys in ascending position;
// - out[h] = acc[h] / l.
// Only elementwise loops over lanes are left to the compiler to vectorize, which without
// -ffast-math keeps each lane's operations as written, and tree16's vector form adds the
// same pairs as its scalar one: every build gives the same bits.
//
// Which keys a query sees: query t of sequence b sits at position pos = lengths[b] + t (a
// tree verify: lengths[b] + depth[b, t]) and sees positions max(0, pos - window + 1) .. pos
// (window 0: from 0). A position p < lengths[b] is cache slot p; in a tree verify a
// position lengths[b] + j is slot lengths[b] + ancestors[b, t, j], where the query's
// ancestor at depth j was written. A slot s is row s % page_size of page
// page_table[b, s / page_size]. Queries t >= num_new[b] are padding: their output is 0.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "split.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t LANES = 16;

// The 16 floats at f added in one fixed tree: f[l] + f[l + 8], then + 4, + 2, + 1.
inline float tree16(const float* f) {
#if defined(__AVX512F__) || defined(__AVX2__)
  __m256 a = _mm256_add_ps(_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
  return _mm_cvtss_f32(b);
#else
  float t[LANES];
  std::copy(f, f + LANES, t);
  for (int64_t step = LANES / 2; step > 0; step /= 2)
    for (int64_t l = 0; l < step; ++l) t[l] = t[l] + t[l + step];
  return t[0];
#endif
}

// e^x for x <= 0 in float32, ~2 ulp: Cody-Waite range reduction x = n ln2 + r and a degree
// 7 polynomial (Cephes' expf), each operation rounded on its own. Below -87 it is 0, so
// the result is never subnormal (whether a thread flushes subnormals cannot matter).
inline float expf_(float x) {
  float under = x >= -87.0f ? 1.0f : 0.0f;  // a select, not a branch: the loop vectorizes
  x = x >= -87.0f ? x : -87.0f;
  float n = std::nearbyint(x * 1.44269504088896341f);
  float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two;
  std::memcpy(&two, &bits, sizeof two);
  return under > 0.0f ? p * two : 0.0f;
}

// A stored element as float32: float32 as it is, bfloat16 (its bits, uint16) widened.
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename E>
struct Paged {
  const float* q;      // [B, T, N, H]
  const E* k;          // [layers, K, pages, page_size, H]
  const E* v;
  const int32_t* table;    // [B, pages_per_seq]
  const int32_t* lengths;  // [B]
  const int32_t* num_new;  // [B]
  const int32_t* depth;    // [B, T] (tree verify) or nullptr
  const int32_t* anc;      // [B, T, T] (tree verify) or nullptr
  float* out;              // [B, T, N, H]
  int64_t layer, b, t, n, k_heads, h, pages, page_size, per_seq, window;
};

// The row of `pool` (keys or values) at `slot` of sequence `b`, KV head `kv`, as float32
// zero-padded to `hp` in `buf`.
template <typename E>
const float* row(const Paged<E>& a, const E* pool, int64_t b, int64_t kv, int64_t slot,
                 int64_t hp, float* buf) {
  int64_t page = a.table[b * a.per_seq + slot / a.page_size];
  const E* src = pool + (((a.layer * a.k_heads + kv) * a.pages + page) * a.page_size +
                         slot % a.page_size) * a.h;
  if constexpr (std::is_same_v<E, float>)
    if (a.h == hp) return src;
  for (int64_t i = 0; i < a.h; ++i) buf[i] = widen(src[i]);
  for (int64_t i = a.h; i < hp; ++i) buf[i] = 0.0f;
  return buf;
}

// Scratch of one thread: a group's queries, its scores, one key or value row.
struct Scratch {
  std::vector<float> q, s, kv, acc;
};

// Query `t` of sequence `b`, the query heads of KV head `kv` (G = n / k_heads of them).
template <typename E>
void query(const Paged<E>& a, int64_t b, int64_t t, int64_t kv, Scratch& w) {
  int64_t g_heads = a.n / a.k_heads, hp = (a.h + LANES - 1) / LANES * LANES;
  float* out = a.out + ((b * a.t + t) * a.n + kv * g_heads) * a.h;
  if (t >= a.num_new[b]) {
    std::fill(out, out + g_heads * a.h, 0.0f);
    return;
  }
  int64_t len = a.lengths[b];
  int64_t pos = len + (a.depth ? a.depth[b * a.t + t] : t);
  int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
  int64_t keys = pos - lo + 1;
  const int32_t* anc = a.anc ? a.anc + (b * a.t + t) * a.t : nullptr;
  auto slot = [&](int64_t p) { return p < len || !anc ? p : len + anc[p - len]; };

  w.q.assign(g_heads * hp, 0.0f);
  for (int64_t g = 0; g < g_heads; ++g)
    std::copy(a.q + ((b * a.t + t) * a.n + kv * g_heads + g) * a.h,
              a.q + ((b * a.t + t) * a.n + kv * g_heads + g + 1) * a.h, &w.q[g * hp]);
  w.s.resize(g_heads * keys);
  w.kv.resize(hp);
  w.acc.assign(g_heads * hp, 0.0f);

  for (int64_t p = lo; p <= pos; ++p) {
    const float* kr = row(a, a.k, b, kv, slot(p), hp, w.kv.data());
    for (int64_t g = 0; g < g_heads; ++g) {
      const float* qg = &w.q[g * hp];
      float lane[LANES] = {};
      for (int64_t i = 0; i < hp; i += LANES)
        for (int64_t l = 0; l < LANES; ++l) lane[l] = lane[l] + qg[i + l] * kr[i + l];
      w.s[g * keys + (p - lo)] = tree16(lane);
    }
  }
  for (int64_t g = 0; g < g_heads; ++g) {
    float* s = &w.s[g * keys];
    float m = *std::max_element(s, s + keys);
    for (int64_t j = 0; j < keys; ++j) s[j] = expf_(s[j] - m);
  }
  for (int64_t p = lo; p <= pos; ++p) {
    const float* vr = row(a, a.v, b, kv, slot(p), hp, w.kv.data());
    for (int64_t g = 0; g < g_heads; ++g) {
      float e = w.s[g * keys + (p - lo)];
      float* acc = &w.acc[g * hp];
      for (int64_t i = 0; i < hp; ++i) acc[i] = acc[i] + e * vr[i];
    }
  }
  for (int64_t g = 0; g < g_heads; ++g) {
    float lane[LANES] = {};
    const float* e = &w.s[g * keys];
    for (int64_t p = lo; p <= pos; ++p) lane[p % LANES] = lane[p % LANES] + e[p - lo];
    float l = tree16(lane);
    for (int64_t i = 0; i < a.h; ++i) out[g * a.h + i] = w.acc[g * hp + i] / l;
  }
}

// Tasks [begin, end) of the B * K * T (sequence, KV head, query): a thread's queries of
// one KV head follow each other, so a chunk's keys and values stay in its cache.
template <typename E>
void queries(const Paged<E>& a, int64_t begin, int64_t end) {
  Scratch w;
  for (int64_t task = begin; task < end; ++task)
    query(a, task / (a.k_heads * a.t), task % a.t, task / a.t % a.k_heads, w);
}

template <typename E>
ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
               ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> table,
               ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> num_new,
               ffi::Buffer<ffi::S32> depth, ffi::Buffer<ffi::S32> anc,
               ffi::ResultBuffer<ffi::F32> out, int64_t window, bool tree) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = table.dimensions();
  Paged<E> a{q.typed_data(), static_cast<const E*>(k.untyped_data()),
             static_cast<const E*>(v.untyped_data()), table.typed_data(),
             lengths.typed_data(), num_new.typed_data(),
             tree ? depth.typed_data() : nullptr, tree ? anc.typed_data() : nullptr,
             out->typed_data(), layer.typed_data()[0], qd[0], qd[1], qd[2], kd[1], qd[3],
             kd[2], kd[3], td[1], window};
  // ranges of queries several per thread: their costs differ with their keys
  int64_t units = a.b * a.t * a.k_heads;
  kvjax::split(pool, units, 4 * std::max<int64_t>(pool.num_threads(), 1),
               [&a](int64_t b, int64_t e) { queries(a, b, e); });
  return ffi::Error::Success();
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                     ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer,
                     ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                     ffi::Buffer<ffi::S32> num_new, ffi::Buffer<ffi::S32> depth,
                     ffi::Buffer<ffi::S32> anc, ffi::ResultBuffer<ffi::F32> out,
                     int64_t window, bool tree) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2 || kd[4] != qd[3] ||
      k.element_type() != v.element_type() || kd[1] == 0 || qd[2] % kd[1] != 0 ||
      td[0] != qd[0] || lengths.element_count() != static_cast<size_t>(qd[0]) ||
      num_new.element_count() != static_cast<size_t>(qd[0]) ||
      (tree && (depth.element_count() != static_cast<size_t>(qd[0] * qd[1]) ||
                anc.element_count() != static_cast<size_t>(qd[0] * qd[1] * qd[1]))))
    return ffi::Error::InvalidArgument(
        "kvjax_attention: want q[B, T, N, H], pools [layers, K, pages, page_size, H] with "
        "N % K == 0, page_table[B, P], lengths[B], num_new[B] (tree: depth[B, T], "
        "ancestors[B, T, T])");
  switch (k.element_type()) {
    case ffi::DataType::F32:
      return Run<float>(pool, q, k, v, layer, table, lengths, num_new, depth, anc, out,
                        window, tree);
    case ffi::DataType::U16:
    case ffi::DataType::BF16:
      return Run<uint16_t>(pool, q, k, v, layer, table, lengths, num_new, depth, anc, out,
                           window, tree);
    default:
      return ffi::Error::InvalidArgument(
          "kvjax_attention: pages of float32 or bfloat16 (or its bits, uint16) only");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<bool>("tree"));

// Float32 pages, a chain (no tree), on the calling thread, without XLA (tests compare
// builds for other vector widths: tests/test_cpu_kernel.py). dims: layer, B, T, N, K, H,
// pages, page_size, pages a sequence, window.
extern "C" void kvjax_attention_raw(const float* q, const float* k, const float* v,
                                    const int32_t* table, const int32_t* lengths,
                                    const int32_t* num_new, float* out, const int64_t* dims) {
  Paged<float> a{q,       k,       v,       table,   lengths, num_new, nullptr,
                 nullptr, out,     dims[0], dims[1], dims[2], dims[3], dims[4],
                 dims[5], dims[6], dims[7], dims[8], dims[9]};
  queries(a, 0, a.b * a.t * a.k_heads);
}
