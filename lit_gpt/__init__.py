"""lit_gpt: one hackable GPT implementation for the open model families, with GPU/CPU and XLA recipes."""

from lit_gpt.config import Config
from lit_gpt.model import GPT

__all__ = ["GPT", "Config"]
