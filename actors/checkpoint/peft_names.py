"""The file names of an adapter folder in PEFT's format and aspen's facts beside it (light: no torch, no
transformers), for whatever only names them."""

from actors.spec.saved_adapter import CONFIG_NAME, METADATA_NAME, WEIGHTS_NAME

__all__ = ["CONFIG_NAME", "METADATA_NAME", "WEIGHTS_NAME"]
