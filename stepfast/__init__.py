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
