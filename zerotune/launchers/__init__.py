"""The user's launcher: their command read (:mod:`~zerotune.launchers.command`), each launcher's reader and
behaviour (:mod:`~zerotune.launchers.base` and one module per launcher), and the rank contracts they share with the
warm server and Slurm's tasks (:mod:`~zerotune.launchers.contract`)."""
