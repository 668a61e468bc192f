#!/usr/bin/env bash
# Two "nodes" on this one machine, for tests/e2e/test_twonode.py: two network namespaces joined by a veth pair,
#   zt-node0: 10.77.0.1 (name ztnode0)     zt-node1: 10.77.0.2 (name ztnode1)
# each with the veth end named `ztnet` (so GLOO_SOCKET_IFNAME=ztnet / NCCL_SOCKET_IFNAME=ztnet name it on both);
# the names in /etc/hosts; an sshd in each namespace (root's key, for DeepSpeed's pdsh runner); and a Slurm
# cluster of its own, "zt2" (conf /etc/zerotune-twonode/slurm.conf, its slurmctld in zt-node0, one slurmd per
# namespace, the munge of .ci/slurm_up.sh). Ray nodes are started by the tests themselves.
#
# Run .ci/slurm_up.sh first (munge and the Slurm packages). Idempotent: what is up is left as it is.
# Needs root, `ip netns` and apt-get; without them it says so and exits 0 (the two-node tests skip, naming why).
# ZEROTUNE_NO_TWONODE=1 skips it too. `.ci/twonode_up.sh down` stops the daemons and removes the namespaces.
set -euo pipefail

say() { echo "twonode_up: $*" >&2; }
source "$(cd "$(dirname "$0")" && pwd)/slurm_lib.sh"  # slurm_policy, alive
ETC=/etc/zerotune-twonode
NS=(zt-node0 zt-node1)
NAMES=(ztnode0 ztnode1)
ADDRS=(10.77.0.1 10.77.0.2)
export SLURM_CONF=$ETC/slurm.conf
ON="$(cd "$(dirname "$0")" && pwd)/on_node"  # on_node I CMD: CMD on node I (its namespace and hostname)
daemon() { local d=${1#/run/zt2-}; d=${d%.pid}; echo "${d%%-*}"; }  # /run/zt2-sshd-ztnode0.pid: sshd

if [[ "${1:-}" == down ]]; then
    for pid in /run/zt2-*.pid; do alive "$pid" "$(daemon "$pid")" && kill "$(cat "$pid")"; rm -f "$pid"; done
    for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
    say "down"; exit 0
fi
if [[ -n "${ZEROTUNE_NO_TWONODE:-}" ]]; then
    say "ZEROTUNE_NO_TWONODE is set: no two-node setup (the two-node tests skip)"; exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
    say "not root, or no iproute2: no network namespaces (the two-node tests skip)"; exit 0
fi
if ! command -v slurmd >/dev/null || ! munge -n >/dev/null 2>&1; then
    say "no Slurm or munge (run .ci/slurm_up.sh first): the two-node tests skip"; exit 0
fi
packages=(pdsh openssh-server openssh-client)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null; }
fi

# the namespaces and the veth pair between them
if ! ip -n zt-node1 addr show ztnet 2>/dev/null | grep -q "${ADDRS[1]}/"; then
    for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; ip netns add "$ns"; done
    ip link add zt-veth0 type veth peer name zt-veth1
    for i in 0 1; do
        ip link set "zt-veth$i" netns "${NS[$i]}"
        ip -n "${NS[$i]}" link set "zt-veth$i" name ztnet
        ip -n "${NS[$i]}" addr add "${ADDRS[$i]}/24" dev ztnet
        ip -n "${NS[$i]}" link set ztnet up
        ip -n "${NS[$i]}" link set lo up
    done
fi
for i in 0 1; do
    grep -q "^${ADDRS[$i]} ${NAMES[$i]}\$" /etc/hosts || echo "${ADDRS[$i]} ${NAMES[$i]}" >>/etc/hosts
done

# ssh between the nodes as root, with a key of its own (DeepSpeed's pdsh runner: `ssh ztnode1 ...`)
install -d -m 700 $ETC/ssh /root/.ssh /run/sshd
[[ -s $ETC/ssh/id_ed25519 ]] || ssh-keygen -q -t ed25519 -N "" -f $ETC/ssh/id_ed25519
ssh-keygen -A >/dev/null
touch /root/.ssh/authorized_keys && chmod 600 /root/.ssh/authorized_keys
grep -qF "$(cut -d' ' -f2 $ETC/ssh/id_ed25519.pub)" /root/.ssh/authorized_keys || cat $ETC/ssh/id_ed25519.pub >>/root/.ssh/authorized_keys
if ! grep -q "^# zerotune two-node" /root/.ssh/config 2>/dev/null; then
    cat >>/root/.ssh/config <<EOF
# zerotune two-node test cluster (.ci/twonode_up.sh)
Host ztnode0 ztnode1 ${ADDRS[0]} ${ADDRS[1]}
    IdentityFile $ETC/ssh/id_ed25519
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
EOF
    chmod 600 /root/.ssh/config
fi
for i in 0 1; do
    pid=/run/zt2-sshd-${NAMES[$i]}.pid
    alive "$pid" sshd || "$ON" $i /usr/sbin/sshd -o ListenAddress="${ADDRS[$i]}" -o PidFile="$pid" \
        -o PermitRootLogin=prohibit-password -o UsePAM=no
done
for name in "${NAMES[@]}"; do  # as DeepSpeed's runner checks a host: `ssh NAME hostname`, here from node 0
    for try in 1 2 3 4 5; do
        "$ON" 0 ssh -o BatchMode=yes -o ConnectTimeout=5 "$name" true 2>/dev/null && break
        [[ $try == 5 ]] && { say "ssh from ${NAMES[0]} to $name fails: see /run/zt2-sshd-*.pid"; exit 1; }
        sleep 1
    done
done

# Slurm: a cluster of its own in the namespaces (the one-node cluster of slurm_up.sh is left alone)
cpus=$(nproc)
conf=$(cat <<EOF
# written by zerotune's .ci/twonode_up.sh: two nodes in network namespaces
ClusterName=zt2
SlurmctldHost=${NAMES[0]}(${ADDRS[0]})
$(slurm_policy)
SlurmdParameters=config_overrides
StateSaveLocation=/var/lib/slurm/zt2/slurmctld
SlurmdSpoolDir=/var/lib/slurm/zt2/slurmd-%n
SlurmctldPidFile=/run/zt2-slurmctld.pid
SlurmdPidFile=/run/zt2-slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/zt2-slurmctld.log
SlurmdLogFile=/var/log/slurm/zt2-slurmd-%n.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=${NAMES[0]} NodeAddr=${ADDRS[0]} CPUs=$cpus State=UNKNOWN
NodeName=${NAMES[1]} NodeAddr=${ADDRS[1]} CPUs=$cpus State=UNKNOWN
PartitionName=two Nodes=${NAMES[0]},${NAMES[1]} Default=YES MaxTime=INFINITE State=UP
EOF
)
install -d $ETC /var/log/slurm /var/lib/slurm/zt2/slurmctld
changed=0
if [[ ! -f $SLURM_CONF ]] || [[ "$(cat $SLURM_CONF)" != "$conf" ]]; then
    printf '%s\n' "$conf" >$SLURM_CONF
    changed=1
fi
if alive /run/zt2-slurmctld.pid slurmctld && [[ $changed == 1 ]]; then
    "$ON" 0 scontrol reconfigure || true
fi
alive /run/zt2-slurmctld.pid slurmctld || "$ON" 0 slurmctld
for i in 0 1; do
    alive "/run/zt2-slurmd-${NAMES[$i]}.pid" slurmd || "$ON" $i slurmd -N "${NAMES[$i]}"
done

for _ in $(seq 60); do
    states=$("$ON" 0 sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ' || true)
    if [[ $states =~ ^((idle|mixed|allocated|completing)\ )+$ ]]; then
        say "two nodes up: ${NAMES[*]} ($states)"; exit 0
    fi
    [[ $states == *down* || $states == *drain* ]] && \
        "$ON" 0 scontrol update NodeName="${NAMES[0]},${NAMES[1]}" State=RESUME 2>/dev/null || true
    sleep 1
done
say "the two-node Slurm did not come up: sinfo says '${states:-nothing}'; see /var/log/slurm/zt2-*.log"
tail -5 /var/log/slurm/zt2-*.log >&2 || true
exit 1
