"""Weighted combinations, custom rewards by import path, JPEG rewards, ImageReward's import error,
and asynchronous scoring."""

import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from stepfast import rewards
from stepfast.rewards.async_scoring import AsyncScorer
from stepfast.rewards.combine import ScoreError, WeightedReward, check_scores
from stepfast.rewards.images import to_uint8


def brightness(images, prompts, metadata):
    """A custom reward given by import path: mean pixel value in [0, 1], plus the prompt length."""
    pixels = torch.from_numpy(to_uint8(images)).float()
    return {"score": pixels.mean(dim=(1, 2, 3)) / 255, "chars": torch.tensor([float(len(p)) for p in prompts])}


def darkness(images, prompts, metadata):
    return 1 - brightness(images, prompts, metadata)["score"]


class Darkness:
    def __init__(self, scale=1.0):
        self.scale = scale

    def score(self, images, prompts, metadata=None):
        return {"score": self.scale * darkness(images, prompts, metadata)}


def darkness_with_defaults(images=None, prompts=None, metadata=None):
    """A scoring function whose arguments all have defaults: still not a factory."""
    return darkness(images, prompts, metadata)


def make_darkness(scale=1.0):
    """A factory: every argument has a default, so it is called even without options."""
    return Darkness(scale)


def make_darkness_on(device, scale=1.0):
    """A factory with a required option: called with it, never taken for a scoring function."""
    reward = Darkness(scale)
    reward.device = device
    return reward


class Rewards:
    """Rewards reached by a dotted attribute path, "module:Rewards.Dark"."""

    Dark = Darkness


class NeedsPath:
    def __init__(self, path, device="cpu"):
        self.path, self.device = path, device

    def score(self, images, prompts, metadata=None):
        return {"score": torch.zeros(len(prompts))}


def test_factories_with_options_dotted_paths_and_missing_options(images):
    dark = darkness(images, PROMPTS, None)
    built = rewards.load(f"{__name__}:make_darkness_on", device="cpu", scale=2.0)
    assert built.device == "cpu"
    torch.testing.assert_close(built.score(images, PROMPTS)["score"], 2 * dark)
    torch.testing.assert_close(rewards.load(f"{__name__}:Rewards.Dark").score(images, PROMPTS)["score"], dark)
    # a missing option is named, not a bare TypeError from the constructor (or, for a factory, a
    # factory taken for a scoring function and called at score time)
    with pytest.raises(ValueError, match=rf"reward '{__name__}:NeedsPath': options \[\] do not fit"):
        rewards.load(f"{__name__}:NeedsPath")
    with pytest.raises(ValueError, match=r"reward 'shapes': options \['treshold'\] do not fit .*'treshold'"
                                         r"; did you mean 'threshold' for 'treshold'\?$"):  # fmt: skip
        rewards.load("shapes", treshold=0.3)
    with pytest.raises(ValueError) as err:  # nothing close: no guess
        rewards.load("shapes", colour="red")
    assert "did you mean" not in str(err.value)
    # the types as written, not quoted as a module with postponed annotations holds them
    assert "(threshold: float = 0.35, " in str(err.value) and "exclusive: bool = True" in str(err.value)
    with pytest.raises(ValueError, match=rf"reward '{__name__}:make_darkness_on': .* is not a scoring function"
                                         r".*as a factory it needs options"):  # fmt: skip
        rewards.load(f"{__name__}:make_darkness_on")
    # a factory or class that takes a device gets the policy's; one that takes none gets none
    assert rewards.with_device(f"{__name__}:make_darkness_on", None, "cuda:2") == {"device": "cuda:2"}
    assert rewards.with_device(f"{__name__}:NeedsPath", {"path": "p"}, "cuda:2") == {"path": "p", "device": "cuda:2"}
    assert rewards.with_device(f"{__name__}:make_darkness", None, "cuda:2") == {}


def test_custom_rewards_by_import_path_class_factory_and_function(images):
    dark = darkness(images, PROMPTS, None)
    for target, options, expected in [
        ("test_rewards_combine:darkness", {}, dark),
        ("test_rewards_combine:darkness_with_defaults", {}, dark),
        ("test_rewards_combine:Darkness", {}, dark),
        ("test_rewards_combine:Darkness", {"scale": 2.0}, 2 * dark),
        ("test_rewards_combine:make_darkness", {}, dark),
        ("test_rewards_combine:make_darkness", {"scale": 3.0}, 3 * dark),
    ]:
        torch.testing.assert_close(rewards.load(target, **options).score(images, PROMPTS)["score"], expected)
    with pytest.raises(TypeError, match="returned float, which has no score"):
        rewards.load("test_rewards_combine:jpeg_kb_of_nothing")


def test_a_reward_registered_by_name_loads_as_the_shipped_ones_do(images, monkeypatch):
    """rewards.register: a reward defined in the running program, by its class or factory."""
    monkeypatch.setitem(rewards.REGISTRY, "scratch", None)  # removed again after the test
    dark = darkness(images, PROMPTS, None)
    for target in (Darkness, make_darkness, "test_rewards_combine:Darkness"):
        rewards.register("scratch", target)
        torch.testing.assert_close(rewards.load("scratch", scale=2.0).score(images, PROMPTS)["score"], 2 * dark)


def jpeg_kb_of_nothing():
    return 0.0


class NaNReward:
    def score(self, images, prompts, metadata=None):
        return {"score": torch.tensor([0.5, float("nan"), 0.1])}


@pytest.fixture
def images():
    rng = np.random.default_rng(3)
    batch = rng.integers(0, 256, size=(3, 24, 32, 3), dtype=np.uint8)
    batch[0] = 255  # flat white: compresses best
    return batch


PROMPTS = ["one", "three words here", "x"]


def jpeg_kb(pixels: np.ndarray) -> float:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue()) / 1000


def test_jpeg_rewards_match_flow_grpo(images):
    kb = torch.tensor([jpeg_kb(a) for a in images])
    comp = rewards.load("jpeg_compressibility").score(images, PROMPTS)
    incomp = rewards.load("jpeg_incompressibility").score(images, PROMPTS)
    torch.testing.assert_close(incomp["score"], kb)
    torch.testing.assert_close(comp["score"], -kb / 500)
    assert comp["score"][0] > comp["score"][1]  # the flat image is the most compressible


def test_weighted_sum_with_parts_and_extra_keys(images):
    name = f"{__name__}:brightness"
    reward = rewards.load_weighted({name: 2.0, "jpeg_compressibility": -0.5})
    out = reward.score(images, PROMPTS)
    b = brightness(images, PROMPTS, None)
    kb = torch.tensor([jpeg_kb(a) for a in images])
    torch.testing.assert_close(out[name], b["score"])
    torch.testing.assert_close(out[f"{name}/chars"], b["chars"])
    torch.testing.assert_close(out["jpeg_compressibility/kb"], kb)
    torch.testing.assert_close(out["score"], 2.0 * b["score"] - 0.5 * (-kb / 500))
    assert set(out) == {"score", name, f"{name}/chars", "jpeg_compressibility", "jpeg_compressibility/kb"}


def test_weighted_reward_passes_options_and_registry_name(images):
    reward = rewards.load("weighted", weights={"jpeg_compressibility": 1.0},
                          options={"jpeg_compressibility": {"scale": 100.0}})
    kb = torch.tensor([jpeg_kb(a) for a in images])
    torch.testing.assert_close(reward.score(images, PROMPTS)["score"], -kb / 100)
    with pytest.raises(ValueError, match="not in weights"):
        WeightedReward({"jpeg_compressibility": 1.0}, options={"shapes": {}})
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        WeightedReward({"nope": 1.0})


def test_weighted_reward_names_a_nan_part(images):
    reward = WeightedReward({f"{__name__}:NaNReward": 1.0})
    with pytest.raises(ValueError, match=r"NaNReward.*NaN scores for images \[1\]"):
        reward.score(images, PROMPTS)


class InfReward:
    def score(self, images, prompts, metadata=None):
        return {"score": torch.tensor([0.5, float("inf"), 0.1])}


@pytest.mark.parametrize("values, kind, bad", [([0.5, float("inf"), 0.1], "infinite", r"\[1\]"),
                                               ([float("-inf"), float("nan"), 0.1], "NaN and infinite", r"\[0, 1\]")])
def test_check_scores_refuses_infinite_scores(values, kind, bad):
    with pytest.raises(ScoreError, match=rf"reward 'r' returned {kind} scores for images {bad} of 3"):
        check_scores("r", {"score": torch.tensor(values)}, 3)


def test_weighted_reward_names_an_infinite_part_even_at_weight_zero(images):
    """0 * inf is NaN: the sum's error would blame the combined reward, not the part."""
    reward = WeightedReward({f"{__name__}:InfReward": 0.0, "jpeg_compressibility": 1.0})
    with pytest.raises(ScoreError, match=r"InfReward.*infinite scores for images \[1\]"):
        reward.score(images, PROMPTS)


def test_check_scores_gives_float32_cpu_tensors():
    out = check_scores("r", {"score": np.array([1, 2], dtype=np.int64), "extra": torch.ones(2, dtype=torch.float64)}, 2)
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in out.values())
    torch.testing.assert_close(out["score"], torch.tensor([1.0, 2.0]))


def test_a_score_error_names_the_images_as_its_caller_describes_them():
    exc = ScoreError("r", "NaN", list(range(7)), 9)
    named = exc.naming(lambda i: f"image {i + 10}", limit=2)
    assert str(named) == "reward 'r' returned NaN scores for 7 of 9 images: image 10; image 11; and 5 more"


def test_async_scorer_overlaps_and_keeps_order(images):
    started, release = threading.Event(), threading.Event()
    seen = []

    class Slow:
        def score(self, images, prompts, metadata=None):
            started.set()
            assert release.wait(5)
            seen.append(None if metadata is None else list(metadata))
            return brightness(images, prompts, metadata)

    with AsyncScorer(Slow()) as scorer:
        buffer = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
        first = scorer.submit(buffer, PROMPTS)
        assert started.wait(5) and not first.done()  # submit returned while scoring runs
        expected = brightness(buffer, PROMPTS, None)["score"]
        buffer.zero_()  # the caller reuses its buffer: the scorer copied it
        second = scorer.submit(buffer, PROMPTS)
        array, metadata = images.copy(), [{"tag": "colors"}] * 3
        third = scorer.submit(array, PROMPTS, metadata)
        array[:] = 0  # the same for numpy arrays and the metadata list
        metadata.clear()
        release.set()
        torch.testing.assert_close(first.result(5)["score"], expected)
        torch.testing.assert_close(second.result(5)["score"], torch.zeros(3))
        torch.testing.assert_close(third.result(5)["score"], brightness(images, PROMPTS, None)["score"])
        assert seen == [None, None, [{"tag": "colors"}] * 3]


def test_async_scorer_raises_the_reward_error_on_result(images):
    class FailsOnce:
        calls = 0

        def score(self, images, prompts, metadata=None):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("reward model exploded")
            return brightness(images, prompts, metadata)

    with AsyncScorer(FailsOnce()) as scorer:
        failed, ok = scorer.submit(images, PROMPTS), scorer.submit(images, PROMPTS)
        with pytest.raises(RuntimeError, match="reward model exploded"):
            failed.result(5)
        # the worker survives a failed batch
        torch.testing.assert_close(ok.result(5)["score"], brightness(images, PROMPTS, None)["score"])


def test_async_scorer_closed_without_waiting_drops_the_queued_batches(images):
    """What the trainer does when an iteration fails: the batch being scored finishes, the queued
    ones are never scored (against a dead reward server each would wait out its retries)."""
    import threading

    started, release = threading.Event(), threading.Event()

    class Blocking:
        calls = 0

        def score(self, images, prompts, metadata=None):
            self.calls += 1
            started.set()
            assert release.wait(5)
            return brightness(images, prompts, metadata)

    reward = Blocking()
    scorer = AsyncScorer(reward)
    running = scorer.submit(images, PROMPTS)
    queued = [scorer.submit(images, PROMPTS) for _ in range(3)]
    assert started.wait(5)
    scorer.close(wait=False)
    release.set()
    assert running.result(5)["score"].shape == (3,)
    assert all(f.cancelled() for f in queued) and reward.calls == 1


def test_model_rewards_run_on_the_policys_device_unless_told_otherwise():
    """The trainer builds each reward with device=<its own> when the reward's class or factory takes a
    device and reward.options sets none (PickScore on each rank's GPU, not the CPU default)."""
    expected = {"path": "/m", "device": "cuda:3"}
    assert rewards.with_device("pickscore", {"path": "/m"}, torch.device("cuda", 3)) == expected
    assert rewards.with_device("ocr", None, "cuda:0") == {"device": "cuda:0"}
    assert rewards.with_device("pickscore", {"device": "cpu"}, "cuda:1") == {"device": "cpu"}  # as set
    # "cuda" alone is this rank's GPU, not whichever a thread has current
    assert rewards.with_device("pickscore", {"device": "cuda"}, "cuda:1") == {"device": "cuda:1"}
    assert rewards.with_device("pickscore", {"device": "cuda:0"}, "cuda:1") == {"device": "cuda:0"}  # as set
    assert rewards.with_device("pickscore", {"device": "cuda"}, "cpu") == {"device": "cuda"}  # as set
    assert rewards.with_device("shapes", None, "cuda:0") == {}  # takes no device
    assert rewards.with_device(f"{__name__}:darkness", None, "cuda:0") == {}  # a scoring function
    assert rewards.with_device("no_such_reward", {"a": 1}, "cuda:0") == {"a": 1}  # load names the problem


def test_the_scoring_thread_works_on_the_ranks_gpu(monkeypatch):
    """CUDA's current device is per thread and a new thread's is the first GPU: AsyncScorer's worker
    is set to the device it is given (the rank's) before it scores anything; on the CPU, left alone."""
    import threading

    from stepfast.rewards.async_scoring import AsyncScorer

    set_in = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: set_in.append((threading.current_thread().name, device)))

    class Reward:
        def score(self, images, prompts, metadata=None):
            return {"score": torch.zeros(len(prompts)), "thread": threading.current_thread().name}

    images = np.zeros((2, 4, 4, 3), np.uint8)
    with AsyncScorer(Reward(), device=torch.device("cuda", 3)) as scorer:
        thread = scorer.submit(images, ["a", "b"]).result()["thread"]
    assert set_in == [(thread, torch.device("cuda", 3))] and thread != threading.current_thread().name
    for device in (torch.device("cpu"), None):
        with AsyncScorer(Reward(), device=device) as scorer:
            scorer.submit(images, ["a", "b"]).result()
    assert len(set_in) == 1


def test_the_columns_whose_mean_is_logged():
    """The trainer logs reward/<key> as a mean over the images only where that mean means something."""
    from stepfast.rewards.combine import has_a_mean

    for key in ("score", "strict", "shapes", "shapes/strict", "geneval_remote/strict_accuracy", "accuracy"):
        assert has_a_mean(key), key
    for key in ("category", "shapes/category", "counting_accuracy", "geneval_remote/position_accuracy"):
        assert not has_a_mean(key), key


def test_a_prompt_refused_by_a_part_keeps_its_index_and_names_the_part():
    """The trainer turns the index into the prompt file's line: the weighted reward passes it on."""
    from stepfast.rewards import PromptError, load_weighted

    reward = load_weighted({"shapes": 1.0})
    with pytest.raises(PromptError) as err:
        reward.check(["a photo of a circle", "a photo of a square", "a red circle"])
    assert (err.value.index, err.value.reward) == (2, "shapes")
    assert str(err.value) == f"reward 'shapes': prompt 3: {err.value.reason}" and "'a red circle'" in err.value.reason


def test_a_models_missing_or_incomplete_files_are_named_once_with_the_reward(tmp_path):
    """A missing path is named by the reward's own check (RewardFileError, passed on as it is); files
    that transformers cannot load (a bare OSError) get the reward's name in front."""
    from stepfast.rewards.paths import RewardFileError

    missing = tmp_path / "nowhere"
    with pytest.raises(RewardFileError) as err:
        WeightedReward({"clipscore": 1.0}, {"clipscore": {"path": missing}})
    assert err.value.reward == "clipscore"
    assert str(err.value).startswith(f"reward 'clipscore': path='{missing}' does not exist; ")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(OSError) as err:
        WeightedReward({"clipscore": 1.0}, {"clipscore": {"path": empty}})
    assert not isinstance(err.value, RewardFileError)
    assert str(err.value).startswith("reward 'clipscore' cannot load its files: ") and str(empty) in str(err.value)


def test_the_local_path_options_the_trainer_checks_are_options_of_their_rewards():
    for name, options in rewards.LOCAL_PATH_OPTIONS.items():
        assert name in rewards.REGISTRY
        for option in options:
            assert rewards.takes_option(name, option), (name, option)


class ChunkReward:
    """Scores each image by its position in the whole batch (read from its prompt); a GenEval-style
    column for the tags in each chunk only; NaN for the prompts "nan"; an extra key in some chunks."""

    def score(self, images, prompts, metadata=None):
        out = {"score": torch.tensor([float("nan") if p == "nan" else float(p) for p in prompts])}
        for tag in sorted({m["tag"] for m in metadata}):
            out[f"{tag}_accuracy"] = torch.tensor([1.0 if m["tag"] == tag else -10.0 for m in metadata])
        if any(m.get("extra") for m in metadata):
            out["sometimes"] = torch.zeros(len(prompts))
        return out


@pytest.mark.parametrize("scorer_class", ["AsyncScorer", "InlineScorer"])  # reward.async_scoring true / false
def test_collected_scores_line_up_with_the_images_across_chunks(scorer_class):
    from stepfast.grpo import collect_scores, submit_scores
    from stepfast.rewards import async_scoring

    scorer = getattr(async_scoring, scorer_class)(WeightedReward({f"{__name__}:ChunkReward": 1.0}))
    images = torch.zeros(7, 3, 4, 4)
    tags = ["a", "a", "a", "b", "b", "c", "a"]  # chunks of 3: {a}, {b, c}, {a}
    metadata = [{"tag": t} for t in tags]
    out = collect_scores(submit_scores(scorer, images, [str(i) for i in range(7)], metadata, 3))
    torch.testing.assert_close(out["score"], torch.arange(7.0))
    for tag in "abc":  # -10 where a chunk had no column for the tag, as within one GenEval answer
        key = f"{__name__}:ChunkReward/{tag}_accuracy"
        torch.testing.assert_close(out[key], torch.tensor([1.0 if t == tag else -10.0 for t in tags]))
    metadata[4]["extra"] = True  # a key that some chunks lack and that has no fill value
    with pytest.raises(ValueError, match=r"\['test_rewards_combine:ChunkReward/sometimes'\] for some batches"):
        collect_scores(submit_scores(scorer, images, [str(i) for i in range(7)], metadata, 3))
    prompts = ["0", "1", "2", "3", "nan", "5", "nan"]  # positions 4 and 6, in the second and third chunks
    with pytest.raises(ValueError, match=r"NaN scores for 1 of 3 images: image 4$"):
        collect_scores(submit_scores(scorer, images, prompts, metadata, 3), lambda i: f"image {i}")
    scorer.close()
    if scorer_class == "InlineScorer":  # scored as submitted: the chunks after a failed one are not
        assert len(submit_scores(scorer, images, prompts, metadata, 3)) == 2


@pytest.mark.parametrize("name, options, message", [
    ("shapes", {"threshold": "abc"}, "reward 'shapes': option threshold must be a number, got 'abc'"),
    ("shapes", {"threshold": True}, "option threshold must be a number, got True"),
    ("shapes", {"exclusive": 3}, "option exclusive must be true or false, got 3"),
    ("ocr", {"model_dir": 3}, "option model_dir must be text or null, got 3"),
    ("jpeg_incompressibility", {"quality": 9.5}, "option quality must be a whole number, got 9.5"),
    ("shapes", {"threshold": 5}, "shapes: threshold (a fraction of 255) must be in (0, 1), got 5"),
    ("shapes", {"min_area": 0.6}, "must satisfy 0 <= min_area < max_area <= 1, got 0.6 and 0.5"),
    ("shapes", {"position_threshold": -1}, "position_threshold must be >= 0, got -1"),
])  # fmt: skip
def test_an_option_of_the_wrong_type_or_range_is_named_when_the_reward_is_built(name, options, message):
    """Found when the reward is built (the trainer: at start, a ConfigError), not at the first images:
    a text threshold was a TypeError from the pixels, a threshold of 5 failed every image silently."""
    with pytest.raises(ValueError) as err:
        rewards.load(name, **options)
    assert message in str(err.value)


def test_options_of_the_right_types_pass_the_check():
    """An int where a float is annotated (YAML reads 1 as one), a whole float where an int is (taken as
    the int), None where None is allowed."""
    assert rewards.load("shapes", threshold=0.3, min_area=0, max_area=1, exclusive=False).min_area == 0
    assert rewards.load("jpeg_compressibility", quality=90, scale=2).scale == 2
    built = rewards.load("jpeg_incompressibility", quality=90.0)
    assert built.quality == 90 and type(built.quality) is int
    ocr = rewards._import(rewards.REGISTRY["ocr"])  # built, it would need easyocr: its options are checked alone
    assert rewards._check_options("ocr", ocr, {"model_dir": None, "batch_size": 8.0}) == {"model_dir": None, "batch_size": 8}
