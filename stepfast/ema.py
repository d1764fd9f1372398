"""The exponential moving average of the trainable weights (`optim.ema`), in fp32, under every ZeRO
stage: under ZeRO-3 each rank averages its own partition of every weight, as ZeRO keeps them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .engine import gathered, trainable_parameters


@dataclass(frozen=True)
class _Slice:
    """Where one rank's partition of a ZeRO-3 weight lies in the flattened weight: ZeRO pads the
    weight to `world * size` elements and gives rank r elements [r * size, (r + 1) * size) as
    `param.ds_tensor`; the first `valid` of them are the weight's, the rest padding."""

    group: object  # the weight's partition group (None: the default group)
    world: int
    start: int
    size: int
    valid: int
    shape: torch.Size


def _zero3_slice(name: str, param: torch.nn.Parameter) -> _Slice:
    group = getattr(param, "ds_process_group", None)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = param.ds_tensor.numel()
    if size * world < param.ds_numel:
        raise RuntimeError(
            f"EMA: the ZeRO-3 partitions of {name} hold {size} x {world} elements, fewer than its "
            f"{param.ds_numel}: a partitioning the EMA does not know (MiCS or hierarchical partitions?)"
        )
    start = size * rank
    return _Slice(group, world, start, size, max(0, min(size, param.ds_numel - start)), param.ds_shape)


class EMA:
    """Exponential moving average of the trainable weights, in fp32.

    Outside ZeRO-3 every rank keeps the whole average. Under ZeRO-3 each rank keeps the average of its
    own partition of every weight, as ZeRO keeps the weights: each rank holds 1/world of the fp32
    copy (whole, SD3.5-Large's 8B weights would take 32 GB on every rank), and the update reads the
    rank's partitions without any communication. Whole weights are assembled only to apply the
    EMA for evaluation, one weight at a time, and to write it out (`state_dict`), both collectives
    every rank enters in the same order."""

    def __init__(self, module: torch.nn.Module, decay: float, zero_stage: int):
        self.decay = decay
        self.zero3 = zero_stage == 3
        params = trainable_parameters(module)
        self.slices = {n: _zero3_slice(n, p) for n, p in params} if self.zero3 else {}
        with torch.no_grad():
            self.shadow = {n: self._local(n, p).float() for n, p in params}

    def _local(self, name: str, param: torch.nn.Parameter, device=None) -> torch.Tensor:
        """A copy (on `device`, default the weight's) of this rank's part of a weight: the whole
        weight, or under ZeRO-3 its partition with the padding zeroed."""
        if not self.zero3:
            return param.detach().to(device or param.device, copy=True)
        part = param.ds_tensor.detach().to(device or param.ds_tensor.device, copy=True)
        part[self.slices[name].valid :] = 0
        return part

    def _whole(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """The whole weight from every rank's part (collective under ZeRO-3)."""
        if not self.zero3:
            return part
        s = self.slices[name]
        if part.device.type == "cpu" and dist.get_backend(s.group) == "nccl":  # weights offloaded to the CPU
            part = part.to(torch.device("cuda", torch.cuda.current_device()))
        parts = [torch.empty_like(part) for _ in range(s.world)]
        dist.all_gather(parts, part.contiguous(), group=s.group)
        return torch.cat(parts)[: s.shape.numel()].view(s.shape)

    def _write(self, name: str, param: torch.nn.Parameter, part: torch.Tensor) -> None:
        """Set a weight from every rank's part: under ZeRO-3 it is gathered, written whole on every
        rank, and rank 0's values partitioned back (as GatheredParameters does for persistent and
        partitioned weights alike)."""
        whole = self._whole(name, part)
        with gathered([param], self.zero3, modify=True):
            param.copy_(whole.to(param.device, param.dtype))

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        for n, p in trainable_parameters(module):
            if self.zero3:
                valid = self.slices[n].valid
                self.shadow[n][:valid].mul_(self.decay).add_(p.ds_tensor[:valid].float(), alpha=1 - self.decay)
            else:
                self.shadow[n].mul_(self.decay).add_(p.detach().float(), alpha=1 - self.decay)

    @contextlib.contextmanager
    def applied(self, module: torch.nn.Module):
        """A context in which the model's trainable weights are the EMA's (to evaluate with). On exit,
        also on an error, the model gets its own weights back exactly: this rank's part of them waits
        on the CPU in its own dtype, and the shadow is left as it is (swapping it with a bf16 model's
        weights would round the EMA to bf16 at every evaluation). Collective under ZeRO-3."""
        params = trainable_parameters(module)
        saved = {}
        with torch.no_grad():
            for n, p in params:
                saved[n] = self._local(n, p, "cpu")
                self._write(n, p, self.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params:
                    self._write(n, p, saved.pop(n).to(self.shadow[n].device))

    def state_dict(self, keep: bool = True) -> dict:
        """The decay and the whole EMA weights on the CPU, by `named_parameters` name. Collective
        under ZeRO-3 (every rank enters it); ranks without `keep` get an empty shadow."""
        shadow = {}
        for n, part in self.shadow.items():
            whole = self._whole(n, part)
            if keep:
                shadow[n] = whole.to("cpu", copy=True)
        return {"decay": self.decay, "shadow": shadow}

    def load_state_dict(self, state: dict) -> None:
        """Whole EMA weights, as `state_dict` gives them; under ZeRO-3 each rank keeps its part."""
        missing = set(self.shadow) - set(state["shadow"])
        if missing:
            raise ValueError(f"EMA state lacks {len(missing)} weights, e.g. {sorted(missing)[0]}")
        for n, part in self.shadow.items():
            whole = state["shadow"][n].float()
            shape = self.slices[n].shape if self.zero3 else part.shape
            if whole.shape != shape:
                raise ValueError(f"EMA state holds {n} of shape {tuple(whole.shape)}; the model's is {tuple(shape)}")
            if self.zero3:
                s = self.slices[n]
                new = torch.zeros_like(part)
                new[: s.valid] = whole.reshape(-1)[s.start : s.start + s.valid].to(part.device)
                self.shadow[n] = new
            else:
                self.shadow[n] = whole.to(part.device, copy=True)
