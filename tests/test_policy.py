"""The policy's velocity call: what the SD3 transformer is given."""

import torch

from stepfast.models import load_pipeline
from stepfast.models.tiny import tiny_pipeline_dir
from stepfast.policy import encode_prompts, latent_shape, velocity
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
