"""The model of the model: per-device memory under each ZeRO stage, and what the profile run measured."""
