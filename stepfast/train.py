"""The main job: `deepspeed stepfast/train.py [--config NAME] [key=value ...]`.

The trainer has not landed yet: this entry point says so and exits with an error instead of
pretending to train.
"""

import sys


def main() -> int:
    print("stepfast: the trainer is not implemented yet; see the open trainer issue.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
