"""The job's inputs: what the user gave (the script, its ds_config, zerotune's options) read, checked and resolved
into one `Job` (job.py), with its batch semantics, its tuning space and `$VAR` placeholders, its budget of launches;
the strategy reads them, never the other way round."""
