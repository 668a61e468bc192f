"""What zerotune knows of DeepSpeed: the user config, key tables and defaults, canonical names, validation, the experiment directory and the launcher command."""
