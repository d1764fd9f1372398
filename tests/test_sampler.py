"""The K-repeat prompt sampler: groups, ranks, epochs and category balancing."""

from collections import Counter

import pytest

from stepfast.data.sampler import KRepeatSampler


def test_groups_repeat_each_prompt_and_ranks_split_the_batch():
    one = KRepeatSampler(10, groups=3, group_size=4, world=1, rank=0, seed=0)
    full = one.batch(5)
    assert full.indices == [p for p in one.group_prompts(5) for _ in range(4)]
    assert full.members == [0, 1, 2, 3] * 3
    parts = [KRepeatSampler(10, 3, 4, world=3, rank=r, seed=0).batch(5) for r in range(3)]
    assert sum((p.indices for p in parts), []) == full.indices  # a group may span ranks
    assert sum((p.groups for p in parts), []) == full.groups


def test_every_prompt_once_per_epoch():
    sampler = KRepeatSampler(12, groups=4, group_size=2, world=1, rank=0, seed=3)
    epoch = sum((sampler.group_prompts(i) for i in range(3)), [])
    assert sorted(epoch) == list(range(12))
    assert sum((sampler.group_prompts(i) for i in range(3, 6)), []) != epoch  # a new permutation


def test_balanced_categories_get_equal_shares_whatever_their_size():
    strata = ["big"] * 90 + ["mid"] * 10 + ["one"]
    sampler = KRepeatSampler(101, groups=6, group_size=2, world=1, rank=0, seed=0, strata=strata)
    drawn = sum((sampler.group_prompts(i) for i in range(30)), [])
    assert Counter(strata[p] for p in drawn) == {"big": 60, "mid": 60, "one": 60}
    # Each category cycles through its own prompts, epoch after epoch.
    assert Counter(p for p in drawn if strata[p] == "mid") == {p: 6 for p in range(90, 100)}
    assert len({p for p in drawn if strata[p] == "big"}) == 60
    # A pure function of (seed, iteration): a new sampler gives the same groups.
    again = KRepeatSampler(101, 6, 2, world=2, rank=1, seed=0, strata=strata)
    assert again.group_prompts(17) == sampler.group_prompts(17)


def test_strata_must_label_every_prompt():
    with pytest.raises(ValueError, match="2 strata labels for 3 prompts"):
        KRepeatSampler(3, 1, 1, 1, 0, 0, strata=["a", "b"])


@pytest.mark.parametrize("strata", [None, ["a"] * 20 + ["b"] * 20], ids=["plain", "strata"])
def test_the_seed_picks_the_order_and_each_category_its_own(strata):
    """Another run seed draws prompts in another order, and with strata each category's stream is
    its own permutation, not the same one as every other category's."""
    def drawn(seed):
        sampler = KRepeatSampler(40, groups=8, group_size=2, world=1, rank=0, seed=seed, strata=strata)
        return sum((sampler.group_prompts(i) for i in range(5)), [])

    assert drawn(0) != drawn(1) and drawn(0) == drawn(0)
    if strata:
        a, b = ([p % 20 for p in drawn(0) if strata[p] == label] for label in ("a", "b"))
        assert a != b  # category b's k-th draw is not category a's k-th, shifted


def test_every_process_sees_the_categories_in_the_same_order():
    """Ranks are separate processes with their own string hashing (PYTHONHASHSEED): the categories'
    order, and so each rank's share of the groups, must not depend on it."""
    import os
    import subprocess
    import sys

    code = ("from stepfast.data.sampler import KRepeatSampler; "
            "s = KRepeatSampler(60, 6, 2, 1, 0, 0, strata=[('colors', 'position', 'counting', 'two_object')[i % 4] "
            "for i in range(60)]); print(s.group_prompts(3))")  # fmt: skip
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                              env={**os.environ, "PYTHONHASHSEED": str(h)}).stdout for h in range(6)}  # fmt: skip
    assert len(outputs) == 1, outputs
