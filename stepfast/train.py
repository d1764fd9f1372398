"""The main job: GRPO fine-tuning of a flow-matching text-to-image model.

    deepspeed stepfast/train.py [--config NAME|FILE.yaml] [key=value ...]
    python stepfast/train.py ...                      (one rank, no launcher)

With no config it trains the embedded tiny SD3 model on ShapeEval prompts with stepwise credit and
the DDIM sampler. One iteration: sample G prompts x N trajectories, estimate the clean image of every
intermediate state (every credit but flow_grpo, which scores the final images only), score them,
turn rewards into per-step advantages, and update the policy.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a script (deepspeed stepfast/train.py): import the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":  # before the imports below (seconds): a Ctrl-C among them is a line, not a traceback
    from stepfast import quiet_ctrl_c_while_starting

    quiet_ctrl_c_while_starting("stepfast")

import torch
from tqdm import tqdm

from stepfast import checkpoint, grpo, heldout, runfolder
from stepfast.config import ConfigError, config_warnings, load_config, to_dict, to_yaml
from stepfast.data.prompts import PromptRecord
from stepfast.data.sampler import KRepeatSampler
from stepfast.ema import EMA
from stepfast.engine import (
    all_gather_cat, build_engine, init_distributed, reduce_stats, trainable_weights, unread_settings,
)
from stepfast.files import ANOTHER, RunLock, write_atomically
from stepfast.kernels import select_backend
from stepfast.metrics import MetricsLogger, import_wandb, read_logged, write_json
from stepfast.policy import (
    check_resolution, decode, encode_prompts, grid_shift, latent_shape, load_policy_pipeline, quiet_loading_bars,
    quiet_truncation_notices, save_lora, save_transformer,
)
from stepfast.report import eval_tag
from stepfast.rewards.async_scoring import AsyncScorer, InlineScorer
from stepfast.rewards.combine import has_a_mean
from stepfast.rewards.transport import RewardServerError
from stepfast.rollout import sample_noise
from stepfast.sde import sd3_time_grid
from stepfast.startup import (
    PromptFiles, another_run_there, build_eval_reward, build_reward, check_before_start, check_prompts,
    check_reward_names, check_servers, cut_prompt_warnings, iteration_problem, trained_steps_of, untagged_problem,
)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        if "unrecognized arguments" in message:  # `--lr 1e-4`, `--iterations=3`: settings as options
            message += "; settings are given as key=value, without dashes (iterations=3 optim.lr=1e-4)"
        super().error(message)


def parse_args(argv=None):
    from stepfast.config import CONFIG_DIR

    presets = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    epilog = textwrap.fill(
        "Every key, its type and its default is in stepfast/config.py (docs/configuration.md lists those set most); "
        "--print-config shows what a preset and overrides resolve to. A run writes to output_dir "
        "(runs/<preset> in the presets): config.yaml, metrics.csv, tensorboard/, checkpoints/, report/; "
        "resume=auto continues its newest checkpoint."
    )
    p = _ArgumentParser(description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="default",
                   help=f"preset name ({presets}; default: %(default)s), or a YAML file: its keys are set over "
                        "the code's defaults (those of config.py, not of the default preset)")  # fmt: skip
    p.add_argument("--print-config", action="store_true",
                   help="print the configuration the preset and overrides give, as YAML, and exit")  # fmt: skip
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("overrides", nargs="*", help="key=value overrides, dotted (e.g. optim.lr=1e-4)")
    # intermixed: `train.py iterations=2 --config flow_grpo seed=1` keeps both overrides (plain
    # parse_args stops collecting positionals at the first option and rejects the rest)
    return p.parse_intermixed_args(argv)


class EvalSetup(NamedTuple):
    """What every evaluation of a run draws and scores, read and checked at start."""

    metadata: list[dict]  # the held-out prompts' records, spread over categories up to eval.limit
    plan: list[tuple[dict, int]]  # (record, seed) of every image, prompt-major
    reward: object  # eval.reward, with its reward.options
    records: list[PromptRecord]  # the lines of eval.prompts that `metadata` holds, in its order


class Trainer:
    def __init__(self, cfg, rank: int, world: int, device: torch.device, prompts: PromptFiles, lock: RunLock):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.out = Path(cfg.output_dir)
        self.main = rank == 0
        if not self.main:
            quiet_loading_bars()  # the first rank's bars say it
        # checked on every rank before the model loads (they would wait in a collective for rank 0):
        # wandb when asked for, the checkpoint resumed and the metrics logged so far (read once, here)
        if cfg.log.wandb:
            import_wandb()
        logged = read_logged(self.out / "metrics.csv") if (self.out / "metrics.csv").exists() else None
        self.resume_from = runfolder.resume_path(cfg, self.out)
        if self.resume_from is not None:
            runfolder.check_resumable(cfg, self.resume_from, self.out, world)
        self.prompts = prompts.train
        self.sampler = KRepeatSampler(len(self.prompts), cfg.rollout.groups, cfg.rollout.group_size,
                                      world, rank, cfg.seed, strata=self._strata())  # fmt: skip
        self.reward = build_reward(cfg, device)
        check_prompts(self.reward, self.prompts, "rollout.prompts", cfg.rollout.prompts)
        check_servers({f"reward.options.{name}": part for name, part in self.reward.rewards.items()}, world,
                      size=cfg.rollout.resolution)  # fmt: skip
        # The held-out prompts and their reward, read once and at start: a bad eval prompt file is
        # an error before training, not at the first evaluation.
        self.eval_setup = self._eval_setup(prompts.eval) if cfg.eval.enabled else None
        self.scorer = AsyncScorer(self.reward, device) if cfg.reward.async_scoring else InlineScorer(self.reward)
        self.pipe = load_policy_pipeline(cfg.model, device)
        check_resolution(self.pipe, cfg.rollout.resolution, "rollout.resolution")  # before anything is written
        if self.main:  # said once; diffusers' notice at every encoding of them is dropped on every rank
            # eval.prompts: the prompts eval.limit draws, which are the ones encoded
            drawn = self.eval_setup.records if self.eval_setup is not None else None
            files = {"rollout.prompts": (cfg.rollout.prompts, self.prompts), "eval.prompts": (cfg.eval.prompts, drawn)}
            for warning in cut_prompt_warnings(self.pipe, files):
                print(f"stepfast: warning: {warning}", file=sys.stderr)
        quiet_truncation_notices(self.pipe)
        self.grid = sd3_time_grid(cfg.sde.steps, shift=grid_shift(self.pipe.scheduler.config))
        steps = self.trained_steps = grpo.trained_steps(cfg, self.grid)
        backward_calls = self._backward_calls(steps)
        accumulation = backward_calls // cfg.optim.updates_per_iteration
        if self.main:
            for warning in unread_settings(cfg.optim, cfg.rollout.micro_batch, accumulation):
                print(f"stepfast: warning: {warning}", file=sys.stderr)
        self.engine, self.optimizer, self.scheduler = build_engine(
            self.pipe.transformer, cfg.optim, cfg.rollout.micro_batch, accumulation
        )
        # ZeRO-3 gathers and frees every weight around each forward, so no CUDA graph can hold them
        # (DeepSpeed does not support graphs with ZeRO-3): its estimates run eagerly
        self.estimator = grpo.Estimator(self.engine.module, cfg.rollout.cfg,
                                        use_cuda_graph="auto" if cfg.optim.zero_stage < 3 else False,
                                        batch=cfg.rollout.estimate_batch)  # fmt: skip
        self.ema = EMA(self.engine.module, cfg.optim.ema, cfg.optim.zero_stage) if cfg.optim.ema > 0 else None
        self.stepwise = cfg.credit != "flow_grpo"  # flow_grpo credits the final reward only: no estimates
        if self.main:
            self._print_setup(steps)
        self.start, self.evals = 1, {}
        self.resume()
        self._take_output_dir(lock)
        self.logger = MetricsLogger(self.out, self.main, cfg.log.tensorboard, cfg.log.wandb,
                                    cfg.log.wandb_project, to_dict(cfg), resume_from=self.start - 1,
                                    logged=logged)  # fmt: skip
        if self.main:  # written once the run is set up: a run that fails to start leaves the old one
            if self.resume_from is not None:
                runfolder.keep_changed_settings(cfg, self.out, self.resume_from, self.start - 1)
                if self.start <= cfg.iterations:  # training on: later weights' evaluations set aside
                    runfolder.set_aside_later_evaluations(self.out, self.start)
                runfolder.bring_evaluations(self.out, self.resume_from, self.evals, cfg.log.report, self.start)
            else:
                runfolder.keep_other_config(self.out, to_yaml(cfg))
            write_atomically(self.out / "config.yaml", lambda tmp: tmp.write_text(to_yaml(cfg)))

    def _take_output_dir(self, lock: RunLock) -> None:
        """The first rank creates output_dir and locks it for the run, before anything is written
        there: another run that started there since this one looked (check_before_start) is
        refused, on every rank, as it would write over this one."""
        holder = lock.take() if self.main else None
        refused = reduce_stats({"refused_max": float(holder is not None)}, self.world, self.device)["refused_max"]
        if refused:
            exc = ConfigError(another_run_there(self.out, holder or ANOTHER))
            exc.stepfast_reported = not self.main  # the first rank says it
            raise exc

    # ---------------------------------------------------------------------------------------------
    def _backward_calls(self, steps: list[int]) -> int:
        """Backward passes per iteration and rank (trained steps x micro-batches); a ConfigError when
        no step is trained or optim.updates_per_iteration does not divide them (found at start from
        the model's scheduler config; here from the pipeline loaded)."""
        if problem := iteration_problem(self.cfg, steps, self.world):
            raise ConfigError(problem)
        return len(steps) * len(grpo.micro_batches(self.sampler.per_rank, self.cfg.rollout.micro_batch))

    def _print_setup(self, steps: list[int]) -> None:
        """Where the work runs (a CUDA graph capture that fails warns and runs eagerly), and warnings
        for settings that run but are probably not meant."""
        cfg, world = self.cfg, self.world
        setup = [f"{world} rank{'s' if world > 1 else ''} on {self.device.type}",
                 f"SDE kernels {select_backend(self.device)}"]  # fmt: skip
        if self.stepwise:
            graph = self.device.type == "cuda" and self.estimator.engine.use_cuda_graph is not False
            setup.append(f"estimates {'in a CUDA graph' if graph else 'eager'}")
        print(f"stepfast: {', '.join(setup)}, ZeRO-{cfg.optim.zero_stage}, {cfg.optim.precision}")
        for warning in config_warnings(cfg, steps):
            print(f"stepfast: warning: {warning}", file=sys.stderr)

    def _strata(self) -> list[str] | None:
        """The category of each prompt when rollout.balance_categories is on."""
        if not self.cfg.rollout.balance_categories:
            return None
        # found at start (startup.check_before_start), before the process group; again here for a
        # Trainer built without that start
        if problem := untagged_problem(self.prompts, self.cfg.rollout.prompts):
            raise ConfigError(problem)
        return [record.metadata["tag"] for record in self.prompts]

    def resume(self) -> None:
        if self.cfg.resume == "none":
            return
        path = self.resume_from
        if path is None:
            if self.main:
                replaced = " (replacing its metrics.csv)" if (self.out / "metrics.csv").exists() else ""
                print(f"stepfast: resume=auto found no checkpoint in {self.out}; starting fresh{replaced}")
            return
        state = checkpoint.load(path, self.engine, self.rank)
        if self.ema is not None and state.get("ema") is not None:
            self.ema.load_state_dict(state["ema"])
        elif self.ema is not None:  # optim.ema turned on at this resume: average from the resumed weights
            self.ema = EMA(self.engine.module, self.cfg.optim.ema, self.cfg.optim.zero_stage)
            if self.main:
                print(f"stepfast: {path} holds no EMA (optim.ema was 0): the EMA starts from its weights")
        self.start = state["iteration"] + 1
        self.evals = state.get("evals", {})
        if self.main and self.start > self.cfg.iterations:
            print(f"stepfast: resumed from {path} at iteration {self.start}: iterations={self.cfg.iterations} "
                  "are done, nothing is left to train (raise iterations to train on); finishing the run's "
                  "evaluation and report")  # fmt: skip
        elif self.main:
            print(f"stepfast: resumed from {path} at iteration {self.start}")

    def save(self, iteration: int) -> Path:
        # collective under ZeRO (every rank takes part in assembling each weight); rank 0 keeps them
        ema = self.ema.state_dict(keep=self.main) if self.ema is not None else None
        weights = trainable_weights(self.engine.module, self.cfg.optim.zero_stage == 3, keep=self.main)
        state = {"iteration": iteration, "sampler_position": iteration, "evals": self.evals, "ema": ema}
        if self.main:
            self.logger.sync()  # the rows a resume from this checkpoint keeps
        return checkpoint.save(self.out, iteration, self.engine, state, self.rank, self.world,
                               lambda folder: self._save_weights(folder, weights, ema),
                               keep=self.cfg.keep_checkpoints)  # fmt: skip

    def _save_weights(self, folder: Path, weights: dict[str, torch.Tensor], ema: dict | None) -> None:
        """Into a checkpoint folder, in diffusers' format: the adapter as trained in `lora/` (full
        fine-tuning: the transformer in `transformer/`); with EMA on, also the EMA weights (what
        evaluation samples with) in `lora_ema/` (`transformer_ema/`)."""
        module = self.engine.module
        save, name = (save_lora, "lora") if self.cfg.model.lora else (save_transformer, "transformer")
        save(module, folder / name, weights=weights)
        if ema is not None:
            save(module, folder / f"{name}_ema", weights=ema["shadow"])

    # ---------------------------------------------------------------------------------------------
    def _clock(self) -> float:
        """The time once the GPU has done the work queued so far, so that each phase's time is its own
        and not partly the next one's (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def iteration(self, it: int) -> dict[str, float]:
        cfg = self.cfg
        times = {}
        t0 = self._clock()
        batch = self.sampler.batch(it)
        records = [self.prompts[i] for i in batch.indices]
        texts = [r.prompt for r in records]
        metas = [r.metadata for r in records] if all(r.metadata for r in records) else None
        cond = encode_prompts(self.pipe, texts, cfg.rollout.cfg, self.device)
        shape = latent_shape(self.pipe, 1, cfg.rollout.resolution)[1:]
        x_init, noise = sample_noise(cfg.seed, it, batch.groups, batch.members, shape, cfg.sde.steps,
                                     cfg.rollout.same_latent)  # fmt: skip
        model = self.engine.module
        model.eval()
        traj = grpo.rollout(model, cond, x_init.to(self.device), noise.to(self.device), self.grid, cfg)
        times["time/rollout"] = self._clock() - t0

        # the final images are scored (in the background with reward.async_scoring) while the
        # clean estimates of the intermediate states are computed
        t0 = self._clock()
        bs = cfg.reward.batch_size
        pending_final = grpo.submit_scores(self.scorer, decode(self.pipe, traj.states[-1], cfg.rollout.decode_batch), texts, metas, bs)
        if self.stepwise:
            est = grpo.estimate_images(self.pipe, self.estimator, cond, traj, cfg, prompts=texts)
            steps = est.shape[0]
            pending_est = grpo.submit_scores(self.scorer, est.flatten(0, 1), texts * steps,
                                             None if metas is None else metas * steps, bs)  # fmt: skip
        times["time/estimates"] = self._clock() - t0

        t0 = self._clock()
        name_final, name_estimate = self._image_names(batch, texts)  # for an error about a reward
        final = grpo.collect_scores(pending_final, name_final)
        local_rewards = torch.zeros(len(texts), cfg.sde.steps + 1)
        local_rewards[:, -1] = final["score"]
        if self.stepwise:
            local_rewards[:, :-1] = grpo.collect_scores(pending_est, name_estimate)["score"].reshape(steps, -1).T
        global_rewards = all_gather_cat(local_rewards.to(self.device), self.world).cpu()
        group_texts = [self.prompts[i].prompt for i in self.sampler.group_prompts(it)]  # every rank's groups
        adv = grpo.advantages(global_rewards, cfg, group_texts)[batch.start: batch.start + len(texts)]
        times["time/rewards"] = self._clock() - t0

        t0 = self._clock()
        lr = float(self.scheduler.get_last_lr()[0])  # this iteration's (its first optimizer step's)
        stats = grpo.update(self.engine, cond, traj, adv, cfg, self.ema)
        times["time/update"] = self._clock() - t0

        # each part's mean over the images; per-category figures are category/<tag> below
        parts = {f"reward/{k}": float(v.mean()) for k, v in final.items() if has_a_mean(k)}
        metrics = {"reward": float(global_rewards[:, -1].mean()),
                   "reward_std": float(global_rewards[:, -1].std(correction=0)), **parts, **stats.summary(),
                   "lr": lr, **times}  # fmt: skip
        if self.stepwise:
            metrics.update({f"gain/{j}": float(g) for j, g in enumerate(grpo.gain_magnitudes(global_rewards))})
        metrics = reduce_stats(metrics, self.world, self.device)
        # gathered, so the same on every rank: added after the reduction
        tags = [(self.prompts[i].metadata or {}).get("tag") for i in self.sampler.group_prompts(it)]
        metrics.update(grpo.category_rewards(global_rewards[:, -1], tags, cfg.rollout.group_size))
        metrics["time/iteration"] = sum(v for k, v in metrics.items() if k.startswith("time/"))
        return metrics

    def _image_names(self, batch, texts: list[str]):
        """What the final image and the estimate at position i of this rank's scored batches are,
        in words: (name_final(i), name_estimate(i)), for a reward's error about them."""

        def sample(k: int) -> str:
            return f"group {batch.groups[k] + 1}, member {batch.members[k] + 1} ({texts[k]!r})"

        def estimate(i: int) -> str:  # state j of sample k sits at j * B + k
            j, k = divmod(i, len(texts))
            return f"{sample(k)}: the estimate from state {j} (t = {float(self.grid[j]):.3f})"

        return (lambda i: f"{sample(i)}: the final image"), estimate

    def _eval_setup(self, records: list[PromptRecord]) -> EvalSetup:
        """The held-out prompts (eval.prompts' `records`), the images to draw of them, and their
        reward, checked."""
        cfg = self.cfg
        reward = build_eval_reward(cfg, self.device, self.reward)
        check_prompts(reward, records, "eval.prompts", cfg.eval.prompts)
        # plain prompts (a .txt file) get the record the reward scores them against where it parses
        # them (ShapeEval's), with its category: spread over categories and seeds as `stepfast.evaluate`
        # spreads the same file
        parse = getattr(reward, "record", None)
        metas = [r.metadata or (dict(parse(r.prompt)) if parse else {"prompt": r.prompt}) for r in records]
        picked = heldout.spread_indices(metas, cfg.eval.limit or None)
        metas, records = [metas[i] for i in picked], [records[i] for i in picked]
        check_servers({f"eval.reward={cfg.eval.reward} (reward.options.{cfg.eval.reward})": reward}, self.world,
                      size=cfg.rollout.resolution)  # fmt: skip
        return EvalSetup(metas, heldout.plan_samples(metas, cfg.eval.seeds, cfg.eval.min_images), reward, records)

    def evaluate(self, tag: str, keep_images: bool = False) -> dict:
        """ODE sampling with CFG on the held-out prompts, EMA weights when kept. Every rank draws an
        equal share of the images and gets every score (so every rank knows which evaluations are
        done); only rank 0, which writes eval_{tag}.json and the report, gets the images, and only
        when `keep_images`."""
        cfg = self.cfg
        metas, plan, reward, _ = self.eval_setup  # set at start whenever the config evaluates
        share, real = heldout.shard(plan, self.rank, self.world)
        with self.ema.applied(self.engine.module) if self.ema is not None else contextlib.nullcontext():
            # the bar counts the first rank's share of the images
            desc = f"eval {tag}" + (f" (rank 0: {len(share)} of {len(plan)})" if self.world > 1 else "")
            scored = heldout.draw_and_score(self.pipe, share, cfg.eval.steps, cfg.eval.cfg,
                                            batch_size=cfg.eval.batch_size, reward=reward, reward_name=cfg.eval.reward,
                                            size=cfg.rollout.resolution, progress=self.main, desc=desc)  # fmt: skip
        scored = {k: (v if k == "seconds" else v[:real]) for k, v in scored.items()}
        if self.world > 1:
            pixels = scored.pop("pixels")  # the images are most of the bytes: scores alone go to every rank
            parts = [None] * self.world
            torch.distributed.all_gather_object(parts, scored)
            scored = heldout.unshard(parts, self.world)
            if keep_images:
                held = [None] * self.world if self.main else None
                torch.distributed.gather_object(pixels, held, dst=0)
                pixels = heldout.interleave(held, self.world) if self.main else pixels
            scored["pixels"] = pixels  # on other ranks their own share: summarise reads only its size
        settings = heldout.settings(self.pipe, metas, cfg.eval.seeds, cfg.eval.steps, cfg.eval.cfg, cfg.eval.min_images,
                                    cfg.eval.batch_size)  # fmt: skip
        result = heldout.summarise(plan, scored, settings, keep_images and self.main)
        self.evals[tag] = {"overall": result["overall"], "categories": result["categories"]}
        if tag in ("before", "after"):  # every image's result, for the gain's standard error (also after a resume)
            self.evals[tag]["samples"] = result["samples"]
        if self.main:
            write_json(self.out / f"eval_{tag}.json", {k: v for k, v in result.items() if k != "images"})
            print(f"stepfast: eval {tag}: overall strict {result['overall']['strict']:.3f} "
                  f"score {result['overall']['score']:.3f}")  # fmt: skip
        return result

    # ---------------------------------------------------------------------------------------------
    def fit(self) -> None:
        cfg = self.cfg
        last = None
        if cfg.eval.before_after and "before" not in self.evals:
            before = self.evaluate("before", keep_images=True)
            if self.main and cfg.log.report:  # saved now, once: the report links it, a resumed run's too
                from stepfast.report import save_grid

                save_grid(self.out, "before", before, cfg)
        bar = tqdm(range(self.start, cfg.iterations + 1), initial=self.start - 1, total=cfg.iterations,
                   desc="train", unit="it", disable=not self.main, dynamic_ncols=True)  # fmt: skip
        it = self.start - 1
        try:
            for it in bar:
                metrics = self.iteration(it)
                # the last iteration's weights are evaluated after training, when that evaluation runs
                last_is_after = it == cfg.iterations and cfg.eval.before_after
                if cfg.eval.every and it % cfg.eval.every == 0 and not last_is_after:
                    result = self.evaluate(eval_tag(it))
                    metrics["eval/strict"] = result["overall"]["strict"]
                    metrics["eval/score"] = result["overall"]["score"]
                self.logger.log(it, metrics)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", s_it=f"{metrics['time/iteration']:.1f}")
                if (cfg.checkpoint_every and it % cfg.checkpoint_every == 0) or it == cfg.iterations:
                    last = self.save(it)
        except BaseException as exc:
            _stop.stopping = True  # a SIGTERM from here on (the launcher's, after a Ctrl-C) lets this be said
            if self.main:
                latest = checkpoint.latest(self.out)
                why = _why_stopped(exc)
                resume = "; resume=auto (the same command and output_dir) continues from it" if latest else ""
                print(f"\nstepfast: training stopped at iteration {it}: {why}\n"
                      f"stepfast: last checkpoint: {latest or 'none'}{resume}", file=sys.stderr)  # fmt: skip
                exc.stepfast_reported = True  # main() does not say it again; another rank's own error it does
            # the batches still queued for the reward are dropped: scored at exit, against a reward
            # server that has died, each would wait out its retries before the process could end
            self.scorer.close(wait=False)
            raise
        finally:
            bar.close()
        after = self.evaluate("after", keep_images=True) if cfg.eval.before_after else None
        if self.main:
            from stepfast.report import eval_measure, gain_line, write_report

            if line := gain_line(self.evals, measure=eval_measure(cfg)):
                print(f"stepfast: {line}")
            if cfg.log.report:
                write_report(self.out, self.logger.rows, self.evals, after, cfg, self.trained_steps)
        self.logger.close()
        self.scorer.close()
        last = last or self.resume_from  # nothing trained after the checkpoint resumed
        if self.main and last is not None:
            print(f"stepfast: done; checkpoint {last}")
        if self.main and cfg.log.report:
            print(f"stepfast: report {self.out / 'report' / 'summary.md'}; metrics {self.out / 'metrics.csv'}")


class Terminated(KeyboardInterrupt):
    """SIGTERM, stopping a run as Ctrl-C does: what `deepspeed` sends each rank when it gets a Ctrl-C
    (right after the Ctrl-C itself, which would otherwise kill a rank before it says where it stopped),
    and what `timeout`, a scheduler's time limit or `kill` send."""


class _stop:
    stopping = False  # the trainer is saying where it stopped: a SIGTERM then is noted, not raised
    signalled = False  # a SIGTERM came


def _on_sigterm(signum, frame) -> None:
    _stop.signalled = True
    if not _stop.stopping:
        raise Terminated("SIGTERM")


def _why_stopped(exc: BaseException) -> str:
    """The reason a stopped run gives: the exception; a collective that lost its peer (another rank
    stopped first, and prints its own error) said as such on one line, and a SIGTERM, or a peer lost
    to one, as what it is."""
    if isinstance(exc, Terminated) or (_stop.signalled and _lost_peer(exc)):
        return "SIGTERM (deepspeed sends it to every rank at a Ctrl-C; or a kill, a time limit)"
    if _lost_peer(exc):
        first = str(exc).strip().splitlines()[0]
        return f"another rank stopped (it prints its own error); here: {type(exc).__name__}: {first}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__  # Ctrl-C has no message


def _lost_peer(exc: BaseException) -> bool:
    """A collective of a run of several ranks failed because the rank at its other end had gone:
    gloo's (or NCCL's) words for it, raised from torch.distributed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not isinstance(exc, RuntimeError):
        return False
    if isinstance(exc, RewardServerError):  # its message may quote a reset connection: the server's
        return False
    words = ("Connection closed by peer", "Connection reset by peer", "remote worker crash", "Broken pipe",
             "NCCL communicator was aborted")
    if not any(w in str(exc) for w in words):
        return False
    tb, frames = exc.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename.replace(os.sep, "/"))
        tb = tb.tb_next
    return any("/torch/distributed/" in f or "/deepspeed/comm/" in f for f in frames)


def main(argv=None, handle_sigterm: bool = False) -> int:
    """The trainer; `handle_sigterm` (the script's entry point) turns SIGTERM into a stop that says
    where it stopped, as Ctrl-C's does, and exits at once after it (os._exit: a reward request still
    in flight would hold the process past the launcher's patience)."""
    previous, installed = None, False
    try:
        _stop.stopping = _stop.signalled = False
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            previous, installed = signal.signal(signal.SIGTERM, _on_sigterm), True
        code = _run(argv)
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    if installed and _stop.signalled:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(argv) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: a line, not a traceback (in training, the trainer's two)
        if not getattr(exc, "stepfast_reported", False) and os.environ.get("RANK", "0") == "0":
            what = "stopped by SIGTERM" if isinstance(exc, Terminated) else "interrupted"
            print(f"\nstepfast: {what} before training began or after it ended", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except RuntimeError as exc:
        # a collective cut by another rank that stopped first (or by a SIGTERM): the first rank said
        # where the run stopped, and the first cause is the other rank's to print; a traceback of the
        # lost collective on every rank would bury it
        if not _lost_peer(exc):
            raise
        if not getattr(exc, "stepfast_reported", False):
            rank = os.environ.get("RANK", "0")
            print(f"\nstepfast: rank {rank}: stopped: {_why_stopped(exc)}", file=sys.stderr)
        return 143 if _stop.signalled else 1


def print_config_warnings(cfg) -> list[str]:
    """The warnings a run would print at start, for --print-config: with the steps trained when the
    model's scheduler config can be read (the grid's shift), and the DeepSpeed settings the installed
    DeepSpeed would not read when optim.deepspeed sets any."""
    warnings = config_warnings(cfg, trained_steps_of(cfg))
    if cfg.optim.deepspeed:
        from stepfast.engine import unread_settings

        warnings += unread_settings(cfg.optim, cfg.rollout.micro_batch, 1)  # top-level keys: any accumulation
    return warnings


def _start_error(exc: Exception) -> int:
    """A refusal before the process group: every rank of a node reads the same config and files, so
    the node's first rank says it (a launcher's ranks said it once each); exit 2. The others wait a
    moment before they exit: a launcher kills every rank at the first exit it sees, which could be
    before the first rank has printed."""
    if os.environ.get("LOCAL_RANK", "0") == "0" or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        print(f"stepfast: config error: {exc}", file=sys.stderr)
    else:
        time.sleep(3)
    return 2


def _main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check_reward_names(cfg)  # a mistyped reward is a mistyped setting, printed or not
    except ConfigError as exc:
        return _start_error(exc)
    if args.print_config:
        print(to_yaml(cfg), end="")
        for warning in print_config_warnings(cfg):
            print(f"stepfast: warning: {warning}", file=sys.stderr)
        return 0
    try:  # on every rank, before the process group (and a build of its op) and the model
        prompts = check_before_start(cfg)
    except ConfigError as exc:
        return _start_error(exc)
    rank, world, device = init_distributed()
    torch.manual_seed(cfg.seed + rank)
    lock = RunLock(cfg.output_dir)  # the first rank's, while the run writes there
    try:
        Trainer(cfg, rank, world, device, prompts, lock).fit()
    except (ConfigError, FileNotFoundError, NotADirectoryError, ValueError, ImportError, RewardServerError) as exc:
        # bad input (config, model directory, prompt file, reward name, a NaN reward), exit 2; or a
        # reward server that failed (stopped answering, refused a request, sent bad scores), exit 1:
        # the message names it
        if not getattr(exc, "stepfast_reported", False):
            print(f"stepfast: {f'rank {rank}: ' if world > 1 else ''}error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, RewardServerError) else 2
    finally:
        # Left to the interpreter's exit, gloo's threads can abort the process ("terminate called
        # without an active exception", exit code 250 for the 2 of a named error) when a rank stops
        # right after a collective, such as the start-up check of a reward server.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        lock.release()
    return 0


if __name__ == "__main__":
    from stepfast import ctrl_c_as_usual

    ctrl_c_as_usual()
    sys.exit(main(handle_sigterm=True))
