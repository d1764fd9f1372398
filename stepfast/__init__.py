"""stepfast: stepwise-credit GRPO for flow-matching image models."""

import logging

__version__ = "0.1.0"


class _TorchvisionFallbackNotice(logging.Filter):
    """Drops transformers' notice, without torchvision, that it falls back to the PIL image processors
    and that torchvision should be installed: those processors are what stepfast's pipelines and
    rewards use, and PyPI's torchvision brings a CUDA torch over a CPU one. Every other message of
    transformers is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back" not in record.getMessage()


logging.getLogger("transformers.utils.import_utils").addFilter(_TorchvisionFallbackNotice())
