"""ImageReward (Xu et al. 2023): BLIP image-text features scored by an MLP, through its own package.

Needs `pip install image-reward`. That package imports helpers that transformers 5 removed and
needs torchvision, so it runs only in an environment with transformers<5; the usual way is to serve
it from such an environment:

    python -m stepfast.reward_server --rewards imagereward \
        --reward-options '{"imagereward": {"path": "/models/ImageReward/ImageReward.pt",
                                           "med_config": "/models/ImageReward/med_config.json"}}'

and train with the `remote` reward. Weights: `ImageReward.pt` and `med_config.json` from the
THUDM/ImageReward model repository, given as local files (the package's own `load` would download
med_config.json every time; this loader does not). The BLIP text side also needs the
`bert-base-uncased` tokenizer, which the package loads by that name: have it in the Hugging Face
cache (`huggingface-cli download bert-base-uncased`) and set HF_HUB_OFFLINE=1.

score = (MLP(BLIP text-encoder [CLS] feature, cross-attending to the image) - mean) / std, with
the package's mean and std: ImageReward's own formula, scored per (prompt, image) pair in batches
(Flow-GRPO calls the package's `inference_rank`, which scores one prompt against many images).
"""

from __future__ import annotations

import os

import torch

from stepfast.rewards.images import to_pil

INSTALL_HINT = (
    "the 'imagereward' reward needs the ImageReward package: pip install image-reward "
    "(it needs torchvision and transformers<5: run it in its own environment behind "
    "`python -m stepfast.reward_server --rewards imagereward` and train with the 'remote' reward)"
)


def _import_package():
    try:
        from ImageReward.ImageReward import ImageReward
    except Exception as exc:  # ImportError, or an incompatible transformers/torchvision failing inside
        raise ImportError(f"{INSTALL_HINT}; importing it failed: {type(exc).__name__}: {exc}") from exc
    return ImageReward


class ImageRewardReward:
    """Options: `path` (ImageReward.pt), `med_config` (med_config.json), `device`, `batch_size`."""

    def __init__(self, path=None, med_config=None, device: str = "cpu", batch_size: int = 16):
        model_cls = _import_package()
        for option, value in (("path", path), ("med_config", med_config)):
            if value is None:
                raise TypeError(f"reward 'imagereward' needs {option}=<local file from THUDM/ImageReward>")
            if not os.path.isfile(value):
                raise FileNotFoundError(f"reward 'imagereward': {option}={value!r} is not a file")
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        model = model_cls(med_config=med_config, device=self.device)
        state = torch.load(path, map_location="cpu", weights_only=True)
        # strict=False as the package's own load(); a file that matches nothing is the wrong file.
        missing, _unexpected = model.load_state_dict(state, strict=False)
        if len(missing) == len(model.state_dict()):
            raise ValueError(f"reward 'imagereward': no weight in {path} belongs to ImageReward")
        self.model = model.float().eval().to(self.device)

    @torch.inference_mode()
    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        pil = to_pil(images)
        if len(pil) != len(prompts):
            raise ValueError(f"got {len(pil)} images and {len(prompts)} prompts")
        blip, scores = self.model.blip, []
        for i in range(0, len(pil), self.batch_size):
            text = blip.tokenizer(list(prompts[i : i + self.batch_size]), padding="max_length",
                                  truncation=True, max_length=35, return_tensors="pt").to(self.device)
            pixels = torch.stack([self.model.preprocess(im) for im in pil[i : i + self.batch_size]])
            image_embeds = blip.visual_encoder(pixels.to(self.device))
            image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
            out = blip.text_encoder(text.input_ids, attention_mask=text.attention_mask,
                                    encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts,
                                    return_dict=True)
            reward = self.model.mlp(out.last_hidden_state[:, 0, :].float()).squeeze(1)
            scores.append(((reward - self.model.mean) / self.model.std).float().cpu())
        return {"score": torch.cat(scores)}
