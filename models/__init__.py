"""Model definitions: `ModelConfig.from_hf` and a plain single-device decoder per family."""

from kiln.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, ModelConfigError
from kiln.models.decoder import CausalLM, build

__all__ = ["SUPPORTED_MODEL_TYPES", "CausalLM", "ModelConfig", "ModelConfigError", "build"]
