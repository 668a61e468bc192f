"""What to run: the job, the config builder, the ZeRO-stage and mbs search, knob spaces and tuners, and the whole strategy over an evaluate callable."""
