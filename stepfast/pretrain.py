"""Rebuild the embedded model: a tiny SD3 pipeline pretrained on ShapeEval scenes.

    python -m stepfast.pretrain [--out DIR] [--overwrite] [--steps N] [--vae-steps N] [--device cpu|cuda]
                                [--seed 0] [--threads 1] [--snapshot-every N] [--vae DIR]

Without --out it rebuilds the shipped model in place, which, as any --out that holds a pipeline,
takes --overwrite.

Three phases, all drawing their data and noise from --seed (a rerun sees the same scenes, noise
and captions; a rebuild on the same machine and libraries wrote byte-identical weights, while another
CPU or library build can round differently in the last bits):
1. VAE: the AutoencoderKL learns to reconstruct rendered scenes (L1 + L2 with the shapes' pixels
   weighted up, plus a small KL term), on 32x32 crops since it is purely convolutional (a quarter
   of the cost of full scenes).
2. Data: a pool of scenes for the train prompts (category-balanced) is rendered and encoded once,
   and the VAE's shift/scaling factors are set so that latents have mean 0 and std 1, as SD3's
   are; the prompts are encoded once by the frozen text encoders.
3. Transformer: rectified flow, x_t = (1 - t) x_0 + t eps, regressing v = eps - x_0 at SD3's
   logit-normal t (shifted like the sampler's schedule), with 10% of the captions replaced by ""
   (the pipeline's negative prompt) so that classifier-free guidance works; adaLN-Zero
   initialisation, constant learning rate after warmup, and an EMA of the weights is what ships.

The text encoders stay at their random initialisation, frozen: a random encoder is still a fixed,
order-aware, injective map of these short prompts, the MMDiT's joint attention learns to read it,
encoding each prompt once makes phase 3 cheaper, and RL later adapts only the transformer.
Only the train prompts are seen: the test prompts (new combinations of the same words) are what
`python -m stepfast.evaluate` measures generalisation on.
"""

from __future__ import annotations

import argparse
import copy
import math
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # before the imports below (seconds): a Ctrl-C among them is a line, not a traceback
    from stepfast import quiet_ctrl_c_while_starting

    quiet_ctrl_c_while_starting("python -m stepfast.pretrain")

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from stepfast import policy
from stepfast.data.shapeeval import CATEGORIES, load_metadata, render
from stepfast.files import PROBE_PREFIX, check_creatable_dir, path_argument, sync, sync_folder
from stepfast.models import EMBEDDED_MODEL, check_device, check_pipeline_dir, text_length
from stepfast.models.tiny import build_tiny_pipeline, save_pipeline


@dataclass
class PretrainConfig:
    steps: int = 3000  # transformer steps
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 200
    ema_decay: float = 0.998
    caption_dropout: float = 0.1
    pool_size: int = 32768  # scenes rendered and encoded once for phase 3
    vae_steps: int = 1200
    vae_batch_size: int = 32
    vae_lr: float = 3e-3
    foreground_weight: float = 5.0
    vae_crop: int = 32
    kl_weight: float = 1e-4
    image_size: int = 64
    snapshot_every: int = 0  # also save the pipeline every N transformer steps (to tune --steps)


# --------------------------------------------------------------------------------------------------
# Data


def to_model_range(images: np.ndarray, device) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] in [-1, 1]."""
    x = torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float()
    return x / 127.5 - 1.0


def category_balanced_weights(metadata: list[dict]) -> np.ndarray:
    """Sampling weight per prompt: each category gets an equal share, split evenly among its
    prompts (ShapeEval's train split holds 2 single-object prompts and 227 colour-attribute ones)."""
    tags = [m["tag"] for m in metadata]
    present = [c for c in CATEGORIES if c in tags] or sorted(set(tags))
    counts = {c: tags.count(c) for c in present}
    weights = np.array([1.0 / (len(present) * counts[t]) if t in counts else 0.0 for t in tags])
    return weights / weights.sum()


def render_scenes(metadata: list[dict], indices: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    return np.stack([render(metadata[i], size, rng) for i in indices])


# --------------------------------------------------------------------------------------------------
# Phase 1: the VAE


def train_vae(vae, metadata, cfg: PretrainConfig, device, rng: np.random.Generator) -> list[float]:
    vae.train().requires_grad_(True)
    with torch.no_grad():
        # Start near a deterministic autoencoder (posterior std e^-4): at the default std of 1 the
        # sampling noise drowns the latents and the small KL weight takes long to shrink it.
        vae.encoder.conv_out.bias[vae.config.latent_channels :] = -8.0
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    weights = category_balanced_weights(metadata)
    losses = []
    bar = tqdm(range(cfg.vae_steps), desc="vae", dynamic_ncols=True)
    for step in bar:
        lr = cfg.vae_lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / cfg.vae_steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = rng.choice(len(metadata), size=cfg.vae_batch_size, p=weights)
        scenes = render_scenes(metadata, idx, cfg.image_size, rng)
        c = cfg.vae_crop
        ys, xs = rng.integers(0, cfg.image_size - c + 1, size=(2, len(idx)))
        crops = np.stack([s[y : y + c, x : x + c] for s, y, x in zip(scenes, ys, xs)])
        x = to_model_range(crops, device)
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample()).sample
        # Shapes cover a few percent of the pixels: weighting them up is what makes the colours
        # come out right (with a plain mean the VAE first learns grey shapes on black).
        weight = 1 + cfg.foreground_weight * (x.amax(1, keepdim=True) > -0.9).float()
        weight = weight / weight.mean(dim=(1, 2, 3), keepdim=True)
        rec_loss = (weight * ((recon - x).abs() + (recon - x).pow(2))).mean()
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        loss = rec_loss + cfg.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        losses.append(rec_loss.item())
        if step % 10 == 0:
            bar.set_postfix(rec=f"{np.mean(losses[-50:]):.4f}", kl=f"{kl.item():.1f}")
    vae.eval().requires_grad_(False)
    return losses


@torch.no_grad()
def encode_scenes(vae, images: np.ndarray, device, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of the VAE for uint8 scenes [N, H, W, 3] (kept on the CPU)."""
    means, stds = [], []
    for i in tqdm(range(0, len(images), batch), desc="encode scenes", dynamic_ncols=True):
        dist = vae.encode(to_model_range(images[i : i + batch], device)).latent_dist
        means.append(dist.mean.cpu())
        stds.append(dist.std.cpu())
    return torch.cat(means), torch.cat(stds)


# --------------------------------------------------------------------------------------------------
# Phase 3: the transformer


@torch.no_grad()
def encode_prompts(pipe, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt embeddings [N, L, D] and pooled embeddings [N, P] of distinct `prompts`, encoded as one
    batch at the trainer's text length. One batch, as the shipped model was built: the trainer
    encodes each text alone (policy.encode_prompts), whose pooled rows differ from these by a
    rounding, and the rebuild would no longer write the shipped weights."""
    if len(set(prompts)) < len(prompts):
        raise ValueError("pretrain encodes distinct prompts: the list repeats one")
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=prompts, prompt_2=None, prompt_3=None, device=device, do_classifier_free_guidance=False,
        max_sequence_length=policy.text_length(pipe),
    )  # fmt: skip
    return embeds.float(), pooled.float()


def zero_init_modulation(transformer) -> None:
    """DiT's adaLN-Zero initialisation (Peebles & Xie, 2023): the modulation layers and the output
    projection start at zero, so every block starts as the identity and the model as v = 0; DiT
    found it trains markedly faster than the default initialisation, which diffusers keeps."""
    for name, module in transformer.named_modules():
        if name == "proj_out" or (name.endswith(".linear") and "norm" in name.rsplit(".", 2)[-2]):
            torch.nn.init.zeros_(module.weight)
            torch.nn.init.zeros_(module.bias)


def training_times(n: int, generator: torch.Generator, shift: float) -> torch.Tensor:
    """SD3's logit-normal times t = sigmoid(u), u ~ N(0, 1), moved by the sampler's shift,
    t -> shift t / (1 + (shift - 1) t): training then spends its steps where sampling does (with
    shift 3 most of them at high noise, where the layout of a scene is decided)."""
    t = torch.sigmoid(torch.randn(n, generator=generator))
    return shift * t / (1 + (shift - 1) * t)


@dataclass
class LatentPool:
    """Scenes of the train prompts, encoded once: the VAE posterior of each, standardised."""

    mean: torch.Tensor  # [N, C, h, w] posterior means
    std: torch.Tensor  # [N, C, h, w] posterior stds
    prompt: np.ndarray  # [N] index of each scene's prompt in the metadata
    shift: float  # latents enter the transformer as (z - shift) * scale
    scale: float

    def sample(self, pick: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        z = self.mean[pick] + self.std[pick] * torch.randn(self.mean[pick].shape, generator=generator)
        return (z - self.shift) * self.scale


def build_latent_pool(vae, metadata, cfg: PretrainConfig, device, rng: np.random.Generator) -> LatentPool:
    """Render cfg.pool_size scenes (prompt i gets a share proportional to its sampling weight),
    encode them, and set the VAE's shift/scaling factors so that latents have mean 0, std 1."""
    prompt = rng.choice(len(metadata), size=cfg.pool_size, p=category_balanced_weights(metadata))
    scenes = np.stack(
        [render(metadata[i], cfg.image_size, rng) for i in tqdm(prompt, desc="render scenes", dynamic_ncols=True)]
    )
    mean, std = encode_scenes(vae, scenes, device)
    shift = mean.mean().item()
    scale = 1.0 / (mean.var() + std.pow(2).mean()).sqrt().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return LatentPool(mean, std, prompt, shift, scale)


def train_transformer(
    pipe, metadata, cfg: PretrainConfig, device, rng: np.random.Generator, seed: int, snapshot=None
):
    transformer = pipe.transformer
    pool = build_latent_pool(pipe.vae, metadata, cfg, device, rng)
    prompts = [m["prompt"] for m in metadata]
    embeds, pooled = encode_prompts(pipe, prompts + [""], device)
    null = len(prompts)  # index of the empty prompt

    time_shift = pipe.scheduler.config.shift
    zero_init_modulation(transformer)
    transformer.train().requires_grad_(True)
    ema = copy.deepcopy(transformer).eval().requires_grad_(False)
    opt = torch.optim.AdamW(transformer.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    bar = tqdm(range(cfg.steps), desc="transformer", dynamic_ncols=True)
    for step in bar:
        # Constant after warmup (the EMA does the averaging): nothing depends on cfg.steps, so the
        # snapshot at step N is exactly the model that `--steps N` ships.
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        b = cfg.batch_size
        pick = torch.randint(cfg.pool_size, (b,), generator=generator)
        x0 = pool.sample(pick, generator).to(device)
        text = torch.from_numpy(pool.prompt[pick.numpy()]).long()
        text[torch.rand(b, generator=generator) < cfg.caption_dropout] = null
        noise = torch.randn(x0.shape, generator=generator).to(device)
        t = training_times(b, generator, time_shift).to(device)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
        v = transformer(
            hidden_states=xt,
            timestep=t * 1000,  # the pipeline passes sigma * num_train_timesteps
            encoder_hidden_states=embeds[text].to(device),
            pooled_projections=pooled[text].to(device),
            return_dict=False,
        )[0]
        loss = F.mse_loss(v.float(), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        decay = min(cfg.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for p_ema, p in zip(ema.parameters(), transformer.parameters()):
                p_ema.lerp_(p, 1 - decay)
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-100:]):.4f}", lr=f"{lr:.1e}")
        if snapshot is not None and cfg.snapshot_every and (step + 1) % cfg.snapshot_every == 0 and step + 1 < cfg.steps:
            snapshot(step + 1, ema)
    transformer.load_state_dict(ema.state_dict())
    transformer.eval().requires_grad_(False)
    return losses


# --------------------------------------------------------------------------------------------------


def check_vocabulary(pipe, metadata: list[dict]) -> None:
    """Every word of every prompt must be one token of each tokenizer, and every prompt must fit
    the text length: otherwise the tiny encoders would see fragments."""
    length = text_length(pipe)
    for meta in metadata:
        n_words = len(meta["prompt"].split())
        for tokenizer, special in ((pipe.tokenizer, 2), (pipe.tokenizer_2, 2), (pipe.tokenizer_3, 1)):
            ids = tokenizer(meta["prompt"]).input_ids
            if len(ids) != n_words + special or len(ids) > length:
                raise ValueError(
                    f"prompt {meta['prompt']!r} tokenizes to {tokenizer.convert_ids_to_tokens(ids)}: "
                    f"add its words to stepfast.models.tiny.PROMPT_WORDS or raise text_length ({length})"
                )


#: What `save_pipeline` writes in a pipeline directory (an interrupted one holds some of these).
PIPELINE_ENTRIES = frozenset(
    ["model_index.json", "scheduler", "transformer", "vae"]
    + [f"{kind}{n}" for kind in ("text_encoder", "tokenizer") for n in ("", "_2", "_3")]
)


def check_replaceable(path: Path, partial_ok: bool = False) -> None:
    """A ValueError naming `path` unless `write_pipeline` may replace it, deleting what it holds:
    it does not exist, or it is an empty directory or a pipeline directory (model_index.json); with
    partial_ok (the .tmp/.old folders an interrupted write leaves) also one holding only pipeline parts."""
    if not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"{path} is a file, not a pipeline directory")
    entries = {p.name for p in path.iterdir() if not p.name.startswith(PROBE_PREFIX)}  # a killed check's
    if not entries or "model_index.json" in entries or (partial_ok and entries <= PIPELINE_ENTRIES):
        return
    shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
    raise ValueError(
        f"{path} exists and is not a diffusers pipeline directory (no model_index.json; it holds {shown}): "
        "writing the pipeline would delete its files; choose a new or empty directory"
    )


def check_out(out: Path, snapshots: Sequence[int] = (), overwrite: bool = False) -> None:
    """Before any training: a ValueError naming the path when the pipeline could not be written
    to `out` (or its snapshots, the steps N of `snapshots`, to OUT-snapshots/step-N) without
    deleting what is not a pipeline, or when one of them holds a pipeline and `overwrite` was not
    given."""
    _check_target(out, overwrite, f"{out} holds a pipeline already; give --overwrite to replace it (the run "
                                  "writes it only once trained), or another --out")  # fmt: skip
    check_creatable_dir(out)
    check_creatable_dir(out.absolute().parent)  # the pipeline is written next to `out`, then renamed in
    if snapshots:
        folder = out.with_name(out.name + "-snapshots")
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{folder} (where --snapshot-every writes step-N pipelines) is a file, not a directory")
        for step in snapshots:
            path = folder / f"step-{step}"
            _check_target(path, overwrite, f"{path} holds a snapshot already (an earlier run's); give --overwrite "
                                           "to replace it, or another --out")  # fmt: skip


def _check_target(path: Path, overwrite: bool, held: str) -> None:
    """`path` may take a pipeline written by `write_pipeline`: it holds none (ValueError `held`)
    unless `overwrite`, nor anything else that is not a pipeline, nor are its working names taken."""
    check_replaceable(path)
    if not overwrite and (path / "model_index.json").exists():
        raise ValueError(held)
    for suffix in (".tmp", ".old"):  # write_pipeline's working names next to `path`
        check_replaceable(path.with_name(path.name + suffix), partial_ok=True)


def write_pipeline(pipe, out: Path) -> None:
    """Save in fp16 next to `out`, then swap it in: `out` is replaced only by a complete pipeline."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_pipeline(pipe, tmp, dtype=torch.float16)
    sync(tmp)  # on disk before it takes the model's name
    old = out.with_name(out.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    sync_folder(out.parent)
    if old.exists():
        shutil.rmtree(old)


def main(argv: list[str] | None = None) -> Path:
    defaults = PretrainConfig()
    parser = argparse.ArgumentParser(prog="python -m stepfast.pretrain", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=path_argument, default=EMBEDDED_MODEL,
                        help="output pipeline directory (default: the embedded model, which needs --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the pipeline already in --out (only once the new one is written)")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help="transformer training steps (default: %(default)s)")
    parser.add_argument("--vae-steps", type=int, default=defaults.vae_steps,
                        help="VAE training steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="scenes per transformer step (default: %(default)s)")
    parser.add_argument("--pool-size", type=int, default=defaults.pool_size,
                        help="scenes encoded for phase 3 (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to train (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the scenes, noise and weights (default: %(default)s)")
    parser.add_argument("--vae", default=None, help="reuse the VAE of this pretrained pipeline (skips phase 1)")
    parser.add_argument(
        "--snapshot-every", type=int, default=0,
        help="also write the pipeline every N steps to OUT-snapshots/step-N (identical to a run with --steps N)",
    )
    parser.add_argument(
        "--threads", type=int, default=1,
        help="CPU threads (default 1: on a shared 2-core machine one thread ran a step 2-5x faster than two)",
    )
    args = parser.parse_args(argv)
    cfg = PretrainConfig(
        steps=args.steps, vae_steps=args.vae_steps, batch_size=args.batch_size, pool_size=args.pool_size,
        snapshot_every=args.snapshot_every,
    )
    for flag, value in (("--steps", cfg.steps), ("--vae-steps", cfg.vae_steps), ("--batch-size", cfg.batch_size),
                        ("--pool-size", cfg.pool_size)):  # fmt: skip
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.snapshot_every < 0:
        parser.error(f"--snapshot-every must be >= 0 (0 = no snapshots), got {args.snapshot_every}")
    if not 0 <= args.seed < 2**63:
        parser.error(f"--seed must be >= 0 and below 2**63 (a 64-bit generator seed), got {args.seed}")
    try:
        device = check_device(args.device)
    except ValueError as exc:
        parser.error(f"--device: {exc}")
    out = Path(args.out).resolve()
    try:
        every = cfg.snapshot_every
        check_out(out, snapshots=range(every, cfg.steps, every) if every else (), overwrite=args.overwrite)
    except ValueError as exc:
        parser.error(f"--out: {exc}")
    if args.vae:  # checked before the minutes of setup, and never looked up on a hub
        try:
            vae_dir = check_pipeline_dir(args.vae) / "vae"
        except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
            parser.error(f"--vae: {exc}")
        if not (vae_dir / "config.json").is_file():
            parser.error(f"--vae: {vae_dir} holds no config.json (expected a pipeline written by this command)")
        from diffusers import AutoencoderKL

        try:  # before any work: a damaged config or weights file is named, not a traceback after the set-up
            reused_vae = AutoencoderKL.from_pretrained(vae_dir, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 (JSON, safetensors, diffusers: each its own error type)
            parser.error(f"--vae: cannot load the VAE in {vae_dir}: {type(exc).__name__}: {exc}")

    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    # One stream per phase, so that reusing a VAE (--vae) leaves phases 2-3 as a full run has them.
    vae_rng, data_rng = (np.random.default_rng([args.seed, phase]) for phase in (1, 2))
    metadata = load_metadata("train")
    pipe = build_tiny_pipeline(args.seed, image_size=cfg.image_size)
    check_vocabulary(pipe, metadata + load_metadata("test"))
    pipe.to(device)

    if args.vae:
        pipe.vae = reused_vae.to(device).eval().requires_grad_(False)
        pipe.register_modules(vae=pipe.vae)
        vae_losses = None  # not trained here
    else:
        vae_losses = train_vae(pipe.vae, metadata, cfg, device, vae_rng)
    vae_time = time.perf_counter() - start

    def snapshot(step: int, weights) -> None:
        saved = copy.deepcopy(pipe).to("cpu")
        saved.transformer.load_state_dict(weights.state_dict())
        write_pipeline(saved, out.with_name(out.name + "-snapshots") / f"step-{step}")

    losses = train_transformer(pipe, metadata, cfg, device, data_rng, args.seed, snapshot)
    total = time.perf_counter() - start

    write_pipeline(pipe.to("cpu"), out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    vae_said = (f"VAE of {args.vae}, not trained" if vae_losses is None
                else f"VAE {vae_time / 60:.1f} min, final recon loss {np.mean(vae_losses[-50:]):.4f}")
    print(f"wrote {out} ({size / 2**20:.1f} MiB) in {total / 60:.1f} min ({vae_said}; "
          f"transformer loss {np.mean(losses[-100:]):.4f})")
    return out


def cli(argv: list[str] | None = None) -> int:
    """`python -m stepfast.pretrain`: main(), with Ctrl-C one line and exit status 130."""
    try:
        main(argv)
    except KeyboardInterrupt:
        print("\npython -m stepfast.pretrain: interrupted (--out is replaced only once the new model is written "
              "whole; snapshots written so far are kept)", file=sys.stderr)  # fmt: skip
        return 130
    return 0


if __name__ == "__main__":
    from stepfast import ctrl_c_as_usual

    ctrl_c_as_usual()
    sys.exit(cli())
