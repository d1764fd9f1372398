"""Run by tests/test_train.py under `deepspeed --num_gpus 2`: the EMA under ZeRO-3. Each rank keeps
only its part of every weight's EMA, for weights split across the ranks (above
stage3_param_persistence_threshold) and weights kept whole on every rank (below it) alike, with the
padding of odd sizes; the whole EMA assembles in order, applies to the model and comes back; its
update after an optimizer step follows the stepped weights; the checkpoint gather. Prints one line
per failed check, then OK or FAIL."""

import os

import deepspeed
import torch

from stepfast.config import OptimConfig
from stepfast.ema import EMA
from stepfast.engine import build_engine, init_distributed, trainable_weights

rank, world, device = init_distributed()
torch.manual_seed(0)
# 7x5 = 35 elements: split (18 on rank 0, 17 and one of padding on rank 1); the rest persist
module = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
optim = OptimConfig(lr=0.1, zero_stage=3, deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": 20}})
engine, _, _ = build_engine(module, optim, micro_batch=1, accumulation=1)
ema = EMA(engine.module, 0.5, zero_stage=3)
shapes = {n: p.ds_shape for n, p in engine.module.named_parameters()}
failed = []
failed += [f"rank {rank}: the EMA of {n} holds {ema.shadow[n].numel()} elements, not its part of {shapes[n].numel()}"
           for n in ema.shadow if ema.shadow[n].numel() != -(-shapes[n].numel() // world)]  # fmt: skip
failed += [f"rank {rank}: {n} should persist whole" for n, p in engine.module.named_parameters()
           if p.ds_persist != (n != "0.weight")]  # fmt: skip
# known values, distinct in every element, unlike any weight: a part out of place shows
known = {n: i + 2 + torch.arange(shapes[n].numel(), dtype=torch.float32).view(shapes[n]) / 64
         for i, n in enumerate(sorted(ema.shadow))}  # fmt: skip
ema.load_state_dict({"decay": 0.5, "shadow": known})


def whole():
    """Every weight, gathered: what the model computes with (not the optimizer's masters)."""
    out = {}
    for name, param in engine.module.named_parameters():
        with torch.no_grad(), deepspeed.zero.GatheredParameters([param]):
            out[name] = param.detach().clone()
    return out


def ema_whole(keep=True):
    return ema.state_dict(keep=keep)["shadow"]


failed += [f"rank {rank}: the EMA of {n} did not come back whole" for n, v in ema_whole().items()
           if not torch.equal(v, known[n])]  # fmt: skip
failed += [f"rank {rank}: state_dict(keep=False) kept weights" for _ in [0] if ema_whole(keep=False)]
before = whole()
with ema.applied(engine.module):
    during = whole()
failed += [f"rank {rank}: {n} is not the EMA while it is applied" for n in during
           if not torch.equal(during[n], known[n])]  # fmt: skip
after = whole()
failed += [f"rank {rank}: {n} was not restored" for n in after if not torch.equal(after[n], before[n])]
failed += [f"rank {rank}: the EMA of {n} was lost" for n, v in ema_whole().items() if not torch.equal(v, known[n])]
saved = trainable_weights(engine.module, zero3=True, keep=True)
failed += [f"rank {rank}: {n} saved wrong" for n in saved if not torch.equal(saved[n], before[n])]

x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))  # one optimizer step
engine.backward(engine(x).square().mean())
engine.step()
stepped = whole()
failed += [f"rank {rank}: the step left {n} as it was" for n in stepped if torch.equal(stepped[n], before[n])]
ema.update(engine.module)  # decay 0.5: halfway between the shadow and the weights
failed += [f"rank {rank}: the EMA of {n} did not move halfway to the stepped weights" for n, v in ema_whole().items()
           if not torch.allclose(v, 0.5 * known[n] + 0.5 * stepped[n], rtol=0, atol=1e-6)]  # fmt: skip
print("\n".join(failed + ["FAIL" if failed else "OK"]), flush=True)
torch.distributed.barrier()
# Straight out, without the interpreter's teardown: there, now and then, a rank of this short script
# aborted in C++ ("terminate called without an active exception") after its checks had passed.
os._exit(1 if failed else 0)
