"""What zerotune knows of DeepSpeed: the user config, keys and defaults, canonical names, validation, the launcher."""
