"""The local weight paths that model rewards take as options: checked before anything loads."""

from __future__ import annotations

import os


class RewardFileError(FileNotFoundError):
    """A reward's local file or directory is missing or incomplete; the message names the reward."""

    def __init__(self, reward: str, message: str):
        super().__init__(message)
        self.reward = reward


def require_local(reward: str, option: str, value, what: str, kind: str = "any", hint: str = "") -> str:
    """`value` as a str, or a clear error naming the reward, the option and what it should be.

    kind: "file", "dir" or "any" (exists). hint: what to do about a missing path (default: say what
    was expected)."""
    if value is None:
        raise TypeError(f"reward {reward!r} needs {option}=<{what}>")
    value = os.fspath(value)
    exists = {"file": os.path.isfile, "dir": os.path.isdir, "any": os.path.exists}[kind](value)
    if not exists:
        problem = {"file": "is not a file", "dir": "is not a directory", "any": "does not exist"}[kind]
        raise RewardFileError(reward, f"reward {reward!r}: {option}={value!r} {problem}; {hint}" if hint
                              else f"reward {reward!r}: {option}={value!r} {problem} (expected: {what})")  # fmt: skip
    return value
