from opdjax.models.config import ModelConfig, UnsupportedModelError
from opdjax.models.decoder import Model, positions_from_mask
from opdjax.models.hf_io import load_hf_params, save_hf_params

__all__ = ["Model", "ModelConfig", "UnsupportedModelError", "load_hf_params", "positions_from_mask",
           "save_hf_params"]
