# Shared by .ci/slurm_up.sh and .ci/twonode_up.sh (sourced): the slurm.conf settings both test clusters use.
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
