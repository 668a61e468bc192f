"""What zerotune knows of DeepSpeed: the user config, key tables and defaults, canonical names, validation and the launcher command."""
