"""Configuration: presets, dotted overrides, and errors that name the key."""

import re
from pathlib import Path

import pytest
import torch

from stepfast import config as config_module
from stepfast import credit, sde
from stepfast.config import ConfigError, load_config


@pytest.mark.parametrize("name", ["default", "flow_grpo", "sd3_medium_geneval", "sd3_medium_pickscore"])
def test_presets_load_round_trip_and_lay_out_an_iteration(name, tmp_path):
    """Each preset writes to runs/<name>, reads back from its YAML (config.to_yaml, which a run writes
    as config.yaml) as the same settings, has a trained step, and lays out an iteration on one rank
    and on eight (the SD3.5 presets on SD3.5's time grid, shift 3, as their model directory is not
    here)."""
    from stepfast import grpo
    from stepfast.config import to_yaml
    from stepfast.startup import iteration_problem, trained_steps_of

    cfg = load_config(name)
    assert cfg.output_dir == f"runs/{name}"
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert load_config(str(tmp_path / "config.yaml")) == cfg
    if cfg.model.path == "embedded":
        steps = trained_steps_of(cfg)
    else:
        steps = grpo.trained_steps(cfg, sde.sd3_time_grid(cfg.sde.steps, shift=3.0))
    assert steps, name
    for world in (1, 8):
        assert iteration_problem(cfg, steps, world) is None, (name, world)


def test_default_and_flow_grpo_presets():
    default, flow = load_config("default"), load_config("flow_grpo")
    assert (default.credit, default.sampler, default.rollout.same_latent) == ("stepwise", "ddim", True)
    assert default.reward.weights == {"shapes": 1.0} and default.model.path == "embedded"
    assert (flow.credit, flow.sampler, flow.sde.noise_level) == ("flow_grpo", "flow_sde", 0.7)
    assert flow.sde.window is None and flow.sde.timestep_fraction == 0.99 and not flow.rollout.same_latent
    assert flow.optim.clip_range == 1e-4 and flow.credit_opts.adv_clip == 5.0
    assert flow.credit_opts.global_std is False  # per-prompt statistics
    assert flow.model.lora_targets == FLOW_GRPO_LORA_TARGETS
    # same model, batch and budget
    for key in ("iterations",):
        assert getattr(flow, key) == getattr(default, key)
    assert (flow.model.path, flow.rollout.groups, flow.rollout.group_size, flow.sde.steps) == (
        default.model.path, default.rollout.groups, default.rollout.group_size, default.sde.steps)


# Flow-GRPO's LoRA targets on SD3: the attention projections of both streams
FLOW_GRPO_LORA_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                          "attn.to_out.0", "attn.to_q", "attn.to_v"]  # fmt: skip


def test_sd3_presets_follow_method_defaults():
    """METHOD.md's SD3.5-M defaults: 512 px, 10 train / 40 eval steps, CFG 4.5, group 24, 48 groups,
    LoRA r 32 alpha 64 on the attention projections, AdamW lr 3e-4, grad clip 1, EMA, 2 optimizer steps
    per iteration; beta 0.04 (GenEval) or 0.01 (PickScore)."""
    for name, beta in (("sd3_medium_geneval", 0.04), ("sd3_medium_pickscore", 0.01)):
        cfg = load_config(name)
        assert (cfg.rollout.resolution, cfg.sde.steps, cfg.eval.steps, cfg.rollout.cfg) == (512, 10, 40, 4.5), name
        assert (cfg.rollout.group_size, cfg.rollout.groups, cfg.model.lora_rank, cfg.model.lora_alpha) == (
            24, 48, 32, 64), name  # fmt: skip
        assert cfg.model.lora and cfg.model.lora_targets == FLOW_GRPO_LORA_TARGETS, name
        assert (cfg.optim.lr, cfg.optim.grad_clip, cfg.optim.updates_per_iteration) == (3e-4, 1.0, 2), name
        assert cfg.optim.ema > 0 and cfg.optim.beta == beta, name


def test_dotted_overrides_and_types():
    cfg = load_config("default", ["iterations=3", "optim.lr=1e-5", "sde.window=[1, 4]", "rollout.same_latent=false",
                                  "reward.weights={shapes: 1.0, jpeg_compressibility: 0.5}", "optim.ema=0"])
    assert cfg.iterations == 3 and cfg.optim.lr == 1e-5 and cfg.sde.window == [1, 4]
    assert cfg.rollout.same_latent is False and cfg.reward.weights["jpeg_compressibility"] == 0.5
    assert isinstance(cfg.optim.ema, float)


def test_dotted_overrides_reach_into_mappings_and_keep_the_rest():
    """reward.options.pickscore.device=cuda:1 sets one option of a preset's reward and keeps its paths
    (reward.options={...} replaces the whole mapping); numbers written 5e8 are numbers there too."""
    cfg = load_config("sd3_medium_pickscore", ["reward.options.pickscore.device=cuda:1", "reward.weights.ocr=0.5",
                                               "optim.deepspeed={zero_optimization: {reduce_bucket_size: 5e8}}",
                                               "optim.deepspeed.zero_optimization.overlap_comm=true"])  # fmt: skip
    assert cfg.reward.options["pickscore"] == {"path": "/models/PickScore_v1", "device": "cuda:1",
                                               "processor_path": "/models/CLIP-ViT-H-14-laion2B-s32B-b79K"}  # fmt: skip
    assert cfg.reward.weights == {"pickscore": 1.0, "ocr": 0.5}
    assert cfg.optim.deepspeed == {"zero_optimization": {"reduce_bucket_size": 5e8, "overlap_comm": True}}
    assert isinstance(cfg.optim.deepspeed["zero_optimization"]["reduce_bucket_size"], float)
    assert load_config("default", ["optim.lr=1e-5"]).optim.lr == 1e-5 and load_config("default").optim.lr == 1e-3
    # a custom reward's import path has dots of its own: the name is matched whole
    cfg = load_config("default", ["reward.weights={shapes: 1.0, my.rewards:Score: 0.5}",
                                  "reward.options.my.rewards:Score.device=cuda:1", "reward.weights.my.rewards:Score=2"])
    assert cfg.reward.options == {"my.rewards:Score": {"device": "cuda:1"}}
    assert cfg.reward.weights == {"shapes": 1.0, "my.rewards:Score": 2.0}


def test_a_key_that_holds_text_keeps_what_was_typed_on_the_command_line():
    """output_dir=1e-3 names a folder: YAML reads the value as a number (or a date, or a boolean), the
    key holds text, so the text as typed is kept (not "0.001"); numbers stay numbers and errors stay
    errors elsewhere."""
    cfg = load_config("default", ["output_dir=1e-3", "log.wandb_project=2024", "optim.lr=1e-3"])
    assert cfg.output_dir == "1e-3" and cfg.log.wandb_project == "2024" and cfg.optim.lr == 1e-3
    assert load_config("default", ["output_dir=2024-06-01"]).output_dir == "2024-06-01"  # not a date
    assert load_config("default", ["log.wandb_project=true"]).log.wandb_project == "true"
    assert load_config("default", ["output_dir=runs/007"]).output_dir == "runs/007"
    with pytest.raises(ConfigError, match="iterations: expected int"):
        load_config("default", ["iterations=abc"])
    # a whole number written as a float (iterations=1e3, which YAML reads as one) counts as one; text does
    # not (a quoted '12'), nor a float past 2**53, which may not be the integer typed
    assert load_config("default", ["iterations=1e3", "rollout.groups=4.0"]).iterations == 1000
    for bad, message in (("iterations=1.5", "expected a whole number, got 1.5"),
                         ("iterations=.inf", "expected a whole number, got inf"),
                         ("seed=9007199254740993.0", "expected a whole number below 2**53, got 9007199254740992.0"),
                         ("iterations='12'", "expected int, got '12' (str)")):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(f"{bad.split('=')[0]}: {message}")):
            load_config("default", [bad])
    assert load_config("default", ["seed=9007199254740993"]).seed == 9007199254740993  # an integer stays exact
    with pytest.raises(ConfigError, match="output_dir: expected str"):  # a list is not text
        load_config("default", ["output_dir=[1, 2]"])


def test_the_written_config_reads_back_the_same(tmp_path):
    """config.yaml (and --print-config) read back to the same configuration, strings that look like
    numbers included ("1e3" is a folder name, not 1000.0)."""
    from stepfast.config import to_dict, to_yaml

    cfg = load_config("sd3_medium_pickscore", ['output_dir="1e3"', "reward.options.pickscore.device='5e8'",
                                               "optim.deepspeed={zero_optimization: {reduce_bucket_size: 5e8}}"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert to_dict(load_config(str(path))) == to_dict(cfg)
    assert cfg.output_dir == "1e3" and cfg.reward.options["pickscore"]["device"] == "5e8"


@pytest.mark.parametrize("override, message", [
    ("rollout.group_sise=3", "did you mean 'rollout.group_size'?"),
    ("iterations=many", "iterations: expected int, got 'many'"),
    ("rollout.same_latent=3", "rollout.same_latent: expected true or false"),
    ("sampler=ddmi", "sampler: 'ddmi' is not one of flow_sde, cps, ddim; did you mean 'ddim'?"),
    ("credit=stepwize", "; did you mean 'stepwise'?"),
    ("model.dtype=bf61", "model.dtype: 'bf61' is not one of fp32, bf16, fp16; did you mean 'bf16'?"),
    ("sde.window=[3, 2]", "sde.window must be [start, end)"),
    ("sde.window=[0, 11]", "sde.window must be [start, end) with 0 <= start < end <= 10"),
    ("optim.ema=1", "optim.ema must be in [0, 1), got 1.0"),
    ("optim.zero_stage=0", "optim.zero_stage: 0 is not 1, 2 or 3"),
    ("rollout.substeps=0", "rollout.substeps must be >= 1, got 0"),
    ("rollout.micro_batch=0", "rollout.micro_batch must be >= 1, got 0"),
    ("rollout.decode_batch=0", "rollout.decode_batch must be >= 1, got 0"),
    ("optim.betas=[0.9, 1.0]", "optim.betas must be two numbers in [0, 1)"),
    ("iterations.x=3", "is a value, not a section"),
    ("iterations", "must look like key=value"),
    ("optim=3", "optim: expected a mapping, got 3"),
    ("optim.betas=[0.9]", "optim.betas must be two numbers in [0, 1), got [0.9]"),
    ("optim.lr=-1", "optim.lr must be >= 0, got -1.0"),
    ("optim.clip_range=0", "optim.clip_range must be > 0"),
    ("rollout.resolution=0", "rollout.resolution must be >= 1, got 0"),
    ("keep_checkpoints=0", "keep_checkpoints must be >= 1, got 0"),
    ("reward.batch_size=0", "reward.batch_size must be >= 1"),
    ("eval.seeds=0", "eval.seeds must be >= 1"),
    ("eval.batch_size=0", "eval.batch_size must be >= 1"),
    ("eval.limit=-1", "eval.limit must be >= 0"),
    ("seed=-1", "seed must be >= 0, got -1"),
    ("sde.noise_level=.nan", "sde.noise_level must be >= 0, got nan"),
    ("sde.eta=3", "sde.eta must be at most 1"),
    ("sampler=ode", "sampler: 'ode' is deterministic, so no step has a log-probability to train"),
    (["credit=flow_grpo", "rollout.group_size=1"], "credit=flow_grpo compares the members of a group, and "
                                                   "rollout.group_size=1 leaves each sample alone in its group"),
    (["credit=turning_point", "rollout.group_size=1"], "every advantage would be 0"),
    (["credit=stepwise_per_step", "rollout.group_size=1"], "give rollout.group_size >= 2"),
    (["sampler=cps", "sde.noise_level=1.5"], "sde.noise_level must be at most 1 with sampler=cps"),
    ("rollout.cfg=-1", "rollout.cfg must be >= 0"),
    ("optim.lr=.inf", "optim.lr must be a finite number, got inf"),
    ("reward.weights={shapes: .nan}", "reward.weights.shapes must be a finite number, got nan"),
    ("output_dir=", "output_dir is empty"),
    ("reward.weights.shapes.x=1", "config key reward.weights.shapes holds 1.0, not a mapping"),
    ("eval.min_images=-1", "eval.min_images must be >= 0"),
    ("optim.deepspeed={zero_optimization: {stage: 3}}",
     "optim.deepspeed.zero_optimization.stage is set by optim.zero_stage; set that instead"),
    ("optim.deepspeed={gradient_clipping: 2.0}", "optim.deepspeed.gradient_clipping is set by optim.grad_clip"),
    ("optim.deepspeed={gradient_clipping: null}", "optim.deepspeed.gradient_clipping is set by optim.grad_clip"),
    ("optim.deepspeed={bf16: {enabled: true}}", "optim.deepspeed.bf16.enabled is set by optim.precision"),
    ("optim.deepspeed={zero_optimization: 0}",
     "optim.deepspeed.zero_optimization must be a mapping (it holds stage), got 0"),
    ("optim.deepspeed=[1]", "optim.deepspeed: expected a mapping"),
    ("seed=9223372036854775808", "seed must be below 2**63"),
    ("model.lora_rank=0", "model.lora_rank must be >= 1, got 0"),
    ("model.lora_alpha=0", "model.lora_alpha must be > 0"),
    ("model.lora_targets=[]", "model.lora_targets is empty"),
    ("reward.weights={}", "reward.weights is empty"),
    ("reward.options.shape.scale=2", "reward.options.shape: 'shape' is neither a reward in reward.weights nor "
                                     "eval.reward; did you mean 'reward.options.shapes'?"),
    ("resume=", "resume is empty"),
    ("model.path=", "model.path is empty"),
    ("rollout.prompts=", "rollout.prompts is empty"),
    ("eval.prompts=' '", "eval.prompts is empty"),
    ("eval.reward=", "eval.reward is empty"),
    (["eval.every=5", "eval.before_after=false", "eval.prompts="], "eval.prompts is empty"),
    ("reward.options.pkg.mod:Cls.device=cpu", "reward.options.pkg.mod:Cls: 'pkg.mod:Cls' is neither a reward in "
                                              "reward.weights nor eval.reward"),
    ("credit_opts.eps=0", "credit_opts.eps must be a finite number > 0"),
    ("credit_opts.eps=.inf", "credit_opts.eps must be a finite number > 0"),
    ("credit_opts.adv_clip=0", "credit_opts.adv_clip must be > 0"),
    ("reward.weights={shapes: 0}", "reward.weights are all 0 (shapes)"),
    ("optim.deepspeed={zero_optimization: {offload_param: 3}}",
     "optim.deepspeed.zero_optimization.offload_param must be a mapping (e.g. {device: cpu}), got 3"),
])  # fmt: skip
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("default", override if isinstance(override, list) else [override])
    assert message in str(err.value)


def test_a_choice_with_nothing_close_gets_no_guess():
    with pytest.raises(ConfigError) as err:
        load_config("default", ["sampler=euler"])
    assert str(err.value) == "sampler: 'euler' is not one of flow_sde, cps, ddim"


@pytest.mark.parametrize("override, suggestion", [
    ("group_size=8", "unknown config key 'group_size'; did you mean 'rollout.group_size'?"),  # another section's
    ("optim.group_size=8", "unknown config key 'optim.group_size'; did you mean 'rollout.group_size'?"),
    ("steps=20", "unknown config key 'steps'; did you mean 'sde.steps' or 'eval.steps'?"),
    ("optim.lrr=1", "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),  # this section's, misspelt
    ("iteratons=3", "unknown config key 'iteratons'; did you mean 'iterations'?"),
    ("optim.learning_rate=5", "unknown config key 'optim.learning_rate'; did you mean 'optim.lr' "
                              "(Flow-GRPO's train.learning_rate)?"),
    ("optim.lerning_rate=5", "did you mean 'optim.lr' (Flow-GRPO's train.learning_rate)?"),
    ("num_epochs=3", "unknown config key 'num_epochs'; did you mean 'iterations' (Flow-GRPO's num_epochs)?"),
    ("sample.num_steps=3", "unknown config key 'sample'; did you mean 'sde.steps' (Flow-GRPO's sample.num_steps)?"),
    ("sample={num_steps: 3}", "unknown config key 'sample'; did you mean 'sde.steps' (Flow-GRPO's sample.num_steps)?"),
    ("sample.noise_level=0.5", "unknown config key 'sample'; did you mean 'sde.noise_level'?"),
    ("train.beta=0.04", "unknown config key 'train'; did you mean 'optim.beta'?"),
    ("pretrained.model=/m", "unknown config key 'pretrained'; did you mean 'model.path' "
                            "(Flow-GRPO's pretrained.model)?"),
    ("optim={lr: 1, group_size: 3}", "unknown config key 'optim.group_size'; did you mean 'rollout.group_size'?"),
    # in eval, Flow-GRPO's eval_ names: the evaluation's setting, not the rollout's
    ("eval.num_steps=40", "did you mean 'eval.steps' (Flow-GRPO's sample.eval_num_steps)?"),
    # a Flow-GRPO name that is ours too (in another section): named once
    ("train.timestep_fraction=0.99", "unknown config key 'train'; did you mean 'sde.timestep_fraction' "
                                     "(Flow-GRPO's train.timestep_fraction)?"),
    ("timestep_fraction=0.99", "unknown config key 'timestep_fraction'; did you mean 'sde.timestep_fraction' "
                               "(Flow-GRPO's train.timestep_fraction)?"),
    ("eval.guidance_scale=4", "did you mean 'eval.cfg' (Flow-GRPO's sample.eval_guidance_scale)?"),
    ("train.batch_size=2", "unknown config key 'train'; did you mean 'rollout.micro_batch' (Flow-GRPO's "
                           "train.batch_size) or 'reward.batch_size' or 'eval.batch_size'?"),
    ("evl.steps=3", "unknown config key 'evl'; did you mean 'eval.steps'?"),  # a misspelt section
    ("sample={1: 2}", "unknown config key 'sample'; did you mean 'sampler'?"),  # a key that is not text
    ("optim.learning=3", "unknown config key 'optim.learning'; valid keys: beta, betas, clip_range, deepspeed, ema, "
                         "grad_clip, lr, precision, updates_per_iteration, warmup, weight_decay, zero_stage"),
    # the eval reward is also the train reward: listed once
    ("reward.options.pickscore.device=cuda:1", "nor eval.reward; valid keys: shapes"),
])  # fmt: skip
def test_an_unknown_key_suggests_the_setting_meant(override, suggestion):
    """A setting's name typed without its section, in the wrong one, or as Flow-GRPO names it is
    pointed to where it lives here, before a key of the same section spelt alike."""
    with pytest.raises(ConfigError) as err:
        load_config("default", [override])
    assert str(err.value).endswith(suggestion)


def test_an_unknown_section_in_a_yaml_file_suggests_the_setting_meant(tmp_path):
    path = tmp_path / "from_flow_grpo.yaml"
    path.write_text("sample:\n  num_steps: 10\n")
    with pytest.raises(ConfigError, match=r"from_flow_grpo.yaml: unknown config key 'sample'; did you mean "
                                          r"'sde.steps' \(Flow-GRPO's sample.num_steps\)\?"):  # fmt: skip
        load_config(str(path))


def test_the_eval_settings_are_not_needed_without_evaluation():
    cfg = load_config("default", ["eval.before_after=false", "eval.every=0", "eval.prompts=", "eval.reward="])
    assert cfg.eval.prompts == cfg.eval.reward == ""


def test_bad_preset_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no config 'nope'.*default") as err:
        load_config("nope")
    assert "did you mean" not in str(err.value)  # nothing near it
    with pytest.raises(ConfigError) as err:  # a misspelt preset, as a misspelt key, gets the nearest
        load_config("flowgrpo")
    assert str(err.value).endswith("sd3_medium_pickscore, shapeeval_heldout; did you mean --config flow_grpo?")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: [1,\n")
    with pytest.raises(ConfigError) as err:  # one line, that names the file and the line in it
        load_config(str(bad))
    assert str(err.value) == f"{bad}: malformed YAML: line 3, column 1: expected the node content, but found '<stream end>'"
    with pytest.raises(ConfigError) as err:
        load_config("default", ["credit=[a"])
    assert str(err.value) == "override 'credit=[a': cannot parse the value: column 3: expected ',' or ']', but got '<stream end>'"
    typo = tmp_path / "typo.yaml"
    typo.write_text("rollout:\n  grups: 3\n")
    with pytest.raises(ConfigError, match="typo.yaml: unknown config key 'rollout.grups'; did you mean 'rollout.groups'"):
        load_config(str(typo))
    for text, message in [("- 1\n", "listed.yaml: config: expected a mapping, got [1]"),
                          ("1: 2\n", "listed.yaml: config key '1' is int, not text"),
                          ("rollout: {3: 4}\n", "listed.yaml: config key 'rollout.3' is int, not text")]:
        (tmp_path / "listed.yaml").write_text(text)
        with pytest.raises(ConfigError) as err:
            load_config(str(tmp_path / "listed.yaml"))
        assert message in str(err.value)
    (tmp_path / "twice.yaml").write_text("seed: 1\noptim: {lr: 1.0e-4, lr: 2.0e-4}\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: malformed YAML: line 2, column 21: found the key 'lr' twice \(first on line 2\)$"):
        load_config(str(tmp_path / "twice.yaml"))
    (tmp_path / "twice.yaml").write_text("iterations: 3\nseed: 1\niterations: 5\n")
    with pytest.raises(ConfigError, match=r"found the key 'iterations' twice \(first on line 1\)"):
        load_config(str(tmp_path / "twice.yaml"))
    with pytest.raises(ConfigError, match=r"optim.deepspeed=\{a: 1, a: 2\}'(.|\n)*found the key 'a' twice"):
        load_config("default", ["optim.deepspeed={a: 1, a: 2}"])
    # a merge key brings in keys that the mapping may override
    (tmp_path / "merged.yaml").write_text("optim:\n  deepspeed:\n    base: &b {reduce_bucket_size: 5, overlap_comm: true}\n"
                                          "    zero_optimization: {<<: *b, overlap_comm: false}\n")  # fmt: skip
    merged = load_config(str(tmp_path / "merged.yaml")).optim.deepspeed["zero_optimization"]
    assert merged == {"reduce_bucket_size": 5, "overlap_comm": False}
    with pytest.raises(ConfigError, match="config file '.*missing.yaml' does not exist$"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="config file 'flow_grpo.yaml' does not exist; the preset of that name is "
                                          "--config flow_grpo"):
        load_config("flow_grpo.yaml")
    with pytest.raises(ConfigError, match="config file '.*' is a directory"):
        load_config(str(tmp_path))
    # configs/NAME.yaml, as the presets lie in the package (stepfast/configs/), names the preset
    assert load_config("configs/flow_grpo.yaml") == load_config("flow_grpo")
    with pytest.raises(ConfigError, match="config file 'configs/nosuch.yaml' does not exist$"):
        load_config("configs/nosuch.yaml")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"seed: 1 # caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(str(latin))


def test_config_choices_match_the_math_modules():
    assert config_module.SAMPLERS == sde.SAMPLERS
    assert config_module.CREDIT_ESTIMATORS == tuple(credit.ESTIMATORS)
    assert config_module.LOGPROB_CONVENTIONS == sde.LOGPROB_CONVENTIONS


def test_default_preset_does_not_train_the_near_deterministic_ddim_step():
    """default.yaml's min_std: the .28 -> .01 ddim step is an ODE step, because its log-prob gradient
    per unit of velocity (|d mean / d v| / std, from sde.step itself) dwarfs every other step's."""
    from stepfast import grpo

    cfg = load_config("default")
    grid = sde.sd3_time_grid(cfg.sde.steps)
    x, v = torch.zeros(1, 1), torch.zeros(1, 1)
    scale = []
    for j in range(cfg.sde.steps):
        t, s = float(grid[j]), float(grid[j + 1])
        out = sde.step("ddim", x, v, t, s, noise=torch.zeros(1, 1), eta=cfg.sde.eta)
        d_mean = sde.step("ddim", x, v + 1.0, t, s, noise=torch.zeros(1, 1), eta=cfg.sde.eta).mean - out.mean
        scale.append(float(d_mean.abs()) / float(out.std) if float(out.std) > 0 else 0.0)
    excluded = [j for j in range(cfg.sde.steps) if 0 < scale[j] and j not in grpo.trained_steps(cfg)]
    assert excluded == [8] and grpo.trained_steps(cfg) == list(range(1, 8))
    assert scale[8] > 25 * max(scale[j] for j in range(1, 8))


def test_command_line_takes_overrides_on_both_sides_of_the_options():
    from stepfast.train import parse_args

    args = parse_args(["iterations=2", "--config", "flow_grpo", "seed=1", "--local_rank=0", "optim.lr=1e-4"])
    assert args.config == "flow_grpo" and args.overrides == ["iterations=2", "seed=1", "optim.lr=1e-4"]
    cfg = load_config(args.config, args.overrides)
    assert (cfg.credit, cfg.iterations, cfg.seed, cfg.optim.lr) == ("flow_grpo", 2, 1, 1e-4)


def test_print_config_shows_the_resolved_configuration_and_exits(capsys, tmp_path):
    import yaml

    from stepfast.train import main

    out = tmp_path / "never_written"
    assert main(["--config", "flow_grpo", "--print-config", "seed=7", f"output_dir={out}"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == config_module.to_dict(load_config("flow_grpo", ["seed=7", f"output_dir={out}"]))
    assert (printed["credit"], printed["seed"], printed["optim"]["lr"]) == ("flow_grpo", 7, 3e-4)
    assert not out.exists()
    assert capsys.readouterr().err == ""  # flow_grpo: nothing to warn about
    assert main(["--print-config", "rollout.same_latent=false"]) == 0  # stepwise credit without shared noise
    assert "stepfast: warning: credit=stepwise with rollout.same_latent=false" in capsys.readouterr().err
    assert main(["--print-config", "optim.lrr=1"]) == 2  # a mistyped key is still an error
    assert "did you mean 'optim.lr'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a setting written as an option: argparse's error, with the form to use
        main(["--print-config", "--iterations=3"])
    assert "settings are given as key=value, without dashes" in capsys.readouterr().err
    assert main(["--print-config", "reward.weights={pickscor: 1.0}"]) == 2  # and a mistyped reward
    assert "reward.weights.pickscor: unknown reward 'pickscor' (did you mean 'pickscore'?)" in capsys.readouterr().err
    # the warnings a run gives at start that need the model's time grid (read from its scheduler config)
    # or the installed DeepSpeed
    assert main(["--print-config", "sampler=flow_sde", "sde.min_std=0", "sde.timestep_fraction=1",
                 "optim.deepspeed={zero_optimisation: {stage3_gather_16bit_weights_on_model_save: true}}"]) == 0
    err = capsys.readouterr().err
    assert "stepfast: warning: sampler=flow_sde trains the last step" in err
    assert "optim.deepspeed.zero_optimisation is not a setting DeepSpeed" in err and "(did you mean zero_optimization?)" in err


def test_kl_penalty_needs_lora():
    with pytest.raises(ConfigError, match="optim.beta > 0 .* needs model.lora=true"):
        load_config("default", ["model.lora=false", "optim.beta=0.01"])
    with pytest.raises(ConfigError, match="optim.beta > 0 .* needs model.lora=true"):
        load_config("default", ["model.lora=false"])  # the default keeps Flow-GRPO's KL
    load_config("default", ["model.lora=false", "optim.beta=0"])


def test_deepspeed_settings_merge_into_the_shipped_config():
    from stepfast.engine import deepspeed_config

    offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "fp16": {"loss_scale_window": 500}}
    cfg = load_config("default", [f"optim.deepspeed={offload}", "optim.zero_stage=3"])
    config = deepspeed_config(cfg.optim, micro_batch=4, accumulation=6)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_param_persistence_threshold"] == 100000  # the shipped file's
    assert zero["offload_optimizer"] == {"device": "cpu"}
    assert config["fp16"] == {"enabled": False, "initial_scale_power": 16, "loss_scale_window": 500}
    assert config["zero_force_ds_cpu_optimizer"] is False  # the optimizer is torch's AdamW, offloaded or not
    assert config["gradient_accumulation_steps"] == 6 and cfg.optim.deepspeed == offload  # not changed


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_deepspeed_config_takes_its_settings_from_the_runs_keys(precision):
    from stepfast.engine import deepspeed_config

    cfg = load_config("default", [f"optim.precision={precision}", "optim.grad_clip=0.3", "optim.zero_stage=1"])
    config = deepspeed_config(cfg.optim, micro_batch=3, accumulation=5)
    assert config["zero_optimization"]["stage"] == 1
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (3, 5)
    assert config["gradient_clipping"] == 0.3
    assert (config["bf16"]["enabled"], config["fp16"]["enabled"]) == (precision == "bf16", precision == "fp16")


@pytest.mark.parametrize("override, message", [
    ("output_dir={blocker}", "output_dir: {blocker} is a file, not a directory"),
    ("output_dir={blocker}/run", "output_dir: cannot create {blocker}/run: {blocker} is a file"),
    ("resume={tmp}/no/such/checkpoint", "resume: checkpoint '{tmp}/no/such/checkpoint' does not exist"),
])  # fmt: skip
def test_paths_the_run_cannot_use_stop_the_trainer_before_it_starts(tmp_path, capsys, override, message):
    """Checked where the run starts, not when the config is read: printing a config, or rebuilding
    the report of a run made on another machine, needs none of these paths."""
    from stepfast.train import main

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    override = override.format(blocker=blocker, tmp=tmp_path)
    assert main([override]) == 2
    assert message.format(blocker=blocker, tmp=tmp_path) in capsys.readouterr().err
    load_config("default", [override])  # reading it is fine
    assert main(["--print-config", override]) == 0


def test_stepwise_credit_without_shared_noise_is_warned_about():
    """The gains telescope to the group-relative final reward only when a group shares its noise."""
    from stepfast.config import config_warnings

    assert config_warnings(load_config("default")) == [] and config_warnings(load_config("flow_grpo")) == []
    for credit in ("stepwise", "stepwise_per_step"):
        (warning,) = config_warnings(load_config("default", [f"credit={credit}", "rollout.same_latent=false"]))
        assert f"credit={credit} with rollout.same_latent=false" in warning
    assert config_warnings(load_config("default", ["credit=flow_grpo", "rollout.same_latent=false"])) == []


def test_a_warmup_or_an_evaluation_interval_past_the_run_is_warned_about():
    from stepfast.config import config_warnings

    assert config_warnings(load_config("default", ["iterations=40", "optim.warmup=40", "eval.every=40"])) == []  # reached
    first, second = config_warnings(load_config("default", ["iterations=40", "optim.warmup=50", "eval.every=41"]))
    assert first == "optim.warmup=50 is longer than iterations=40: the learning rate never reaches optim.lr=0.001"
    assert second == "eval.every=41 is longer than iterations=40: no evaluation runs during training"


def test_training_the_last_step_is_warned_about():
    """Flow-GRPO never trains the t_1 -> 0 step; flow_sde trains it when sde.timestep_fraction keeps
    it and sde.min_std is below its std (0.0063 at noise level 0.7), and the warning names the
    settings that would not."""
    from stepfast.config import config_warnings
    from stepfast.grpo import trained_steps

    for preset in ("default", "flow_grpo"):
        cfg = load_config(preset)
        assert config_warnings(cfg, trained_steps(cfg)) == []
    cfg = load_config("flow_grpo", ["sde.timestep_fraction=1.0"])
    assert trained_steps(cfg) == list(range(10))
    (warning,) = config_warnings(cfg, trained_steps(cfg))
    assert "sampler=flow_sde trains the last step" in warning and "set sde.timestep_fraction=0.99" in warning
    assert "raise sde.min_std" in warning
    cfg = load_config("flow_grpo", ["sde.timestep_fraction=1.0", "sde.min_std=0.01"])  # above that std: not trained
    assert trained_steps(cfg)[-1] == 8 and config_warnings(cfg, trained_steps(cfg)) == []
    cfg = load_config("flow_grpo", ["sde.timestep_fraction=1.0", "sde.window=[0, 9]"])  # an ODE step: not trained
    assert trained_steps(cfg) == list(range(9)) and config_warnings(cfg, trained_steps(cfg)) == []
    cfg = load_config("flow_grpo", ["sde.timestep_fraction=1.0", "sde.window=[9, 10]"])  # nothing else trained
    (warning,) = config_warnings(cfg, trained_steps(cfg))
    assert "timestep_fraction" not in warning and warning.endswith("the only step trained here: start sde.window earlier")


def test_flow_grpo_trains_the_first_99_percent_of_the_steps_whatever_their_number():
    """int(0.99 T) as Flow-GRPO's train.timestep_fraction, not a window fixed for T = 10."""
    from stepfast.grpo import trained_steps

    for steps in (10, 20, 40):
        cfg = load_config("flow_grpo", [f"sde.steps={steps}"])
        assert trained_steps(cfg) == list(range(int(0.99 * steps)))
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ConfigError, match=rf"sde.timestep_fraction must be in \(0, 1\], got {bad}"):
            load_config("flow_grpo", [f"sde.timestep_fraction={bad}"])


def test_trained_steps_are_counted_on_the_grid_the_rollout_uses():
    """The trainer sizes gradient accumulation from grpo.trained_steps: for a model whose scheduler
    shift is not SD3's 3 it must count the steps the rollout trains on that model's grid."""
    from stepfast import grpo
    from stepfast.rollout import sample_trajectory

    cfg = load_config("default", ["sde.min_std=0.15"])
    for shift in (1.0, 3.0):
        grid = sde.sd3_time_grid(cfg.sde.steps, shift=shift)
        traj = sample_trajectory(lambda x, t: -x, torch.zeros(1, 2), grid, cfg.sampler, min_std=cfg.sde.min_std,
                                 noise=torch.zeros(cfg.sde.steps, 1, 2), eta=cfg.sde.eta)  # fmt: skip
        assert grpo.trained_steps(cfg, grid) == traj.trained.nonzero().flatten().tolist()
    assert grpo.trained_steps(cfg, sde.sd3_time_grid(cfg.sde.steps, shift=1.0)) != grpo.trained_steps(cfg)


def test_trained_steps_of_a_window_on_any_device():
    """sde.trained_steps: the steps of the window [start, end) whose std reaches min_std, the mask on
    the grid's device (a CUDA grid in the rollout; here the meta device stands in for another one);
    a window that is not [start, end) with 0 <= start < end is refused, not read as Python slices."""
    grid = sde.sd3_time_grid(10)
    mask = sde.trained_steps("ddim", grid, [2, 6], min_std=0.05, eta=1.0)
    assert mask.nonzero().flatten().tolist() == [2, 3, 4, 5]
    assert torch.equal(sde.trained_steps("ddim", grid, (2, 6), min_std=0.05, eta=1.0), mask)
    everything = sde.trained_steps("ddim", grid, None, min_std=0.05, eta=1.0)
    assert everything.nonzero().flatten().tolist() == [j for j in range(10) if j not in (0, 8, 9)]
    assert sde.trained_steps("ddim", grid.to("meta"), [2, 6], min_std=0.05, eta=1.0).device.type == "meta"
    for window in ([-2, 3], [3, 3], [5, 2], [1]):
        with pytest.raises(ValueError, match="SDE window must be"):
            sde.trained_steps("ddim", grid, window, eta=1.0)
    # the first int(fraction x 10) steps among those: 0.45 -> steps 0..3
    half = sde.trained_steps("ddim", grid, None, min_std=0.05, timestep_fraction=0.45, eta=1.0)
    assert half.nonzero().flatten().tolist() == [1, 2, 3]
    assert torch.equal(sde.stochastic_steps("ddim", grid, None, min_std=0.05, eta=1.0), everything)
    with pytest.raises(ValueError, match="timestep_fraction must be in"):
        sde.trained_steps("ddim", grid, None, timestep_fraction=0.0, eta=1.0)


def test_ema_with_weights_on_nvme_is_refused_at_start():
    """Under ZeRO-3 each rank averages its partitions in memory: NVMe-offloaded weights are not there."""
    nvme = "optim.deepspeed={zero_optimization: {offload_param: {device: nvme, nvme_path: /nvme}}}"
    with pytest.raises(ConfigError, match="optim.ema with ZeRO-3 weights offloaded to NVMe"):
        load_config("default", ["optim.zero_stage=3", "optim.ema=0.9", nvme])
    for fine in (["optim.zero_stage=3", "optim.ema=0", nvme],
                 ["optim.zero_stage=3", "optim.ema=0.9", nvme.replace("nvme,", "cpu,")]):  # fmt: skip
        load_config("default", fine)


def test_changed_settings_name_each_key_with_both_values():
    """What a resumed run says it changed: every setting but those a resume changes anyway, the
    values as YAML writes them, in the configuration's order."""
    from stepfast.config import changed_settings

    before = load_config("flow_grpo", ["sde.window=[0, 9]", "sde.timestep_fraction=1.0", "reward.weights={shapes: 0.5}"])
    after = load_config("flow_grpo", ["iterations=99", "output_dir=/elsewhere", "resume=auto", "optim.lr=0.001"])
    assert changed_settings(before, after) == [
        "sde.window: [0, 9] -> null", "sde.timestep_fraction: 1.0 -> 0.99", "optim.lr: 0.0003 -> 0.001",
        "reward.weights: {shapes: 0.5} -> {shapes: 1.0}",
    ]
    assert changed_settings(after, after) == [] and changed_settings(before, after, ignore=())[0] == "iterations: 60 -> 99"
    # a string that reads as a number is quoted, as config.yaml writes it
    assert changed_settings(load_config("flow_grpo"), load_config("flow_grpo", ["log.wandb_project='1e3'"])) == [
        "log.wandb_project: stepfast -> '1e3'"]


def test_the_readme_key_table_gives_the_code_defaults():
    """Each row of the key table in docs/configuration.md: its keys, in order, with the defaults of
    config.py."""
    import yaml

    from stepfast.config import Config, _get_dotted

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    table = doc.split("| key | code default | what it does |\n|---|---|---|\n", 1)[1].split("\n\n", 1)[0]
    defaults = Config()
    checked = 0
    for row in table.splitlines():
        keys_cell, default_cell = [cell.strip() for cell in row.strip("|").split("|")[:2]]
        if not default_cell:  # a group of keys (credit_opts.*), described, not given
            continue
        keys = [k.strip().strip("`") for k in keys_cell.split(",")]
        values = [v.strip().strip("`") for v in re.split(r", (?![^\[]*\])", default_cell)]  # not inside [...]
        assert len(keys) == len(values), row
        for key, shown in zip(keys, values):
            actual = _get_dotted(defaults, key)
            if shown == "all":  # no limit
                assert actual in (None, 0), key
            elif shown == "Flow-GRPO's":
                assert actual == ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                                  "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"], key  # fmt: skip
            elif isinstance(actual, float):  # 3e-4: a number here (YAML 1.1 reads it as text)
                assert actual == float(shown), (key, shown, actual)
            else:
                assert actual == (shown if isinstance(actual, str) else yaml.safe_load(shown)), (key, shown, actual)
            checked += 1
    assert checked >= 35


def test_a_home_folder_in_a_path_setting_is_expanded(monkeypatch, tmp_path):
    """A shell expands `output_dir=~/runs` but not `model.path=~/models` (only a word's start): every
    path setting reads `~` as the home folder, as the reward options that name local files do."""
    from stepfast import rewards
    from stepfast.startup import missing_reward_paths

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config("default", ["output_dir=~/runs/a", "model.path=~/models/sd3", "rollout.prompts=~/p.txt",
                                  "eval.prompts=~/e.txt", "resume=~/runs/a/checkpoints/checkpoint-000010"])  # fmt: skip
    assert (cfg.output_dir, cfg.model.path, cfg.rollout.prompts, cfg.eval.prompts, cfg.resume) == (
        f"{tmp_path}/runs/a", f"{tmp_path}/models/sd3", f"{tmp_path}/p.txt", f"{tmp_path}/e.txt",
        f"{tmp_path}/runs/a/checkpoints/checkpoint-000010")  # fmt: skip
    assert rewards.with_device("pickscore", {"path": "~/ps", "divisor": 26}, "cpu") == {
        "path": f"{tmp_path}/ps", "divisor": 26, "device": "cpu"}  # fmt: skip
    (tmp_path / "ps").mkdir()
    cfg = load_config("sd3_medium_pickscore", ["reward.options.pickscore.path=~/ps",
                                               "reward.options.pickscore.processor_path=~/nothing"])  # fmt: skip
    assert missing_reward_paths(cfg) == [f"reward.options.pickscore.processor_path: {tmp_path}/nothing does not exist"]


def test_a_reward_named_by_import_path_keeps_its_dots_in_an_override():
    """reward.weights.pkg.mod:Cls=1 names the reward pkg.mod:Cls (its module's dots are not sections),
    and so does reward.options.pkg.mod:Cls.<option> before the reward is weighted."""
    cfg = load_config("default", ["reward.weights.train_helpers.sub:Brightness=0.5",
                                  "reward.options.train_helpers.sub:Brightness.scale=2"])  # fmt: skip
    assert cfg.reward.weights == {"shapes": 1.0, "train_helpers.sub:Brightness": 0.5}
    assert cfg.reward.options == {"train_helpers.sub:Brightness": {"scale": 2}}
    # under a name it knows: its options, whose keys may be such names too (the remote reward's weights)
    cfg = load_config("default", ["reward.weights={remote: 1.0}", "reward.options.remote.url=http://h:1",
                                  "reward.options.remote.weights.pkg.mod:Cls=0.5"])  # fmt: skip
    assert cfg.reward.options == {"remote": {"url": "http://h:1", "weights": {"pkg.mod:Cls": 0.5}}}
