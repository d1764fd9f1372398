"""The K-repeat prompt sampler: G prompts per iteration, each repeated N times, spread over ranks.

Iteration i takes the prompts at positions i*G .. (i+1)*G - 1 of an endless stream made of seeded
permutations of the prompt list (one permutation per epoch), so each prompt comes once per epoch and
the batch of any iteration is a pure function of (seed, i): the sampler's position is the iteration.
The G x N samples of an iteration are numbered group-major (sample k = group k // N, member k % N)
and rank r of W takes the contiguous slice [r B / W, (r + 1) B / W): a group may span ranks.

With `strata` (one label per prompt, e.g. GenEval's category `tag`), the stream is balanced over the
labels instead: position p draws from label p mod S (the S labels in sorted order), and each label
has its own endless stream of seeded permutations of its prompts. Every category then gets an equal
share of the groups however many prompts it holds (ShapeEval's train split has 227 colour-attribute
prompts and 2 single-object ones), as in GenEval-style training sets. The batch is still a pure
function of (seed, i).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LocalBatch:
    """This rank's share of one iteration."""

    indices: list[int]  # into the prompt list, one per local sample
    groups: list[int]  # group index in [0, G) of each local sample
    members: list[int]  # member index in [0, N) of each local sample
    start: int  # global position of the first local sample


class KRepeatSampler:
    def __init__(self, num_prompts: int, groups: int, group_size: int, world: int, rank: int, seed: int,
                 strata: list[str] | None = None):  # fmt: skip
        if num_prompts < 1:
            raise ValueError("the prompt list is empty")
        if strata is not None and len(strata) != num_prompts:
            raise ValueError(f"got {len(strata)} strata labels for {num_prompts} prompts")
        total = groups * group_size
        if total % world:
            raise ValueError(
                f"rollout.groups x rollout.group_size = {groups} x {group_size} = {total} samples "
                f"do not split evenly over {world} ranks"
            )
        self.num_prompts, self.groups, self.group_size = num_prompts, groups, group_size
        self.world, self.rank, self.seed = world, rank, seed
        self.per_rank = total // world
        self.strata = None
        if strata is not None:
            labels = sorted(set(strata))
            self.strata = [[i for i, s in enumerate(strata) if s == label] for label in labels]

    def _prompt_at(self, position: int) -> int:
        if self.strata is None:
            epoch, offset = divmod(position, self.num_prompts)
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)
            return int(perm[offset])
        stratum, draw = position % len(self.strata), position // len(self.strata)
        members = self.strata[stratum]
        epoch, offset = divmod(draw, len(members))
        perm = np.random.default_rng([self.seed, stratum, epoch]).permutation(len(members))
        return members[int(perm[offset])]

    def group_prompts(self, iteration: int) -> list[int]:
        """The G prompt indices of `iteration`."""
        return [self._prompt_at(iteration * self.groups + g) for g in range(self.groups)]

    def batch(self, iteration: int) -> LocalBatch:
        prompts = self.group_prompts(iteration)
        start = self.rank * self.per_rank
        ks = range(start, start + self.per_rank)
        groups = [k // self.group_size for k in ks]
        return LocalBatch(
            indices=[prompts[g] for g in groups],
            groups=groups,
            members=[k % self.group_size for k in ks],
            start=start,
        )
