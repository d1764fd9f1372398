// stepfast::sde_step: one sampler step and its log-probability in one pass over memory (CPU).
//
//     mean = ca x_t + cb v,   sample = mean + std noise,   log_prob = lp_scale sum (sample - mean)^2 + lp_const
//
// with the per-sample coefficients of kernels/coefficients.py. The residual is formed as
// (sample - mean) from the rounded float32 sample, exactly as stepfast::sde_logprob forms it from the
// stored sample, so the two ops give the same log-prob bit for bit on the same step.
#include <torch/library.h>

#include <vector>

#include "sde_common.h"

namespace stepfast {
namespace {

// sample[i] = mean + std z; returns sum (sample - mean)^2 (in Lanes' order), or stores the squares in
// sq (tokens).
template <bool TOKENS>
STEPFAST_SIMD_CLONES float step_chunk(const float* x, const float* v, const float* z, float* out, float* sq, int64_t n,
                        float ca, float cb, float sd) {
  Lanes acc;
  const auto one = [&](int64_t i, int64_t k) {
    const float m = ca * x[i] + cb * v[i];
    const float smp = m + sd * z[i];
    out[i] = smp;
    const float d = smp - m;
    if (TOKENS)
      sq[i] = d * d;
    else
      acc.lane[k] += d * d;
  };
  for_each_lane(n, one);
  return TOKENS ? 0.f : acc.fold();
}

std::tuple<at::Tensor, at::Tensor> sde_step_cpu(const at::Tensor& x_t, const at::Tensor& v, const at::Tensor& noise,
                                                const at::Tensor& coef, int64_t patch_size, bool with_logprob) {
  TORCH_CHECK(x_t.dim() >= 1, "stepfast::sde_step: x_t needs a batch dimension");
  check_input(x_t, x_t, "x_t");
  check_input(v, x_t, "v");
  check_input(noise, x_t, "noise");
  const Layout l = layout_of(x_t, patch_size);
  check_table(coef, l.batch);
  at::Tensor sample = at::empty(x_t.sizes(), x_t.options().dtype(at::kFloat));
  at::Tensor log_prob = patch_size ? at::zeros({l.batch, l.tokens()}, sample.options())
                                   : at::zeros({l.batch}, sample.options());
  if (l.batch == 0 || l.numel == 0) return {sample, log_prob};

  const In xi = in_of(x_t), vi = in_of(v), zi = in_of(noise);
  float* out = sample.mutable_data_ptr<float>();
  const float* cf = coef.const_data_ptr<float>();
  const int64_t items = l.items();
  std::vector<double> partial(patch_size ? 0 : items);
  std::vector<double> tok(patch_size ? l.batch * l.tokens() : 0, 0.0);

#pragma omp parallel num_threads(num_threads(items, l.batch * l.numel))
  {
    alignas(64) float bx[kChunk], bv[kChunk], bz[kChunk], sq[kChunk];
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      if (patch_size == 0) {
        const int64_t b = item / l.chunks(), c0 = (item % l.chunks()) * kChunk;
        const int64_t n = std::min(kChunk, l.numel - c0), off = b * l.numel + c0;
        const float* k = cf + b * kNumCoefs;
        partial[item] = step_chunk<false>(load(xi, off, n, bx), load(vi, off, n, bv), load(zi, off, n, bz),
                                          out + off, sq, n, k[CA], k[CB], k[STD]);
      } else {
        const int64_t b = item / (l.height / l.patch), hp = item % (l.height / l.patch);
        const float* k = cf + b * kNumCoefs;
        double* t = tok.data() + b * l.tokens() + hp * l.tokens_w();
        for_each_piece(l, item, [&](int64_t off, int64_t n, int64_t tok0) {
          step_chunk<true>(load(xi, off, n, bx), load(vi, off, n, bv), load(zi, off, n, bz), out + off, sq, n,
                           k[CA], k[CB], k[STD]);
          add_patch_sums(sq, n, l.patch, tok0, t);
        });
      }
    }
  }
  if (!with_logprob) return {sample, log_prob};
  float* lp = log_prob.mutable_data_ptr<float>();
  for (int64_t b = 0; b < l.batch; ++b) {
    const double scale = cf[b * kNumCoefs + LP_SCALE], cst = cf[b * kNumCoefs + LP_CONST];
    if (patch_size == 0) {
      double s = 0.0;
      for (int64_t c = 0; c < l.chunks(); ++c) s += partial[b * l.chunks() + c];
      lp[b] = static_cast<float>(scale * s + cst);
    } else {
      for (int64_t j = 0; j < l.tokens(); ++j)
        lp[b * l.tokens() + j] = static_cast<float>(scale * tok[b * l.tokens() + j] + cst);
    }
  }
  return {sample, log_prob};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stepfast, m) {
  m.def(
      "sde_step(Tensor x_t, Tensor v, Tensor noise, Tensor coef, int patch_size, bool with_logprob) "
      "-> (Tensor sample, Tensor log_prob)");
}

TORCH_LIBRARY_IMPL(stepfast, CPU, m) { m.impl("sde_step", &sde_step_cpu); }

// The rollout step has no gradient: its outputs do not require grad (stepfast.kernels refuses inputs
// that need one, with a message that points to sde_logprob).
TORCH_LIBRARY_IMPL(stepfast, Autograd, m) { m.impl("sde_step", torch::CppFunction::makeFallthrough()); }

}  // namespace stepfast
