#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/e2e/test_slurm.py: Debian's munge, slurmctld and slurmd,
# a minimal /etc/slurm/slurm.conf (this machine's CPUs and memory, as `slurmd -C` reads them), the daemons
# started, and a wait until `sinfo` shows the node up (idle, or running jobs). Idempotent: a cluster already up is left as it is.
#
# Needs root and apt-get; without them it says so and exits 0, so a developer's `make test` still runs
# (the Slurm tests then skip, naming why). ZEROTUNE_NO_SLURM=1 skips it too.
set -euo pipefail

say() { echo "slurm_up: $*" >&2; }
source "$(cd "$(dirname "$0")" && pwd)/slurm_lib.sh"  # slurm_policy, alive

if [[ -n "${ZEROTUNE_NO_SLURM:-}" ]]; then
    say "ZEROTUNE_NO_SLURM is set: not starting Slurm (the Slurm tests skip)"; exit 0
fi
node=$(hostname -s)
up_states='idle|mixed|allocated|completing'  # up: free, or running jobs (a second `make test`)
if command -v sinfo >/dev/null && state=$(sinfo -h -n "$node" -o %T 2>/dev/null) && [[ $state =~ ^($up_states)$ ]]; then
    say "Slurm is up ($node $state)"; exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    say "not root: not installing or starting Slurm (the Slurm tests skip); run 'sudo $0' for them"; exit 0
fi
if ! command -v apt-get >/dev/null; then
    say "no apt-get: not installing Slurm (the Slurm tests skip)"; exit 0
fi

packages=(munge slurmctld slurmd slurm-client)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null; }
fi

# munge: the key (the package makes one; a clean image may not) and the daemon, as its own user
if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
install -d -o munge -g munge -m 755 /run/munge
install -d -o munge -g munge -m 700 /var/log/munge /var/lib/munge
if ! munge -n >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged
fi

# slurm.conf: one node, this machine as `slurmd -C` sees it; no cgroups (a container may not delegate them)
hw=$(slurmd -C | head -1)  # NodeName=vm CPUs=2 ... RealMemory=24152
conf=$(cat <<EOF
# written by zerotune's .ci/slurm_up.sh: a one-node test cluster
ClusterName=$node
SlurmctldHost=$node(127.0.0.1)
$(slurm_policy)
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$hw NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
)
install -d /etc/slurm /var/log/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd
changed=0
if [[ ! -f /etc/slurm/slurm.conf ]] || [[ "$(cat /etc/slurm/slurm.conf)" != "$conf" ]]; then
    printf '%s\n' "$conf" >/etc/slurm/slurm.conf
    changed=1
fi

if alive /run/slurmctld.pid slurmctld && [[ $changed == 1 ]]; then
    scontrol reconfigure || true
fi
alive /run/slurmctld.pid slurmctld || slurmctld
alive /run/slurmd.pid slurmd || slurmd

for _ in $(seq 60); do
    state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
    case "$state" in
        idle|mixed|allocated|completing) say "Slurm is up ($node $state)"; exit 0 ;;
        down*|drain*) scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 1
done
say "Slurm did not come up: sinfo says '${state:-nothing}'; see /var/log/slurm/slurmctld.log and slurmd.log"
tail -5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
