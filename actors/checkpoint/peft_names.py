"""The file names of an adapter folder in PEFT's format (light: no torch), for whatever only names them."""

from actors.spec.saved_adapter import CONFIG_NAME, WEIGHTS_NAME

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME"]
