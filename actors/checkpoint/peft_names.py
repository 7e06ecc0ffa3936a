"""The file names of an adapter folder in PEFT's format (light: no torch), for whatever only names them."""

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
