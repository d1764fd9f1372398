"""Run by tests/test_train.py under `deepspeed --num_gpus 2`: the EMA applied to the model and its
update, and the checkpoint gather, under ZeRO-3 with every weight partitioned (persistence threshold
0). Prints one line per failed check, then OK or FAIL."""

import sys

import torch

from stepfast.config import OptimConfig
from stepfast.engine import EMA, build_engine, init_distributed, trainable_weights

rank, world, device = init_distributed()
torch.manual_seed(0)
module = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
optim = OptimConfig(zero_stage=3, deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
engine, _, _ = build_engine(module, optim, micro_batch=1, accumulation=1)
ema = EMA(engine.module, 0.5, zero_stage=3)
for i, name in enumerate(sorted(ema.shadow)):
    ema.shadow[name] = torch.full_like(ema.shadow[name], float(i + 2))  # known, unlike any weight


def whole():
    """Every weight, gathered: what the model computes with (not the optimizer's masters)."""
    out = {}
    for name, param in engine.module.named_parameters():
        with torch.no_grad(), __import__("deepspeed").zero.GatheredParameters([param]):
            out[name] = param.detach().clone()
    return out


failed = []
before = whole()
with ema.applied(engine.module):
    during = whole()
failed += [f"rank {rank}: {n} is not the EMA while it is applied" for n in during
           if not torch.equal(during[n], torch.full_like(during[n], float(sorted(ema.shadow).index(n) + 2)))]
after = whole()
failed += [f"rank {rank}: {n} was not restored" for n in after if not torch.equal(after[n], before[n])]
failed += [f"rank {rank}: the EMA of {n} was lost" for i, n in enumerate(sorted(ema.shadow))
           if not torch.equal(ema.shadow[n], torch.full_like(ema.shadow[n], float(i + 2)))]
saved = trainable_weights(engine.module, zero3=True, keep=True)
failed += [f"rank {rank}: {n} saved wrong" for n in saved if not torch.equal(saved[n], before[n])]
ema.update(engine.module)  # decay 0.5: halfway between the shadow and the weights
failed += [f"rank {rank}: the EMA of {n} did not move halfway to the weights" for i, n in enumerate(sorted(ema.shadow))
           if not torch.allclose(ema.shadow[n], 0.5 * (i + 2) + 0.5 * before[n])]
print("\n".join(failed + ["FAIL" if failed else "OK"]))
sys.exit(1 if failed else 0)
