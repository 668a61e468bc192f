"""The user's launcher: their command read (`zerotune.launchers.command`), each launcher's reader and
behaviour (`zerotune.launchers.base` and one module per launcher), and the rank contracts they share with the
warm server and Slurm's tasks (`zerotune.launchers.contract`)."""
