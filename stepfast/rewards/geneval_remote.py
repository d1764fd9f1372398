"""Client of the GenEval reward server that Flow-GRPO users run (yifan123/reward-server, app_geneval).

    reward = stepfast.rewards.load("geneval_remote", url="http://127.0.0.1:18085")
    out = reward.score(images, prompts, metadata)   # metadata: GenEval records, one per image

SECURITY: that server's protocol is pickle both ways. Unpickling the answer runs whatever code the
answer carries, so this client talks only to the URL you configure (there is no default) and you
must run or trust that server. For a server of ours, use `python -m stepfast.reward_server` and the
`remote` reward (JSON, no pickle).

Protocol (as Flow-GRPO's `geneval_score`): POST to the URL a pickled dict
{"images": [JPEG bytes (PIL default quality)], "meta_datas": [GenEval metadata], "only_strict": bool},
`batch_size` images per request; the answer is a pickled dict with lists "scores", "rewards",
"strict_rewards" and dicts "group_rewards", "group_strict_rewards" ({tag: [value per image]},
-10 for images of another tag). Keys returned here, named as Flow-GRPO logs them:
"score" = scores (partial credit), "accuracy" = rewards, "strict_accuracy" = strict_rewards,
"<tag>_accuracy" and "<tag>_strict_accuracy" per tag. With only_strict (default, as Flow-GRPO in
training) the server skips the non-strict check and "accuracy" is 0.
"""

from __future__ import annotations

import io
import pickle

import torch

from stepfast.rewards.images import to_pil
from stepfast.rewards import PromptError
from stepfast.rewards.transport import (MalformedResponse, check_accepts_connections, check_client_options,
                                        check_url, post)

_LIST_KEYS = ("scores", "rewards", "strict_rewards")
_GROUP_KEYS = ("group_rewards", "group_strict_rewards")


class GenEvalRemoteReward:
    def __init__(self, url: str = None, only_strict: bool = True, batch_size: int = 64,
                 timeout: float = 120.0, retries: int = 5, backoff: float = 1.0):
        if not url:
            raise TypeError(
                "reward 'geneval_remote' needs url=<the GenEval server you run>; its protocol is "
                "pickle, so there is no default address"
            )
        check_url(url)
        self.url, self.only_strict, self.batch_size = url, bool(only_strict), int(batch_size)
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        check_client_options(self.timeout, self.retries, self.backoff, self.batch_size)

    def check(self, prompts, metadata=None) -> None:
        """Before any image is drawn: a PromptError for the first prompt without a GenEval record
        (a `.txt` prompt file has none; the server scores the record, not the text)."""
        for i in range(len(prompts)):
            if metadata is None or not isinstance(metadata[i], dict) or "tag" not in metadata[i]:
                raise PromptError(i, "reward 'geneval_remote' scores GenEval metadata records (prompts from a "
                                     "*_metadata.jsonl file, each with its 'tag'); this prompt has none")  # fmt: skip

    def check_server(self, size: int | None = None) -> None:
        """A ValueError naming the server when it does not accept connections (its protocol has no
        health check, and states no limit on an image's `size`), tried as a score request is."""
        check_accepts_connections(self.url, timeout=min(self.timeout, 10.0), retries=self.retries, backoff=self.backoff)

    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        pil = to_pil(images)
        if metadata is None or len(metadata) != len(pil):
            raise ValueError(
                f"reward 'geneval_remote' needs one GenEval metadata record per image "
                f"(got {len(pil)} images, {'no' if metadata is None else len(metadata)} records)"
            )
        columns: dict[str, list[float]] = {}
        for start in range(0, len(pil), self.batch_size):
            batch = pil[start : start + self.batch_size]
            jpegs = []
            for image in batch:
                buffer = io.BytesIO()
                image.save(buffer, format="JPEG")
                jpegs.append(buffer.getvalue())
            request = pickle.dumps({
                "images": jpegs,
                "meta_datas": list(metadata[start : start + self.batch_size]),
                "only_strict": self.only_strict,
            })
            answer = post(self.url, request, lambda body, n=len(batch): _parse(body, n),
                          content_type="application/octet-stream",
                          timeout=self.timeout, retries=self.retries, backoff=self.backoff)
            for key, values in answer.items():
                if start and key not in columns:  # a tag first seen now: earlier images had -10
                    columns[key] = [-10.0] * start
                columns.setdefault(key, []).extend(values)
            for key in columns:  # a tag seen before but missing now
                if len(columns[key]) < start + len(batch):
                    columns[key].extend([-10.0] * (start + len(batch) - len(columns[key])))
        return {key: torch.tensor(values, dtype=torch.float32) for key, values in columns.items()}


def is_tag_column(key: str) -> bool:
    """Whether `key` (as returned here, or "<reward name>/<key>" from a weighted sum) is one of the
    per-tag columns, which hold -10 for the images of other tags: a plain mean of one is meaningless
    (the trainer logs each category's reward as `category/<tag>` instead)."""
    name = key.rsplit("/", 1)[-1]
    return name.endswith("_accuracy") and name not in ("accuracy", "strict_accuracy")


def _parse(body: bytes, n: int) -> dict[str, list[float]]:
    try:
        answer = pickle.loads(body)  # noqa: S301 (the protocol; see the module docstring)
    except Exception as exc:
        raise MalformedResponse(f"answer is not a pickle: {exc}") from exc
    if not isinstance(answer, dict) or any(k not in answer for k in _LIST_KEYS + _GROUP_KEYS):
        raise MalformedResponse(f"answer lacks some of {_LIST_KEYS + _GROUP_KEYS}")
    out = {
        "score": answer["scores"],
        "accuracy": answer["rewards"],
        "strict_accuracy": answer["strict_rewards"],
    }
    for key, suffix in (("group_rewards", "accuracy"), ("group_strict_rewards", "strict_accuracy")):
        if not isinstance(answer[key], dict):
            raise MalformedResponse(f"{key} is not a dict")
        for tag, values in answer[key].items():
            out[f"{tag}_{suffix}"] = values
    for key, values in out.items():
        if not isinstance(values, (list, tuple)) or len(values) != n:
            raise MalformedResponse(f"{key} does not hold {n} values")
    return {key: [float(v) for v in values] for key, values in out.items()}
