# Shared by .ci/slurm_up.sh and .ci/twonode_up.sh (sourced): the slurm.conf settings both test clusters use, and
# `alive`, the check that a daemon of a pid file is still running.
# Daemons as root, munge, no cgroups (a container may not delegate them), CPUs as the consumable resource, and
# short timeouts so a test's cancelled job or lost node is noticed in seconds.
slurm_policy() {
    cat <<'CONF'
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=5
InactiveLimit=0
MinJobAge=60
CONF
}

# alive PIDFILE NAME: the pid in PIDFILE is a running process named NAME. A pid file outlives its daemon (a
# machine's snapshot, a killed session), and its pid may since belong to another process: `kill -0` alone would
# then keep the daemon from being started.
alive() { [[ -s $1 ]] && pgrep -F "$1" -x "$2" >/dev/null 2>&1; }
