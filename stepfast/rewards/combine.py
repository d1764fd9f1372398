"""Weighted sums of rewards.

    reward = WeightedReward({"pickscore": 1.0, "ocr": 0.5}, options={"pickscore": {"path": "..."}})
    out = reward.score(images, prompts)
    # out["score"]     = 1.0 * pickscore + 0.5 * ocr
    # out["pickscore"] = the pickscore part's "score";  out["pickscore/raw"] = its extra key "raw"

A name is anything `stepfast.rewards.load` accepts: a registered name or "package.module:attr".
"""

from __future__ import annotations

from typing import Mapping

import torch

import stepfast.rewards as registry
from stepfast.rewards.geneval_remote import is_tag_column
from stepfast.rewards.paths import RewardFileError


class ScoreError(ValueError):
    """Scores that are NaN or infinite, from `check_scores`: `images` their positions (from 0) in
    the batch scored. A caller that knows what those images are says so with `naming`."""

    def __init__(self, name: str, kind: str, images: list[int], batch: int):
        self.name, self.kind, self.images, self.batch = name, kind, images, batch
        super().__init__(f"reward {name!r} returned {kind} scores for images {images[:10]} of {batch}")

    def naming(self, describe, limit: int = 5) -> ValueError:
        """The same error with each image named by `describe(position)` (at most `limit` of them)."""
        shown = "; ".join(describe(i) for i in self.images[:limit])
        more = f"; and {len(self.images) - limit} more" if len(self.images) > limit else ""
        return ValueError(f"reward {self.name!r} returned {self.kind} scores for {len(self.images)} of "
                          f"{self.batch} images: {shown}{more}")  # fmt: skip


def check_scores(name: str, out, batch: int) -> dict[str, torch.Tensor]:
    """`out` as a dict of float32 CPU tensors [batch] with a finite "score", or a ValueError naming
    the reward (a `ScoreError` for scores that are NaN or infinite)."""
    if not isinstance(out, Mapping):
        raise ValueError(f"reward {name!r} returned {type(out).__name__}, expected a dict of tensors")
    if "score" not in out:
        raise ValueError(f"reward {name!r} returned keys {sorted(out)} without 'score'")
    checked = {}
    for key, value in out.items():
        # on the CPU: a custom model reward may leave its scores on its GPU, and the parts are summed
        value = torch.as_tensor(value).detach().to(device="cpu", dtype=torch.float32)
        if value.shape != (batch,):
            raise ValueError(
                f"reward {name!r} returned {key!r} of shape {tuple(value.shape)}, expected [{batch}]"
            )
        checked[key] = value
    score = checked["score"]
    bad = torch.nonzero(~torch.isfinite(score)).flatten().tolist()
    if bad:
        nan, inf = bool(torch.isnan(score).any()), bool(torch.isinf(score).any())
        raise ScoreError(name, "NaN and infinite" if nan and inf else "NaN" if nan else "infinite", bad, batch)
    return checked


def weighted_sum(parts: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float]):
    """One dict from several rewards' outputs: "score" = sum_i w_i * score_i, each part's "score"
    as "<name>" and each part's other keys as "<name>/<key>"."""
    out: dict[str, torch.Tensor] = {"score": None}
    for name, part in parts.items():
        term = float(weights[name]) * part["score"]
        out["score"] = term if out["score"] is None else out["score"] + term
        out[name] = part["score"]
        for key, value in part.items():
            if key != "score":
                out[f"{name}/{key}"] = value
    return out


def has_a_mean(key: str) -> bool:
    """Whether the mean over a batch of the column `key` of a reward's output (or "<name>/<key>" of
    a weighted sum) means something: not a category index ("category", the shapes reward's) nor a
    GenEval per-tag column (-10 for the images of other tags)."""
    return key.rsplit("/", 1)[-1] != "category" and not is_tag_column(key)


def _load_part(name: str, options: Mapping) -> object:
    """Reward `name` built with `options`; a model's files that fail to load (a directory without
    the weights, say) raise an OSError that names the reward, as a missing path already does
    (`RewardFileError`)."""
    try:
        return registry.load(name, **options)
    except RewardFileError:
        raise
    except OSError as exc:
        raise OSError(f"reward {name!r} cannot load its files: {' '.join(str(exc).split())}") from exc


class WeightedReward:
    """Several rewards scored on the same batch and summed with fixed weights."""

    def __init__(self, weights: Mapping[str, float], options: Mapping[str, Mapping] | None = None):
        if not weights:
            raise ValueError("WeightedReward needs at least one reward in `weights`")
        options = dict(options or {})
        unknown = sorted(set(options) - set(weights))
        if unknown:
            raise ValueError(f"options given for {unknown}, which are not in weights {sorted(weights)}")
        for name, weight in weights.items():
            if not isinstance(weight, (int, float)) or isinstance(weight, bool):
                raise ValueError(f"weight of reward {name!r} must be a number, got {weight!r}")
        self.weights = {name: float(w) for name, w in weights.items()}
        self.rewards = {name: _load_part(name, options.get(name, {})) for name in weights}

    def check(self, prompts, metadata=None) -> None:
        """Before any image is drawn: each part that can check its prompts does (ValueError naming
        the reward and the prompt)."""
        for name, reward in self.rewards.items():
            if hasattr(reward, "check"):
                try:
                    reward.check(prompts, metadata)
                except registry.PromptError as exc:
                    raise registry.PromptError(exc.index, exc.reason, reward=name) from None
                except ValueError as exc:
                    raise ValueError(f"reward {name!r}: {exc}") from None

    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        parts = {
            name: check_scores(name, reward.score(images, prompts, metadata), len(prompts))
            for name, reward in self.rewards.items()
        }
        return weighted_sum(parts, self.weights)
