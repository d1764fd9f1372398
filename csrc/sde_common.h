// Shared pieces of the C++ (CPU) fused SDE ops: the coefficient table layout, float32 views of
// float32 / bfloat16 / float16 inputs a chunk at a time, and the deterministic reductions.
//
// The math is in kernels/coefficients.py: mean = ca x + cb v per sample; log_prob = lp_scale S +
// lp_const with S the sum of (sample - mean)^2 over the reduced elements; kl = kl_scale sum (v - v_ref)^2.
// Every input is read in its storage dtype and converted to float32 in chunks that stay in L1; all
// per-element math is float32. Reductions: float32 inside a chunk (vectorised), float64 across chunks,
// always in the same order whatever the number of threads, so results are bitwise reproducible.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace stepfast {

// Columns of the [B, kNumCoefs] float32 table (kernels/coefficients.py keeps the same order).
enum Coef : int64_t { CA = 0, CB, STD, LP_SCALE, LP_CONST, KL_SCALE, GLP, GKL, kNumCoefs };

// The per-chunk loops are compiled twice, for AVX2 and for the x86-64 baseline (SSE2), and the
// loader picks one per process from the CPU it runs on (GCC/Clang function multiversioning): the
// baseline alone is compute-bound at half a copy's bandwidth. Both clones round alike element by
// element (no FMA: -ffp-contract=off) and sum in the order Lanes fixes below, so they give the same
// bits: the step op's log-prob is the log-prob op's on any x86-64 CPU (the tests run the clone of the
// CPU they run on, and check that order). Clang does not clone templates: one build there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define STEPFAST_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define STEPFAST_SIMD_CLONES
#endif

// Elements per chunk: a few float32 buffers of this size fit in L1 beside the streams.
constexpr int64_t kChunk = 1024;

// A chunk's float32 sum of squares runs in kLanes partial sums: lane k adds the elements i = k (mod
// kLanes) in order, then the lanes fold pairwise (k + w into k, w = kLanes/2 ... 1). The order is the
// source's, not the compiler's vectorisation of a reduction, so every build and vector width (SSE2's
// 4 floats, AVX2's 8) sums alike, and the step op and the log-prob op, which both sum through Lanes,
// agree bit for bit. 32 lanes are 4 AVX2 registers (independent additions), each adding 32 elements
// of a 1,024-element chunk.
constexpr int64_t kLanes = 32;

struct Lanes {
  alignas(64) float lane[kLanes] = {};
  float fold() {
    for (int64_t w = kLanes / 2; w > 0; w /= 2)
      for (int64_t k = 0; k < w; ++k) lane[k] += lane[k + w];
    return lane[0];
  }
};

// Calls one(i, k) for every i in [0, n), with its lane k = i mod kLanes: the whole rows of kLanes as
// one vectorised loop, then the rest. The per-chunk loops of both ops go through it, so their sums
// take Lanes' order alike.
template <typename F>
inline void for_each_lane(int64_t n, F&& one) {
  int64_t i0 = 0;
  for (; i0 + kLanes <= n; i0 += kLanes) {
#pragma omp simd
    for (int64_t k = 0; k < kLanes; ++k) one(i0 + k, k);
  }
  for (int64_t k = 0; i0 + k < n; ++k) one(i0 + k, k);
}

struct In {
  const void* data;
  at::ScalarType dtype;
};

struct Out {
  void* data;
  at::ScalarType dtype;
};

inline In in_of(const at::Tensor& t) { return {t.const_data_ptr(), t.scalar_type()}; }
inline Out out_of(at::Tensor& t) { return {t.mutable_data_ptr(), t.scalar_type()}; }

// Elements [off, off + n) of `in` as float32: a pointer into the tensor itself when it is float32,
// else converted into `buf` (n <= kChunk).
inline const float* load(const In& in, int64_t off, int64_t n, float* buf) {
  switch (in.dtype) {
    case at::kFloat:
      return static_cast<const float*>(in.data) + off;
    case at::kBFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(in.data) + off;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        uint32_t bits = uint32_t(src[i]) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof(f));
        buf[i] = f;
      }
      return buf;
    }
    case at::kHalf: {
      const c10::Half* src = static_cast<const c10::Half*>(in.data) + off;
      for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
      return buf;
    }
    default:
      TORCH_CHECK(false, "stepfast: unsupported dtype ", in.dtype);
  }
}

// Where to compute n float32 outputs at `off`: into the tensor itself when it is float32, else into
// `buf`, which `flush` then rounds (to nearest even) into the tensor.
inline float* dest(const Out& out, int64_t off, float* buf) {
  return out.dtype == at::kFloat ? static_cast<float*>(out.data) + off : buf;
}

inline void flush(const Out& out, int64_t off, int64_t n, const float* buf) {
  switch (out.dtype) {
    case at::kFloat:
      return;
    case at::kBFloat16: {
      c10::BFloat16* dst = static_cast<c10::BFloat16*>(out.data) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(buf[i]);
      return;
    }
    case at::kHalf: {
      c10::Half* dst = static_cast<c10::Half*>(out.data) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(buf[i]);
      return;
    }
    default:
      TORCH_CHECK(false, "stepfast: unsupported dtype ", out.dtype);
  }
}

// The work split that both the step op and the log-prob op use, so that the rollout's log-prob and
// the training side's recomputed one agree bit for bit (on-policy ratio exactly 1).
//   per-sample reduce: items (b, chunk of kChunk elements of the flattened sample)
//   tokens reduce:     items (b, row of patches hp); an item covers channels x p rows x W columns,
//                      walked as rows of W split in pieces of whole patches.
struct Layout {
  int64_t batch, numel;           // B, N = elements per sample
  int64_t channels, height, width, patch;  // tokens only (patch = 0: per-sample reduce)
  int64_t items() const { return patch ? batch * (height / patch) : batch * chunks(); }
  int64_t chunks() const { return (numel + kChunk - 1) / kChunk; }
  int64_t piece() const { return (kChunk / patch) * patch; }  // row piece: whole patches
  int64_t tokens_w() const { return width / patch; }
  int64_t tokens() const { return (height / patch) * (width / patch); }
};

inline Layout layout_of(const at::Tensor& x, int64_t patch) {
  Layout l{x.size(0), x.size(0) ? x.numel() / x.size(0) : 0, 0, 0, 0, patch};
  if (patch) {
    TORCH_CHECK(x.dim() == 4, "stepfast: reduce='tokens' needs [B, C, H, W] latents, got ", x.sizes());
    l.channels = x.size(1);
    l.height = x.size(2);
    l.width = x.size(3);
    TORCH_CHECK(l.height % patch == 0 && l.width % patch == 0, "stepfast: latent size ", l.height, "x",
                l.width, " is not divisible by patch_size ", patch);
    // a row piece holds whole patches of at most kChunk elements: a wider patch would make it empty
    TORCH_CHECK(patch <= kChunk, "stepfast: patch_size ", patch, " is above ", kChunk,
                ", the widest the CPU kernels take");
  }
  return l;
}

// Calls f(off, n, tok0) for every piece of item `item` (tokens layout): off is the flat offset of the
// piece, n its length, tok0 the patch column of its first element.
template <typename F>
inline void for_each_piece(const Layout& l, int64_t item, F&& f) {
  const int64_t rows_p = l.height / l.patch;
  const int64_t b = item / rows_p, hp = item % rows_p;
  const int64_t piece = l.piece();
  for (int64_t c = 0; c < l.channels; ++c) {
    for (int64_t r = 0; r < l.patch; ++r) {
      const int64_t row = b * l.numel + c * l.height * l.width + (hp * l.patch + r) * l.width;
      for (int64_t w0 = 0; w0 < l.width; w0 += piece) {
        const int64_t n = std::min(piece, l.width - w0);
        f(row + w0, n, w0 / l.patch);
      }
    }
  }
}

// Adds the patch sums of n squared residuals (n a multiple of p) to tok[tok0 ...].
inline void add_patch_sums(const float* sq, int64_t n, int64_t p, int64_t tok0, double* tok) {
  for (int64_t j = 0; j < n / p; ++j) {
    float acc = 0.f;
    for (int64_t q = 0; q < p; ++q) acc += sq[j * p + q];
    tok[tok0 + j] += acc;
  }
}

inline void check_table(const at::Tensor& coef, int64_t batch) {
  TORCH_CHECK(coef.scalar_type() == at::kFloat && coef.is_contiguous() && coef.dim() == 2 &&
                  coef.size(0) == batch && coef.size(1) == kNumCoefs,
              "stepfast: coefficient table must be contiguous float32 [", batch, ", ", int64_t(kNumCoefs),
              "], got ", coef.sizes(), " ", coef.scalar_type());
}

inline void check_input(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "stepfast: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.sizes() == like.sizes(), "stepfast: ", name, " has shape ", t.sizes(), ", expected ",
              like.sizes());
  TORCH_CHECK(t.is_contiguous(), "stepfast: ", name, " must be contiguous");
  const auto d = t.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf, "stepfast: ", name,
              " must be float32, bfloat16 or float16, got ", d);
}

// Threads for a loop over `items` work items covering `elements` elements: at most torch's thread
// count, and one thread per kMinElementsPerThread elements (a parallel region costs more than it
// saves on small inputs, and much more when the cores are shared).
constexpr int64_t kMinElementsPerThread = 1 << 16;
inline int num_threads(int64_t items, int64_t elements) {
  const int64_t by_size = std::max<int64_t>(1, elements / kMinElementsPerThread);
  return static_cast<int>(std::max<int64_t>(1, std::min({int64_t(at::get_num_threads()), items, by_size})));
}

}  // namespace stepfast
