"""A vision-language model as judge, through an OpenAI-compatible chat endpoint (vLLM, SGLang, ...).

    reward = stepfast.rewards.load("vlm", url="http://127.0.0.1:17140", model="UnifiedReward-7b-v1.5")

For each (image, prompt) one POST {url}/v1/chat/completions carries the image as a PNG data URL
and `prompt_template` with "{prompt}" replaced by the prompt. The first match of `score_regex` in
the answer is the judge's number x; "score" = x / `max_score`. The defaults are Flow-GRPO's
UnifiedReward setup (`unifiedreward_score_sglang`): its question, "Final Score: x" with x in 1-5,
max 5, temperature 0, images resized to 512x512. An answer without a match scores 0, as in
Flow-GRPO, and shows as "parsed" = 0. Requests run `concurrency` at a time; each has the timeout
and retries of `stepfast.rewards.transport` and failures end in `RewardServerError`.
"""

from __future__ import annotations

import base64
import io
import json
import re
from concurrent.futures import ThreadPoolExecutor

import torch

from stepfast.rewards.images import to_pil
from stepfast.rewards.transport import (MalformedResponse, RewardServerError, check_accepts_connections,
                                        check_client_options, check_url, get_json, post)

UNIFIED_REWARD_TEMPLATE = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is "
    "to evaluate this image based on two key criteria:\n1. Alignment with the Caption: Assess how well "
    "this image aligns with the provided caption. Consider the accuracy of depicted objects, their "
    "relationships, and attributes as described in the caption.\n2. Overall Image Quality: Examine the "
    "visual quality of this image, including clarity, detail preservation, color accuracy, and overall "
    "aesthetic appeal.\nBased on the above criteria, assign a score from 1 to 5 after 'Final Score:'.\n"
    "Your task is provided as follows:\nText Caption: [{prompt}]"
)
# the judge's 1-5 score; a number that goes on (a 10, a 4.5.1) is not one: read as no score, not as its
# first digit
UNIFIED_REWARD_REGEX = r"Final Score:\s*([1-5](?:\.\d+)?)(?!\d|\.\d)"


class VlmJudgeReward:
    def __init__(self, url: str = None, model: str = "UnifiedReward-7b-v1.5",
                 prompt_template: str = UNIFIED_REWARD_TEMPLATE, score_regex: str = UNIFIED_REWARD_REGEX,
                 max_score: float = 5.0, image_size: int | None = 512, temperature: float = 0.0,
                 max_tokens: int | None = None, api_key: str | None = None, concurrency: int = 8,
                 timeout: float = 120.0, retries: int = 5, backoff: float = 1.0):
        if not url:
            raise TypeError("reward 'vlm' needs url=<http://HOST:PORT of an OpenAI-compatible server>")
        url = url.rstrip("/")
        check_url(url)
        if url.endswith("/chat/completions"):
            self.endpoint = url
        elif url.endswith("/v1"):
            self.endpoint = url + "/chat/completions"
        else:
            self.endpoint = url + "/v1/chat/completions"
        if "{prompt}" not in prompt_template:
            raise ValueError("prompt_template must contain {prompt}, where the image's prompt goes")
        self.pattern = re.compile(score_regex)
        if self.pattern.groups < 1:
            raise ValueError(f"score_regex {score_regex!r} needs a group that captures the number")
        if max_score <= 0:
            raise ValueError(f"max_score must be > 0, got {max_score}")
        self.model, self.template, self.max_score = model, prompt_template, float(max_score)
        self.image_size, self.temperature, self.max_tokens = image_size, temperature, max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.concurrency = max(1, int(concurrency))
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        check_client_options(self.timeout, self.retries, self.backoff, None)

    def check_server(self, size: int | None = None) -> None:
        """At start, a ValueError naming the server when it does not accept connections (tried as a
        request is), or when its model list (`/v1/models`, which vLLM and SGLang serve) lacks
        `model`. A server without that list is taken at its word (the API states no limit on an
        image's `size`)."""
        check_accepts_connections(self.endpoint, timeout=min(self.timeout, 10.0), retries=self.retries,
                                  backoff=self.backoff)  # fmt: skip
        models_url = self.endpoint.removesuffix("/chat/completions") + "/models"
        try:
            listed = get_json(models_url, timeout=min(self.timeout, 10.0), headers=self.headers)
            served = [m["id"] for m in listed["data"]]
        except RewardServerError as exc:
            if exc.last_failure.startswith(("HTTP 401", "HTTP 403")):  # a judge that would refuse every image
                raise ValueError(f"{models_url} refused the request ({exc.last_failure}): check api_key") from None
            return
        except (ValueError, KeyError, TypeError):
            return
        if self.model not in served:
            raise ValueError(f"{models_url} serves {served}, not model={self.model!r}")

    def judge(self, image, prompt: str) -> str:
        """The judge's answer text for one PIL image and its prompt."""
        if self.image_size:
            image = image.resize((self.image_size, self.image_size))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
        request = {
            "model": self.model,
            "messages": [{
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url}},
                    {"type": "text", "text": self.template.replace("{prompt}", prompt)},
                ],
            }],
            "temperature": self.temperature,
        }
        if self.max_tokens:
            request["max_tokens"] = self.max_tokens
        return post(self.endpoint, json.dumps(request).encode("utf-8"), _answer_text,
                    headers=self.headers, timeout=self.timeout, retries=self.retries, backoff=self.backoff)

    def parse(self, answer: str) -> float | None:
        match = self.pattern.search(answer)
        if match is None:
            return None
        try:
            return float(match.group(1))
        except ValueError:
            return None

    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        pil = to_pil(images)
        if len(pil) != len(prompts):
            raise ValueError(f"got {len(pil)} images and {len(prompts)} prompts")
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="vlm-judge") as pool:
            answers = list(pool.map(self.judge, pil, prompts))
        values = [self.parse(a) for a in answers]
        raw = torch.tensor([0.0 if v is None else v for v in values], dtype=torch.float32)
        return {
            "score": raw / self.max_score,
            "raw": raw,
            "parsed": torch.tensor([v is not None for v in values], dtype=torch.float32),
        }


def _answer_text(body: bytes) -> str:
    answer = json.loads(body)
    try:
        content = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise MalformedResponse(f"no choices[0].message.content ({exc!r})") from exc
    if not isinstance(content, str):
        raise MalformedResponse("choices[0].message.content is not text")
    return content
