"""stepfast: stepwise-credit GRPO for flow-matching image models."""

import logging

__version__ = "0.1.0"


class _DropNotice(logging.Filter):
    """Drops one third-party notice (messages holding `text`); every other message is kept."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


# transformers, without torchvision: it falls back to the PIL image processors and asks for torchvision.
# Those processors are what stepfast's pipelines and rewards use, and PyPI's torchvision brings a CUDA
# torch over a CPU one.
logging.getLogger("transformers.utils.import_utils").addFilter(
    _DropNotice("requires torchvision (not installed); falling back")
)
# DeepSpeed, without a GPU: "Setting accelerator to CPU. If you have GPU or other accelerator, we were
# unable to detect it", at every start (and in pretrain, which imports it through accelerate). The
# trainer's own first line says where it runs ("2 ranks on cpu").
logging.getLogger("DeepSpeed").addFilter(_DropNotice("Setting accelerator to CPU. If you have GPU"))


def quiet_ctrl_c_while_starting(command: str) -> None:
    """A command's first step when run as one, before its imports (seconds of torch, diffusers and
    DeepSpeed): a Ctrl-C among them ends it with one line, `<command>: interrupted while starting`,
    and exit status 130, not a traceback from inside an import; nothing has been written by then.
    Under a launcher every rank gets the Ctrl-C and the first says it. `ctrl_c_as_usual()`, once the
    imports are done, gives Ctrl-C back to the command's own handling. A process started with SIGINT
    ignored (`cmd &` in a script) keeps ignoring it."""
    import os
    import signal
    import sys

    def interrupted(signum, frame):
        if os.environ.get("RANK", "0") == "0":
            print(f"\n{command}: interrupted while starting", file=sys.stderr)
        raise SystemExit(130)

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupted)


def ctrl_c_as_usual() -> None:
    """Ctrl-C raises KeyboardInterrupt again (Python's own handler), for the command to handle; an
    ignored SIGINT stays ignored."""
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
