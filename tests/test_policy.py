"""The policy's velocity call: what the SD3 transformer is given."""

import importlib.util
import re

import pytest
import torch

from stepfast.models import load_pipeline
from stepfast.models.tiny import tiny_pipeline_dir
from stepfast.policy import encode_prompts, latent_shape, text_length, velocity
from stepfast.sde import sd3_time_grid


def test_a_bf16_transformer_gets_float32_timesteps(tmp_path):
    """diffusers embeds the timestep in float32 and casts after: the policy passes t * 1000 in float32,
    as the pipeline does, whatever the weights' dtype. In bf16 the 10-step grid's 602.15 would be 604,
    and every velocity of that step would be the model's at another time than the sampler's."""
    pipe = load_pipeline(tiny_pipeline_dir(tmp_path, seed=0), dtype=torch.bfloat16)
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["timestep"]),
                                               with_kwargs=True)  # fmt: skip
    cond = encode_prompts(pipe, ["a photo of a red circle", "a photo of two squares"], 4.5, torch.device("cpu"))
    x = torch.randn(2, *latent_shape(pipe, 1, pipe.default_sample_size * pipe.vae_scale_factor)[1:])
    t = sd3_time_grid(10)[[6, 7]].float()  # .6022, .4649
    v = velocity(pipe.transformer, x, t, cond, 4.5)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    assert seen[0].dtype == torch.float32
    assert torch.equal(seen[0], torch.cat([t, t]) * 1000)
    assert not torch.equal(seen[0].to(torch.bfloat16).float(), seen[0])  # the grid is not bf16-exact


def _transformer(pipe, x, t, embeds, pooled):
    return pipe.transformer(hidden_states=x, timestep=t * 1000, encoder_hidden_states=embeds,
                            pooled_projections=pooled, return_dict=False)[0]  # fmt: skip


def test_guided_velocity_is_unconditional_plus_scale_times_the_difference(tmp_path):
    """v = v_u + w (v_c - v_u) with v_u from the empty prompt's embeddings and v_c from the prompt's,
    each transformer call made here on its own; w <= 1 gives v_c alone, unguided."""
    pipe = load_pipeline(tiny_pipeline_dir(tmp_path, seed=0))
    cond = encode_prompts(pipe, ["a photo of a red circle", "a photo of two squares"], 4.5, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, *latent_shape(pipe, 1, pipe.default_sample_size * pipe.vae_scale_factor)[1:], generator=g)
    t = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v_c = _transformer(pipe, x, t, cond.embeds, cond.pooled)
        v_u = _transformer(pipe, x, t, cond.neg_embeds, cond.neg_pooled)
        assert (v_c - v_u).abs().max() > 1e-3  # the prompt matters to this model
        torch.testing.assert_close(velocity(pipe.transformer, x, t, cond, 4.5), v_u + 4.5 * (v_c - v_u),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
        unguided = encode_prompts(pipe, ["a photo of a red circle", "a photo of two squares"], 1.0, torch.device("cpu"))
        torch.testing.assert_close(velocity(pipe.transformer, x, t, unguided, 1.0), v_c, rtol=1e-5, atol=1e-6)


def test_the_reference_policy_is_the_base_model_with_the_adapter_off(tmp_path):
    """Inside reference_policy the LoRA-wrapped transformer computes what the model loaded without
    LoRA computes; outside it, its adapter (given non-zero weights here) changes the output again."""
    from stepfast.config import load_config
    from stepfast.policy import load_policy_pipeline, reference_policy

    model = tiny_pipeline_dir(tmp_path, seed=0)
    base = load_pipeline(model)
    pipe = load_policy_pipeline(load_config("default", [f"model.path={model}"]).model, torch.device("cpu"))
    with torch.no_grad():
        for name, p in pipe.transformer.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: the adapter would change nothing yet
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    cond = encode_prompts(base, ["a photo of a red circle"], 1.0, torch.device("cpu"))
    x = torch.randn(1, *latent_shape(base, 1, base.default_sample_size * base.vae_scale_factor)[1:],
                    generator=torch.Generator().manual_seed(0))  # fmt: skip
    t = torch.tensor([0.7])
    with torch.no_grad():
        want = velocity(base.transformer, x, t, cond, 1.0)
        adapted = velocity(pipe.transformer, x, t, cond, 1.0)
        with reference_policy(pipe.transformer) as reference:
            inside = velocity(reference, x, t, cond, 1.0)
        after = velocity(pipe.transformer, x, t, cond, 1.0)
    assert (adapted - want).abs().max() > 1e-3
    torch.testing.assert_close(inside, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after, adapted, rtol=0, atol=0)


def test_the_adapter_has_the_configured_rank_scale_and_targets(tmp_path):
    """model.lora_rank, lora_alpha and lora_targets reach peft: rank r, scale alpha / r, and LoRA on
    the named projections only, trainable in fp32 (optimizer states stay exact) over a frozen bf16
    base."""
    from stepfast.config import load_config
    from stepfast.policy import load_policy_pipeline

    model = tiny_pipeline_dir(tmp_path, seed=0)
    cfg = load_config("default", [f"model.path={model}", "model.lora_rank=4", "model.lora_alpha=12",
                                  "model.lora_targets=[attn.to_q, attn.to_v]", "model.dtype=bf16"])  # fmt: skip
    transformer = load_policy_pipeline(cfg.model, torch.device("cpu")).transformer
    assert transformer.proj_out.weight.dtype == torch.bfloat16  # the frozen base, in model.dtype
    adapted = {name: module for name, module in transformer.named_modules() if hasattr(module, "lora_A")}
    assert adapted and all(name.endswith(("attn.to_q", "attn.to_v")) for name in adapted)
    for module in adapted.values():
        assert module.r["default"] == 4 and module.scaling["default"] == pytest.approx(12 / 4)
    trainable = [(n, p) for n, p in transformer.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable)


@pytest.mark.parametrize("targets, named", [
    ("[attn.to_qq]", "'attn.to_qq' (did you mean 'attn.to_q'?) matches no module"),
    # one target mistyped beside good ones: peft alone would train the others and say nothing
    ("[attn.to_q, attn.to_kk, mlp.fc1]", "'attn.to_kk' (did you mean 'attn.to_k'?), 'mlp.fc1' match no module"),
])  # fmt: skip
def test_lora_targets_that_match_no_module_are_named(tmp_path, targets, named):
    from stepfast.config import load_config
    from stepfast.policy import load_policy_pipeline

    cfg = load_config("default", [f"model.path={tiny_pipeline_dir(tmp_path)}", f"model.lora_targets={targets}"])
    with pytest.raises(ValueError) as err:
        load_policy_pipeline(cfg.model, torch.device("cpu"))
    message = str(err.value)
    assert message.startswith(f"model.lora_targets: {named} of the transformer; its linear layers are ")
    listed = message.rsplit("its linear layers are ", 1)[1].split(", ")
    assert {"attn.to_q", "attn.to_k", "attn.to_out.0", "ff.net.2", "proj_out"} <= set(listed)
    assert not any(re.match(r"\w+\.\d+\.", name) for name in listed)  # block indices stripped


@pytest.mark.skipif(importlib.util.find_spec("xformers") is not None and torch.cuda.is_available(),
                    reason="xformers can run here")  # fmt: skip
def test_xformers_where_it_cannot_run_is_a_clear_error(tmp_path):
    from stepfast.config import load_config
    from stepfast.policy import load_policy_pipeline

    cfg = load_config("default", [f"model.path={tiny_pipeline_dir(tmp_path)}", "model.attention=xformers"])
    with pytest.raises(ValueError, match=r"model.attention=xformers, but xformers cannot be used here: ."):
        load_policy_pipeline(cfg.model, torch.device("cpu"))


def test_an_image_decodes_alike_however_many_are_decoded_with_it(tmp_path):
    """decode pads every VAE call to the same batch, so an image's pixels do not depend on the batch
    it was decoded in (a run on two ranks decodes half of a one-rank run's images per call). Without
    the padding the tiny VAE rounds 14 latents on a CPU differently from the same 14 among 28."""
    from stepfast.policy import DECODE_BATCH, decode

    pipe = load_pipeline(tiny_pipeline_dir(tmp_path / "tiny", seed=0))
    shape = latent_shape(pipe, 2 * DECODE_BATCH - 4, 64)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    whole = decode(pipe, latents)
    assert whole.shape[0] == latents.shape[0]
    for n in (1, 5, DECODE_BATCH - 2, DECODE_BATCH, DECODE_BATCH + 3):
        assert torch.equal(decode(pipe, latents[:n]), whole[:n]), n
        assert torch.equal(decode(pipe, latents[-n:]), whole[-n:]), n
    # another batch (rollout.decode_batch) pads to its own size
    assert torch.equal(decode(pipe, latents[:3], batch_size=5), decode(pipe, latents[:10], batch_size=5)[:3])
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        decode(pipe, latents, batch_size=0)
    with pytest.raises(ValueError, match="no latents"):
        decode(pipe, latents[:0])


LONG = "a photo of a red circle next to a green square above a blue triangle and two yellow circles"


def test_prompts_the_text_encoders_cut_are_said_once_and_not_at_every_encoding(tmp_path):
    """A prompt longer than a text encoder takes is found at start (the embedded model's encoders
    take 12 tokens); the trainer warns once, naming its line, and diffusers' notice, logged at every
    encoding of it, and transformers' about its token count are dropped after that. The notices are
    caught at their loggers (the libraries' own handlers keep the stderr of the test that imported
    them first)."""
    import logging

    from stepfast.data.prompts import load_prompts
    from stepfast.models import EMBEDDED_MODEL
    from stepfast.policy import cut_prompts, quiet_truncation_notices, token_limits
    from stepfast.startup import cut_prompt_warnings

    logged = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    loggers = [logging.getLogger(name) for name in ("diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3",
                                                    "transformers.tokenization_utils_base")]  # fmt: skip
    keep = Keep(logging.WARNING)
    from stepfast import policy

    for log in loggers:
        log.addHandler(keep)
        for quiet in [f for f in log.filters if isinstance(f, policy._TruncationNotices)]:  # an earlier test's
            log.removeFilter(quiet)
    try:
        pipe = load_pipeline(EMBEDDED_MODEL)
        assert token_limits(pipe) == {"tokenizer": 12, "tokenizer_2": 12, "tokenizer_3": 12}
        assert cut_prompts(pipe, ["a photo of a red circle", LONG, "a photo of a square"]) == [1]
        encode_prompts(load_pipeline(EMBEDDED_MODEL), [LONG], 1.0, torch.device("cpu"))  # unquieted: the notices
        assert any("was truncated because" in m for m in logged)
        assert any("Token indices sequence length is longer" in m for m in logged)
        prompts = tmp_path / "prompts.txt"
        prompts.write_text(f"a photo of a red circle\n\n{LONG}\n")
        logged.clear()
        files = {"rollout.prompts": (str(prompts), load_prompts(prompts)),
                 "eval.prompts": ("shapeeval:test", load_prompts("shapeeval:test"))}  # fmt: skip
        assert cut_prompt_warnings(pipe, files) == [
            f"rollout.prompts: 1 of 2 prompts are longer than the text encoders take (CLIP 12, T5 12 tokens) and "
            f"are cut there when encoded (a reward reads the text as its own model takes it); the first: "
            f"{prompts}:3 {LONG!r}"
        ]
        assert cut_prompt_warnings(pipe, {"eval.prompts": ("shapeeval:nope", None)}) == []  # not read
        quiet_truncation_notices(pipe)
        encode_prompts(pipe, [LONG, LONG], 4.5, torch.device("cpu"))
        assert logged == []
        # another model's tokenizer (a reward's, say) keeps transformers' notice about a long prompt
        from transformers import CLIPTokenizer

        CLIPTokenizer.from_pretrained(EMBEDDED_MODEL, subfolder="tokenizer")(LONG)
        assert any("Token indices sequence length is longer" in m for m in logged)
    finally:
        for log in loggers:
            log.removeHandler(keep)
            for quiet in [f for f in log.filters if isinstance(f, policy._TruncationNotices)]:
                log.removeFilter(quiet)


def test_a_prompt_a_group_shares_is_encoded_once(tmp_path, monkeypatch):
    """The members of a group share their prompt: encode_prompts encodes each text once, alone, and
    repeats its row, with and without guidance (the empty negative prompt once too); so a text's row
    is the same bits in any batch (the prompts a rank holds depend on how many ranks share the
    groups), those diffusers' pipeline gives the prompt alone."""
    pipe = load_pipeline(tiny_pipeline_dir(tmp_path, seed=0))
    texts = ["a photo of a red circle", "a photo of two squares"]
    prompts = [texts[0]] * 3 + [texts[1]] * 2 + [texts[0]]
    asked = []
    encode = pipe.encode_prompt
    monkeypatch.setattr(pipe, "encode_prompt", lambda **kw: asked.append(list(kw["prompt"])) or encode(**kw))
    for cfg_scale in (1.0, 4.5):
        asked.clear()
        cond = encode_prompts(pipe, prompts, cfg_scale, torch.device("cpu"))
        assert asked == [[texts[0]], [texts[1]]] + ([[""]] if cfg_scale > 1 else [])
        assert (cond.neg_embeds is None) == (cfg_scale == 1)
        assert all(rows is None or rows.shape[0] == len(prompts) for rows in cond.tensors().values())
        for i, text in enumerate(prompts):  # diffusers' own encoding of the prompt alone
            embeds, neg, pooled, neg_pooled = encode(
                prompt=[text], prompt_2=None, prompt_3=None, device="cpu", do_classifier_free_guidance=cfg_scale > 1,
                negative_prompt=[""], max_sequence_length=text_length(pipe))  # fmt: skip
            assert torch.equal(cond.embeds[i], embeds[0]) and torch.equal(cond.pooled[i], pooled[0]), i
            if cfg_scale > 1:
                assert torch.equal(cond.neg_embeds[i], neg[0]) and torch.equal(cond.neg_pooled[i], neg_pooled[0]), i
    with pytest.raises(ValueError, match="needs at least one prompt, got none"):
        encode_prompts(pipe, [], 4.5, torch.device("cpu"))
