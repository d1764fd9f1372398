"""What importing stepfast does to the process beyond defining its modules."""

import logging
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_only_transformers_torchvision_fallback_notice_is_dropped():
    import stepfast  # noqa: F401 (installs the filter)

    logger = logging.getLogger("transformers.utils.import_utils")

    def kept(message: str) -> bool:
        return logger.filter(logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, None, None))

    assert not kept("`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil`")
    assert kept("Could not import module 'CLIPImageProcessor'")


def test_loading_a_pipeline_module_prints_no_torchvision_notice():
    """diffusers' SD3 pipeline imports transformers' image processors: on a machine without
    torchvision the notice came on every start of the trainer and the evaluation."""
    code = "import stepfast, stepfast.models; from diffusers import StableDiffusion3Pipeline"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "requires torchvision" not in proc.stderr
