// stepfast::sde_logprob and its backward: the training-side log-prob of a stored sample, and the KL
// to the reference policy, in one pass over memory (CPU).
//
//     d = sample - (ca x_t + cb v)            log_prob = lp_scale sum d^2 + lp_const
//     dv = v - v_ref                          kl       = kl_scale sum dv^2
//
// Gradients (kernels/coefficients.py): d log_prob / d v = glp d, d kl / d v = gkl dv. When v needs a
// gradient the forward writes the residuals d (and dv) in float32 in the same pass, and the backward
// is one more pass:  grad_v = g_lp glp d + g_kl gkl dv,  grad_v_ref = -g_kl gkl dv  (g_lp per sample,
// or per patch for reduce='tokens'). Forward + backward then stream 6 tensors per element (read x_t, v,
// sample, write d; read d, write grad_v) instead of 7 when the backward recomputes d from the inputs;
// the residual costs one float32 latent of memory until the backward.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <vector>

#include "sde_common.h"

namespace stepfast {
namespace {

struct Sums {
  float lp, kl;
};

// Sums over the chunk (in Lanes' order) of d^2, or the squares in sq (tokens), and of dv^2.
template <bool TOKENS, bool KL, bool SAVE>
STEPFAST_SIMD_CLONES Sums logprob_chunk(const float* x, const float* v, const float* s, const float* vr, float* res, float* dvo,
                          float* sq, int64_t n, float ca, float cb) {
  Lanes acc, acck;
  const auto one = [&](int64_t i, int64_t k) {
    const float m = ca * x[i] + cb * v[i];
    const float d = s[i] - m;
    if (TOKENS)
      sq[i] = d * d;
    else
      acc.lane[k] += d * d;
    if (SAVE) res[i] = d;
    if (KL) {
      const float dv = v[i] - vr[i];
      acck.lane[k] += dv * dv;
      if (SAVE) dvo[i] = dv;
    }
  };
  for_each_lane(n, one);
  return {TOKENS ? 0.f : acc.fold(), KL ? acck.fold() : 0.f};
}

template <bool TOKENS, bool KL, bool SAVE>
void logprob_forward(const Layout& l, const In& xi, const In& vi, const In& si, const In& ri, const float* cf,
                     float* res, float* dvo, std::vector<double>& partial, std::vector<double>& partial_kl,
                     std::vector<double>& tok) {
  const int64_t items = l.items();
#pragma omp parallel num_threads(num_threads(items, l.batch * l.numel))
  {
    alignas(64) float bx[kChunk], bv[kChunk], bs[kChunk], br[kChunk], sq[kChunk];
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      if (!TOKENS) {
        const int64_t b = item / l.chunks(), c0 = (item % l.chunks()) * kChunk;
        const int64_t n = std::min(kChunk, l.numel - c0), off = b * l.numel + c0;
        const float* k = cf + b * kNumCoefs;
        const Sums r = logprob_chunk<false, KL, SAVE>(
            load(xi, off, n, bx), load(vi, off, n, bv), load(si, off, n, bs), KL ? load(ri, off, n, br) : nullptr,
            res + off, dvo + off, sq, n, k[CA], k[CB]);
        partial[item] = r.lp;
        partial_kl[item] = r.kl;
      } else {
        const int64_t b = item / (l.height / l.patch), hp = item % (l.height / l.patch);
        const float* k = cf + b * kNumCoefs;
        double* t = tok.data() + b * l.tokens() + hp * l.tokens_w();
        double kl = 0.0;
        for_each_piece(l, item, [&](int64_t off, int64_t n, int64_t tok0) {
          const Sums r = logprob_chunk<true, KL, SAVE>(
              load(xi, off, n, bx), load(vi, off, n, bv), load(si, off, n, bs), KL ? load(ri, off, n, br) : nullptr,
              res + off, dvo + off, sq, n, k[CA], k[CB]);
          add_patch_sums(sq, n, l.patch, tok0, t);
          kl += r.kl;
        });
        partial_kl[item] = kl;
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sde_logprob_cpu(
    const at::Tensor& x_t, const at::Tensor& v, const at::Tensor& sample, const std::optional<at::Tensor>& v_ref,
    const at::Tensor& coef, int64_t patch_size, bool save_residuals) {
  TORCH_CHECK(x_t.dim() >= 1, "stepfast::sde_logprob: x_t needs a batch dimension");
  check_input(x_t, x_t, "x_t");
  check_input(v, x_t, "v");
  check_input(sample, x_t, "sample");
  const bool kl = v_ref.has_value();
  if (kl) check_input(*v_ref, x_t, "v_ref");
  const Layout l = layout_of(x_t, patch_size);
  check_table(coef, l.batch);

  const auto f32 = x_t.options().dtype(at::kFloat);
  at::Tensor log_prob = patch_size ? at::empty({l.batch, l.tokens()}, f32) : at::empty({l.batch}, f32);
  at::Tensor kl_out = kl ? at::empty({l.batch}, f32) : at::empty({0}, f32);
  at::Tensor res = save_residuals ? at::empty(x_t.sizes(), f32) : at::empty({0}, f32);
  at::Tensor dvo = save_residuals && kl ? at::empty(x_t.sizes(), f32) : at::empty({0}, f32);

  const int64_t items = l.items();
  std::vector<double> partial(patch_size ? 0 : items), partial_kl(items, 0.0);
  std::vector<double> tok(patch_size ? l.batch * l.tokens() : 0, 0.0);
  const In xi = in_of(x_t), vi = in_of(v), si = in_of(sample);
  const In ri = kl ? in_of(*v_ref) : In{nullptr, at::kFloat};
  const float* cf = coef.const_data_ptr<float>();
  float* rp = save_residuals ? res.mutable_data_ptr<float>() : nullptr;
  float* dp = save_residuals && kl ? dvo.mutable_data_ptr<float>() : nullptr;

  if (l.numel > 0) {
#define STEPFAST_FWD(T, K, S) \
  logprob_forward<T, K, S>(l, xi, vi, si, ri, cf, rp, dp, partial, partial_kl, tok)
    const bool tokens = patch_size != 0;
    if (tokens) {
      if (kl) {
        save_residuals ? STEPFAST_FWD(true, true, true) : STEPFAST_FWD(true, true, false);
      } else {
        save_residuals ? STEPFAST_FWD(true, false, true) : STEPFAST_FWD(true, false, false);
      }
    } else {
      if (kl) {
        save_residuals ? STEPFAST_FWD(false, true, true) : STEPFAST_FWD(false, true, false);
      } else {
        save_residuals ? STEPFAST_FWD(false, false, true) : STEPFAST_FWD(false, false, false);
      }
    }
#undef STEPFAST_FWD
  }

  float* lp = log_prob.mutable_data_ptr<float>();
  float* klp = kl ? kl_out.mutable_data_ptr<float>() : nullptr;
  const int64_t per_b = items / std::max<int64_t>(l.batch, 1);
  for (int64_t b = 0; b < l.batch; ++b) {
    const double scale = cf[b * kNumCoefs + LP_SCALE], cst = cf[b * kNumCoefs + LP_CONST];
    if (patch_size == 0) {
      double s = 0.0;
      for (int64_t c = 0; c < per_b; ++c) s += partial[b * per_b + c];
      lp[b] = static_cast<float>(scale * s + cst);
    } else {
      for (int64_t j = 0; j < l.tokens(); ++j)
        lp[b * l.tokens() + j] = static_cast<float>(scale * tok[b * l.tokens() + j] + cst);
    }
    if (kl) {
      double s = 0.0;
      for (int64_t c = 0; c < per_b; ++c) s += partial_kl[b * per_b + c];
      klp[b] = static_cast<float>(double(cf[b * kNumCoefs + KL_SCALE]) * s);
    }
  }
  return {log_prob, kl_out, res, dvo};
}

// grad_v = alpha d + beta dv (alpha per element from g_lp glp, per sample or per patch), grad_vr = -beta dv.
// alpha: one value a0 for the chunk (per-sample reduce) or one per element (TOKENS).
template <bool LP, bool KL, bool VR, bool TOKENS>
STEPFAST_SIMD_CLONES void backward_chunk(const float* alpha, float a0, const float* d, const float* dv, float beta, float* gv,
                           float* gr, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float a = TOKENS ? alpha[i] : a0;
    float g = LP ? a * d[i] : 0.f;  // neither LP nor KL: zeros
    if (KL) {
      const float kd = beta * dv[i];
      g += kd;
      if (VR) gr[i] = -kd;
    }
    gv[i] = g;
  }
}

template <bool LP, bool KL, bool VR>
void logprob_backward(const Layout& l, const float* res, const float* dvp, const float* cf, const float* glp,
                      const float* gkl, const Out& gvo, const Out& gro) {
  const int64_t items = l.patch ? l.batch * (l.height / l.patch) : l.items();
#pragma omp parallel num_threads(num_threads(items, l.batch * l.numel))
  {
    alignas(64) float bg[kChunk], br[kChunk];
    std::vector<float> alpha_row(l.patch ? l.width : 0);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      if (!l.patch) {
        const int64_t b = item / l.chunks(), c0 = (item % l.chunks()) * kChunk;
        const int64_t n = std::min(kChunk, l.numel - c0), off = b * l.numel + c0;
        const float a0 = LP ? glp[b] * cf[b * kNumCoefs + GLP] : 0.f;
        const float beta = KL ? gkl[b] * cf[b * kNumCoefs + GKL] : 0.f;
        float* gv = dest(gvo, off, bg);
        float* gr = VR ? dest(gro, off, br) : nullptr;
        backward_chunk<LP, KL, VR, false>(nullptr, a0, LP ? res + off : nullptr, KL ? dvp + off : nullptr, beta, gv, gr, n);
        flush(gvo, off, n, gv);
        if (VR) flush(gro, off, n, gr);
      } else {
        const int64_t rows_p = l.height / l.patch, b = item / rows_p, hp = item % rows_p;
        const float beta = KL ? gkl[b] * cf[b * kNumCoefs + GKL] : 0.f;
        const float g0 = cf[b * kNumCoefs + GLP];
        // alpha per column of this row of patches, so the inner loop has no division
        for (int64_t w = 0; w < l.width; ++w)
          alpha_row[w] = LP ? glp[b * l.tokens() + hp * l.tokens_w() + w / l.patch] * g0 : 0.f;
        for_each_piece(l, item, [&](int64_t off, int64_t n, int64_t tok0) {
          float* gv = dest(gvo, off, bg);
          float* gr = VR ? dest(gro, off, br) : nullptr;
          backward_chunk<LP, KL, VR, true>(alpha_row.data() + tok0 * l.patch, 0.f, LP ? res + off : nullptr,
                                     KL ? dvp + off : nullptr, beta, gv, gr, n);
          flush(gvo, off, n, gv);
          if (VR) flush(gro, off, n, gr);
        });
      }
    }
  }
}

// grad_v -> gvo (and grad_v_ref -> gro when vr) from the saved residuals; gvo may be `residual` itself
// and gro `dv` itself (the in-place backward): every element is read before it is written.
void run_backward(const at::Tensor& residual, const at::Tensor& dv, const at::Tensor& coef,
                  const std::optional<at::Tensor>& grad_log_prob, const std::optional<at::Tensor>& grad_kl,
                  int64_t patch_size, bool vr, const Out& gvo, const Out& gro) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.dim() >= 1,
              "stepfast::sde_logprob_backward: residual must be contiguous float32");
  const Layout l = layout_of(residual, patch_size);
  check_table(coef, l.batch);
  const bool lp = grad_log_prob.has_value();
  const bool kl = grad_kl.has_value();
  if (kl)
    TORCH_CHECK(dv.sizes() == residual.sizes() && dv.scalar_type() == at::kFloat && dv.is_contiguous(),
                "stepfast::sde_logprob_backward: a KL gradient needs the float32 residual v - v_ref");
  at::Tensor glp_c, gkl_c;
  if (lp) {
    glp_c = grad_log_prob->to(at::kFloat).contiguous();
    TORCH_CHECK(glp_c.numel() == (patch_size ? l.batch * l.tokens() : l.batch),
                "stepfast::sde_logprob_backward: grad_log_prob has ", glp_c.numel(), " elements");
  }
  if (kl) {
    gkl_c = grad_kl->to(at::kFloat).contiguous();
    TORCH_CHECK(gkl_c.numel() == l.batch, "stepfast::sde_logprob_backward: grad_kl has ", gkl_c.numel(), " elements");
  }
  if (l.numel == 0) return;
  const float* cf = coef.const_data_ptr<float>();
  const float* res = residual.const_data_ptr<float>();
  const float* dvp = kl ? dv.const_data_ptr<float>() : nullptr;
  const float* glp = lp ? glp_c.const_data_ptr<float>() : nullptr;
  const float* gkl = kl ? gkl_c.const_data_ptr<float>() : nullptr;
#define STEPFAST_BWD(L, K, V) logprob_backward<L, K, V>(l, res, dvp, cf, glp, gkl, gvo, gro)
  if (lp && kl && vr)
    STEPFAST_BWD(true, true, true);
  else if (lp && kl)
    STEPFAST_BWD(true, true, false);
  else if (lp)
    STEPFAST_BWD(true, false, false);
  else if (kl && vr)
    STEPFAST_BWD(false, true, true);
  else if (kl)
    STEPFAST_BWD(false, true, false);
  else
    STEPFAST_BWD(false, false, false);  // no gradient flows in: zeros
#undef STEPFAST_BWD
}

std::tuple<at::Tensor, at::Tensor> sde_logprob_backward_cpu(const at::Tensor& residual, const at::Tensor& dv,
                                                            const at::Tensor& coef,
                                                            const std::optional<at::Tensor>& grad_log_prob,
                                                            const std::optional<at::Tensor>& grad_kl,
                                                            int64_t patch_size, at::ScalarType v_dtype,
                                                            std::optional<at::ScalarType> v_ref_dtype) {
  const bool vr = grad_kl.has_value() && v_ref_dtype.has_value();
  at::Tensor grad_v = at::empty(residual.sizes(), residual.options().dtype(v_dtype));
  at::Tensor grad_vr = vr ? at::empty(residual.sizes(), residual.options().dtype(*v_ref_dtype))
                          : at::empty({0}, residual.options());
  run_backward(residual, dv, coef, grad_log_prob, grad_kl, patch_size, vr, out_of(grad_v),
               vr ? out_of(grad_vr) : Out{nullptr, at::kFloat});
  return {grad_v, grad_vr};
}

// The same, turning the float32 residuals into the float32 gradients in place: no allocation, and each
// cache line is read and written once (a separate output costs a read-for-ownership more).
void sde_logprob_backward_inplace_cpu(at::Tensor& residual, at::Tensor& dv, const at::Tensor& coef,
                                      const std::optional<at::Tensor>& grad_log_prob,
                                      const std::optional<at::Tensor>& grad_kl, int64_t patch_size, bool v_ref_grad) {
  const bool vr = grad_kl.has_value() && v_ref_grad;
  run_backward(residual, dv, coef, grad_log_prob, grad_kl, patch_size, vr, out_of(residual),
               vr ? out_of(dv) : Out{nullptr, at::kFloat});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stepfast, m) {
  m.def(
      "sde_logprob(Tensor x_t, Tensor v, Tensor sample, Tensor? v_ref, Tensor coef, int patch_size, "
      "bool save_residuals) -> (Tensor log_prob, Tensor kl, Tensor residual, Tensor dv)");
  m.def(
      "sde_logprob_backward(Tensor residual, Tensor dv, Tensor coef, Tensor? grad_log_prob, Tensor? grad_kl, "
      "int patch_size, ScalarType v_dtype, ScalarType? v_ref_dtype) -> (Tensor grad_v, Tensor grad_v_ref)");
  m.def(
      "sde_logprob_backward_(Tensor(a!) residual, Tensor(b!) dv, Tensor coef, Tensor? grad_log_prob, "
      "Tensor? grad_kl, int patch_size, bool v_ref_grad) -> ()");
}

TORCH_LIBRARY_IMPL(stepfast, CPU, m) {
  m.impl("sde_logprob", &sde_logprob_cpu);
  m.impl("sde_logprob_backward", &sde_logprob_backward_cpu);
  m.impl("sde_logprob_backward_", &sde_logprob_backward_inplace_cpu);
}

// The backward has no derivative of its own (no double backward): asking for one is an error, not a
// silent zero. sde_logprob's autograd formula is registered from Python (kernels/cpp.py).
TORCH_LIBRARY_IMPL(stepfast, Autograd, m) {
  m.impl("sde_logprob_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("sde_logprob_backward_", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(stepfast, ADInplaceOrView, m) {
  m.impl("sde_logprob_backward_", torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}

}  // namespace stepfast
