"""The shipped tiny SD3 pipeline, the tiny-pipeline builder, and pipeline loading."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from stepfast.data.shapeeval import load_metadata
from stepfast.models import EMBEDDED_MODEL, check_pipeline_dir, load_pipeline, text_length
from stepfast.models.tiny import PROMPT_WORDS, build_tiny_pipeline, save_pipeline, tiny_pipeline_dir

MODULES = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")


@pytest.fixture(scope="module")
def embedded():
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(EMBEDDED_MODEL)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def state(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# --------------------------------------------------------------------------------------------------
# The embedded model


def test_embedded_model_is_shipped_within_budget():
    root = Path(EMBEDDED_MODEL)
    assert root.parent == Path(__file__).resolve().parents[1] / "stepfast" / "models"
    check_pipeline_dir(root)
    files = [f for f in root.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 20 * 2**20
    assert any(f.name == "diffusion_pytorch_model.safetensors" for f in files)
    assert not any(f.suffix in (".bin", ".pt", ".ckpt") for f in files)


def test_embedded_model_loads_in_fp32_with_the_sd3_architecture(embedded):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    assert isinstance(embedded.transformer, SD3Transformer2DModel)
    assert isinstance(embedded.vae, AutoencoderKL)
    assert isinstance(embedded.text_encoder, CLIPTextModelWithProjection)
    assert isinstance(embedded.text_encoder_2, CLIPTextModelWithProjection)
    assert isinstance(embedded.text_encoder_3, T5EncoderModel)
    assert isinstance(embedded.scheduler, FlowMatchEulerDiscreteScheduler)
    assert embedded.scheduler.config.shift == 3.0
    assert embedded.vae.config.latent_channels == 16
    for name in MODULES:
        assert all(p.dtype == torch.float32 for p in getattr(embedded, name).parameters()), name
    # RL puts LoRA on the attention projections under their diffusers names.
    names = {n for n, _ in embedded.transformer.named_modules()}
    for proj in ("to_q", "to_k", "to_v", "to_out.0"):
        assert f"transformer_blocks.0.attn.{proj}" in names
    # The VAE was fitted: latents are standardised with data statistics, not left at 1 / 0.
    assert embedded.vae.config.scaling_factor != 1.0 and embedded.vae.config.shift_factor != 0.0


def test_every_shapeeval_word_is_one_token(embedded):
    for meta in load_metadata("train") + load_metadata("test"):
        words = meta["prompt"].split()
        assert len(embedded.tokenizer(meta["prompt"]).input_ids) == len(words) + 2
        assert len(embedded.tokenizer_2(meta["prompt"]).input_ids) == len(words) + 2
        assert len(embedded.tokenizer_3(meta["prompt"]).input_ids) == len(words) + 1
        assert len(words) + 2 <= text_length(embedded)


def test_embedded_model_samples_images_that_follow_the_prompt(embedded):
    """The shipped model draws what it is asked, except for its one known defect (docs/shapeeval.md's
    ShapeEval section): with guidance it draws a blank image for 'a photo of a green triangle'. That
    defect is pinned on its own, so that it cannot hide another failure here, and so that a model
    without it fails here until that note goes too."""
    from stepfast.rewards import load

    prompts = ["a photo of a red circle", "a photo of a blue square", "a photo of two triangles",
               "a photo of a green triangle"] * 2  # fmt: skip
    generators = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    out = embedded(
        prompt=prompts, num_inference_steps=20, guidance_scale=4.5, generator=generators,
        max_sequence_length=text_length(embedded), output_type="np",
    )  # fmt: skip
    images = out.images
    assert images.shape == (8, 64, 64, 3) and np.isfinite(images).all()
    std = images.std(axis=(1, 2, 3))
    green = [i for i, p in enumerate(prompts) if p == "a photo of a green triangle"]
    others = [i for i in range(len(prompts)) if i not in green]
    assert std[green].max() < 0.05, "the green-triangle defect is gone: drop this line and docs/shapeeval.md's note"
    assert std[others].min() > 0.05  # not blank
    scores = load("shapes").score((images[others] * 255).round().astype(np.uint8), [prompts[i] for i in others])
    # A random or untrained pipeline scores 0 here; the shipped one gets most of these right.
    assert scores["score"].mean() >= 0.5, scores


def test_load_pipeline_gives_eval_mode_fp32_without_grads():
    pipe = load_pipeline(EMBEDDED_MODEL)
    assert not pipe.transformer.training
    assert not any(p.requires_grad for p in pipe.transformer.parameters())
    assert text_length(pipe) == 12  # the tokenizers' model_max_length, tiny.py's text_length when built


def test_a_float16_pipeline_on_the_cpu_runs_without_diffusers_warning_it_will_fail():
    """model.dtype=fp16 on a CPU: diffusers warns that the pipeline "will fail" there, and torch runs it.
    (Its records are caught on its own logger: diffusers' handler may hold a stream captured before.)"""
    import logging

    said = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: said.append(record.getMessage())
    log = logging.getLogger("diffusers")
    log.addHandler(catch)
    try:
        pipe = load_pipeline(EMBEDDED_MODEL, dtype=torch.float16, device="cpu")
    finally:
        log.removeHandler(catch)
    assert not [m for m in said if "cannot run with `cpu` device" in m], said
    images = pipe("a red circle", num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert images.dtype == torch.float16 and torch.isfinite(images).all()


# --------------------------------------------------------------------------------------------------
# Tiny pipelines


def test_tiny_pipeline_round_trip(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    path = tiny_pipeline_dir(tmp_path, seed=3)
    assert json.loads((path / "model_index.json").read_text())["text_encoder_3"][1] == "T5EncoderModel"
    loaded = StableDiffusion3Pipeline.from_pretrained(path)
    rebuilt = build_tiny_pipeline(3, vae_channels=(8, 16, 16, 16), num_layers=2, num_heads=2, head_dim=16)
    for name in MODULES:
        a, b = state(getattr(loaded, name)), state(getattr(rebuilt, name))
        assert a.keys() == b.keys(), name
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=f"{name}.{key}")
    prompt = "a photo of an orange triangle and a white square"
    for tok in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        assert getattr(loaded, tok)(prompt).input_ids == getattr(rebuilt, tok)(prompt).input_ids
    loaded.set_progress_bar_config(disable=True)
    images = loaded(prompt, num_inference_steps=2, max_sequence_length=text_length(loaded), output_type="pt").images
    assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()


def test_tiny_pipelines_differ_by_seed():
    a = build_tiny_pipeline(0, num_layers=1).transformer.state_dict()
    b = build_tiny_pipeline(0, num_layers=1).transformer.state_dict()
    c = build_tiny_pipeline(1, num_layers=1).transformer.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_half_precision_storage_loads_in_fp32(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    pipe = build_tiny_pipeline(0, num_layers=1, vae_channels=(8, 8, 8, 8))
    before = state(pipe.transformer)
    save_pipeline(pipe, tmp_path / "half", dtype=torch.float16)
    assert all(torch.equal(before[k], v) for k, v in state(pipe.transformer).items())  # pipe untouched
    half = StableDiffusion3Pipeline.from_pretrained(tmp_path / "half")
    save_pipeline(pipe, tmp_path / "full")
    size = lambda d: sum(f.stat().st_size for f in (tmp_path / d).rglob("*.safetensors"))  # noqa: E731
    assert size("half") < 0.6 * size("full")
    for name in MODULES:
        module = getattr(half, name)
        assert all(p.dtype == torch.float32 for p in module.parameters()), name
    for key, value in state(half.transformer).items():  # stored in fp16, loaded back as float32
        assert torch.equal(value, before[key].half().float()), key


def test_clip_tokenizer_falls_back_to_bytes_for_unknown_words():
    pipe = build_tiny_pipeline(0, num_layers=1)
    ids = pipe.tokenizer("a zebra").input_ids
    assert len(ids) > 4  # "zebra" is not in PROMPT_WORDS: several byte-level pieces
    assert pipe.tokenizer.decode(ids, skip_special_tokens=True).strip() == "a zebra"
    assert set(PROMPT_WORDS) >= {"circle", "square", "triangle", "magenta", "left", "below"}


# --------------------------------------------------------------------------------------------------
# Errors


def test_load_pipeline_names_the_bad_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        load_pipeline(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model_index.json"):
        load_pipeline(tmp_path / "empty")
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ValueError, match="StableDiffusionPipeline"):
        load_pipeline(other)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model_index.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed JSON"):
        load_pipeline(broken)


def test_load_pipeline_names_the_component_that_is_missing_or_damaged(tmp_path):
    import shutil

    good = tiny_pipeline_dir(tmp_path / "good")
    no_encoder = shutil.copytree(good, tmp_path / "no_encoder")
    shutil.rmtree(no_encoder / "text_encoder_2")  # not one of the five that were checked before
    with pytest.raises(ValueError, match=r"model_index.json lists \['text_encoder_2'\] but those subfolders"):
        load_pipeline(no_encoder)
    # found by check_pipeline_dir (the trainer's start checks), before any component loads
    empty = shutil.copytree(good, tmp_path / "empty_transformer")
    for file in (empty / "transformer").iterdir():
        file.unlink()
    with pytest.raises(ValueError, match=rf"{empty}: a component is incomplete \(transformer/ has no config.json\)"):
        check_pipeline_dir(empty)
    partial = shutil.copytree(good, tmp_path / "partial")
    (partial / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    (partial / "scheduler" / "scheduler_config.json").unlink()
    for file in (partial / "tokenizer_3").iterdir():
        file.unlink()
    with pytest.raises(ValueError) as err:
        check_pipeline_dir(partial)
    assert str(err.value) == (
        f"{partial}: a component is incomplete (scheduler/ has no scheduler_config.json; tokenizer_3/ has no "
        "tokenizer files (tokenizer_config.json, tokenizer.json, vocab.json, spiece.model); vae/ has no weights "
        "(*.safetensors or *.bin)): a partial download or copy?"
    )
    # a sharded model names its shards in an index: one missing is named; a component the SD3 pipeline
    # does not draw with (an IP-Adapter's feature_extractor, files of its own kind) is not checked
    sharded = shutil.copytree(good, tmp_path / "sharded")
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "b.weight": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (sharded / "text_encoder_3" / "model.safetensors").rename(sharded / "text_encoder_3" / "model-00001-of-00002.safetensors")
    (sharded / "text_encoder_3" / "model.safetensors.index.json").write_text(json.dumps(index))
    spec = json.loads((sharded / "model_index.json").read_text())
    spec["feature_extractor"] = ["transformers", "SiglipImageProcessor"]
    (sharded / "model_index.json").write_text(json.dumps(spec))
    (sharded / "feature_extractor").mkdir()
    (sharded / "feature_extractor" / "preprocessor_config.json").write_text("{}")
    with pytest.raises(ValueError) as err:
        check_pipeline_dir(sharded)
    assert str(err.value) == (f"{sharded}: a component is incomplete (text_encoder_3/ has no model-00002-of-00002."
                              "safetensors, which model.safetensors.index.json names): a partial download or copy?")
    (sharded / "text_encoder_3" / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert check_pipeline_dir(sharded) == sharded
    # another format's index whose shards were not downloaded: one complete index will do
    bin_index = {"metadata": {}, "weight_map": {"a.weight": "pytorch_model-00001-of-00002.bin"}}
    (sharded / "text_encoder_3" / "pytorch_model.bin.index.json").write_text(json.dumps(bin_index))
    assert check_pipeline_dir(sharded) == sharded
    # a file diffusers cannot read is still named by the load
    damaged = shutil.copytree(good, tmp_path / "damaged")
    (damaged / "transformer" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"cannot load the pipeline in {damaged}"):
        load_pipeline(damaged)


def test_a_lora_of_another_model_is_named_with_one_mismatch(tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from stepfast.models import load_lora

    other = load_pipeline(tiny_pipeline_dir(tmp_path / "other", num_heads=3))
    other.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["attn.to_q"]))
    StableDiffusion3Pipeline.save_lora_weights(tmp_path / "lora",
                                               transformer_lora_layers=get_peft_model_state_dict(other.transformer),
                                               transformer_lora_adapter_metadata=other.transformer.peft_config["default"].to_dict())  # fmt: skip
    layers = len(other.transformer.transformer_blocks)
    with pytest.raises(ValueError) as info:
        load_lora(load_pipeline(tiny_pipeline_dir(tmp_path / "this")), tmp_path / "lora")
    message = str(info.value)
    assert f"{2 * layers} of their tensors have other shapes than the model's" in message  # lora_A and _B
    assert message.count("size mismatch") == 1 and message.endswith("Were they trained on another model?")


def test_text_length_defaults_to_diffusers_for_long_tokenizers():
    class Tok:
        model_max_length = 512

    class Pipe:
        tokenizer_3 = Tok()

    assert text_length(Pipe()) == 256


def test_a_lora_saved_without_its_adapter_config_is_warned_about(tmp_path):
    """diffusers loads such a file with lora_alpha = rank: an adapter trained at another alpha loads at
    another scale, silently. stepfast's save_lora writes the config; a file without it is said."""
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from stepfast.models import load_lora
    from stepfast.policy import save_lora

    trained = load_pipeline(tiny_pipeline_dir(tmp_path / "model"))
    trained.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["attn.to_q"]))
    save_lora(trained.transformer, tmp_path / "with")
    StableDiffusion3Pipeline.save_lora_weights(tmp_path / "without",
                                               transformer_lora_layers=get_peft_model_state_dict(trained.transformer))
    fresh = load_pipeline(tmp_path / "model" / "tiny-sd3-0")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("diffusers.loaders.lora_base")
    log.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # none for a file with its config
            load_lora(fresh, tmp_path / "with")
    finally:
        log.removeHandler(handler)
    assert fresh.transformer.peft_config["default"].lora_alpha == 8
    # nor diffusers' notice, for each text encoder, that a transformer's adapter holds none of theirs
    assert not [r for r in records if "No LoRA keys" in r.getMessage()]
    other = load_pipeline(tmp_path / "model" / "tiny-sd3-0")
    with pytest.warns(UserWarning, match="holds no adapter config .* diffusers loads it with lora_alpha = its rank"):
        load_lora(other, tmp_path / "without")
    assert other.transformer.peft_config["default"].lora_alpha == 4
