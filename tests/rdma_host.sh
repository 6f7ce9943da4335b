#!/usr/bin/env bash
# Runs tf_rdma's verbs tests and the verbs conformance suite on Soft-RoCE
# (the kernel's rdma_rxe driver), with TF_RDMA_TEST_VERBS=1: a real kernel
# RDMA device and the real libibverbs with rdma-core's rxe provider, no
# softnic. See docs/verbs.md, "Running on a Soft-RoCE host".
#
# Exit status: 0 every test passed; 1 a test failed; 2 a prerequisite is
# missing or the setup failed (the message says which and what to do).

set -u
set -o pipefail

PROG="tests/rdma_host.sh"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  cat <<EOF
usage: $PROG [--layout netns|root] [--no-pingpong] [--check] [--python PY] [-- PYTEST_ARGS...]

Sets up Soft-RoCE (rdma_rxe) over a veth pair, runs with TF_RDMA_TEST_VERBS=1
  1. the verbs conformance suite (tests/test_verbs_conformance.py) on the rxe
     device, through the real libibverbs (never softnic), and
  2. every other verbs test (pytest -k "verbs and not conformance" tests/),
then removes what it created (on any exit: trap).

Layouts (docs/verbs.md, "Running on a Soft-RoCE host"):
  netns  (default) two network namespaces joined by a veth pair,
         198.51.100.1/24 and .2/24, an rxe device over each end, created
         inside its namespace. First ibv_rc_pingpong (ibverbs-utils, when
         installed) sends RDMA traffic from one namespace's rxe device to
         the other's, over the veth pair. The tests then run in the first
         namespace on its device. Needs a kernel whose rdma_rxe is
         namespace-aware (a UDP socket on port 4791 per namespace);
         checked, with a message pointing to --layout root.
  root   for older kernels: one rxe device over a veth end in the root
         namespace (its peer in a namespace of its own, for the carrier);
         the tests run in the root namespace.
In both, the tests' processes talk over 127.0.0.1 in one namespace and their
queue pairs are on one rxe device: rxe loops that traffic back inside the
device, as a NIC loops back traffic between two processes of one host.

Options:
  --layout L      netns (default) or root
  --no-pingpong   skip the ibv_rc_pingpong check between the two devices
  --check         check the prerequisites only, change nothing; exit 0 or 2
  --python PY     the Python with tf_rdma built (default: .venv/bin/python)
  -h, --help      this text
  -- ARGS         more pytest arguments, for both runs (e.g. -x, -k EXPR)

Needs: root (rdma link, ip netns, modprobe); the rdma_rxe kernel module;
iproute2 (ip, rdma, ss); rdma-core's rxe provider (ibverbs-providers);
the checkout built (make install).
Exit status: 0 passed, 1 a test failed, 2 a prerequisite is missing or the
setup failed.
EOF
}

say() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { say "$*"; exit 2; }

LAYOUT=netns
PINGPONG=1
CHECK_ONLY=0
PY="$REPO/.venv/bin/python"
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --layout) [ $# -ge 2 ] || die "--layout needs netns or root"; LAYOUT="$2"; shift 2 ;;
    --layout=*) LAYOUT="${1#--layout=}"; shift ;;
    --no-pingpong) PINGPONG=0; shift ;;
    --check) CHECK_ONLY=1; shift ;;
    --python) [ $# -ge 2 ] || die "--python needs a path"; PY="$2"; shift 2 ;;
    --python=*) PY="${1#--python=}"; shift ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    *) say "unknown argument: $1"; usage >&2; exit 2 ;;
  esac
done
case "$LAYOUT" in
  netns|root) ;;
  *) die "--layout must be netns or root, not '$LAYOUT'" ;;
esac

# --- prerequisites: all of them checked, every missing one named ---

MISSING=()
missing() { MISSING+=("$*"); }
RXE_WAS_LOADED=0
[ -d /sys/module/rdma_rxe ] && RXE_WAS_LOADED=1

rxe_available() {
  # Loaded, or loadable: modprobe's dry run finds it for this kernel.
  [ "$RXE_WAS_LOADED" = 1 ] && return 0
  command -v modprobe >/dev/null 2>&1 && modprobe -n -q rdma_rxe 2>/dev/null
}

if ! rxe_available; then
  kernel="$(uname -r)"
  why="the kernel module rdma_rxe (Soft-RoCE) is not loaded"
  if ! command -v modprobe >/dev/null 2>&1; then
    why="$why, and there is no modprobe to load it (kmod)"
  else
    why="$why, and modprobe cannot find it for kernel $kernel"
  fi
  [ -d "/lib/modules/$kernel" ] || why="$why; /lib/modules/$kernel is absent"
  [ -d /sys/class/infiniband ] || why="$why; /sys/class/infiniband is absent (no RDMA support in this kernel)"
  missing "no rdma_rxe: $why. Use a kernel built with CONFIG_RDMA_RXE (most distribution kernels: modprobe rdma_rxe), or run the verbs tests over softnic instead (make test)"
fi
if [ "$(id -u)" != 0 ]; then
  missing "needs root (uid $(id -u)): it loads rdma_rxe, creates network namespaces, a veth pair and rxe devices"
fi
tools=()
for tool in ip rdma ss; do
  command -v "$tool" >/dev/null 2>&1 || tools+=("$tool")
done
[ ${#tools[@]} -eq 0 ] || missing "missing commands: ${tools[*]} (Debian/Ubuntu: apt-get install iproute2)"
provider=""
for dir in /usr/lib/*/libibverbs /usr/lib64/libibverbs /usr/lib/libibverbs; do
  for f in "$dir"/librxe-rdmav*.so; do
    [ -e "$f" ] && provider="$f"
  done
done
[ -n "$provider" ] || missing "no rxe provider for libibverbs (librxe-rdmav*.so; Debian/Ubuntu: apt-get install ibverbs-providers)"
if [ ! -x "$PY" ]; then
  missing "no Python at $PY: run make install in $REPO (or pass --python)"
elif [ ! -e "$REPO/tf_rdma/_tf_rdma_verbs.so" ]; then
  missing "the verbs plugin is not built ($REPO/tf_rdma/_tf_rdma_verbs.so): make install needs libibverbs-dev"
fi

if [ ${#MISSING[@]} -gt 0 ]; then
  say "cannot run the verbs tests on Soft-RoCE here:"
  for m in "${MISSING[@]}"; do
    printf '  - %s\n' "$m" >&2
  done
  exit 2
fi
if [ "$CHECK_ONLY" = 1 ]; then
  say "prerequisites met (rdma_rxe $( [ "$RXE_WAS_LOADED" = 1 ] && echo loaded || echo loadable ), provider $provider)"
  exit 0
fi

# --- setup, undone on any exit ---

TAG="$(( $$ % 100000 ))"
NS_A="tfrdma-rxe-a-$TAG"
NS_B="tfrdma-rxe-b-$TAG"
VETH_A="tfrxa$TAG"
VETH_B="tfrxb$TAG"
DEV_A="tfrxe_a$TAG"
DEV_B="tfrxe_b$TAG"
ADDR_A=198.51.100.1   # TEST-NET-2 (RFC 5737), only inside what this script makes
ADDR_B=198.51.100.2
CREATED_NS=()
CREATED_DEVS=()       # "namespace device" ("-" for the root namespace)
CREATED_LINK=""       # a veth end left in the root namespace
PINGPONG_PID=""
LOADED_RXE=0

in_ns() {  # in_ns NS CMD...: run CMD in network namespace NS ("-": the root one)
  local ns="$1"; shift
  if [ "$ns" = "-" ]; then "$@"; else ip netns exec "$ns" "$@"; fi
}

# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  if [ -n "$PINGPONG_PID" ]; then
    kill "$PINGPONG_PID" 2>/dev/null; wait "$PINGPONG_PID" 2>/dev/null
  fi
  local i entry
  for (( i=${#CREATED_DEVS[@]}-1; i>=0; i-- )); do
    entry="${CREATED_DEVS[$i]}"
    in_ns "${entry%% *}" rdma link delete "${entry#* }" 2>/dev/null \
      || say "could not delete the rxe device ${entry#* } (rdma link delete)"
  done
  [ -n "$CREATED_LINK" ] && ip link delete "$CREATED_LINK" 2>/dev/null
  for (( i=${#CREATED_NS[@]}-1; i>=0; i-- )); do
    ip netns delete "${CREATED_NS[$i]}" 2>/dev/null \
      || say "could not delete the namespace ${CREATED_NS[$i]}"
  done
  if [ "$LOADED_RXE" = 1 ]; then
    modprobe -r rdma_rxe 2>/dev/null || true
  fi
  if [ ${#CREATED_NS[@]} -gt 0 ] || [ ${#CREATED_DEVS[@]} -gt 0 ]; then
    say "cleaned up: ${CREATED_DEVS[*]:+rxe ${CREATED_DEVS[*]#* }; }namespaces ${CREATED_NS[*]:-none}"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ "$RXE_WAS_LOADED" = 0 ]; then
  err="$(modprobe rdma_rxe 2>&1)" || die "no rdma_rxe: modprobe rdma_rxe failed: ${err:-no message}"
  LOADED_RXE=1
fi
say "rdma_rxe loaded; RDMA namespace mode: $(rdma system show 2>/dev/null | tr -s ' ' || echo unknown)"

make_ns() {
  ip netns add "$1" || die "ip netns add $1 failed"
  CREATED_NS+=("$1")
  ip -n "$1" link set lo up || die "cannot bring lo up in $1"
}

# add_rxe NS DEV NETDEV: an rxe device over NETDEV, created in NS.
add_rxe() {
  local out
  out="$(in_ns "$1" rdma link add "$2" type rxe netdev "$3" 2>&1)" \
    || die "rdma link add $2 type rxe netdev $3 (in ${1/#-/the root namespace}) failed: $out"
  CREATED_DEVS+=("$1 $2")
}

# roce_v2_gid_index NS DEV ADDR: waits (5 s at most) until port 1 of DEV is
# ACTIVE with the IPv4-mapped RoCE v2 GID of ADDR, and prints that GID's
# index. Reads sysfs in NS, where DEV was created.
roce_v2_gid_index() {
  local ns="$1" dev="$2" o1 o2 o3 o4 want
  IFS=. read -r o1 o2 o3 o4 <<< "$3"
  want="$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' "$o1" "$o2" "$o3" "$o4")"
  for _ in $(seq 50); do
    # shellcheck disable=SC2016  # $1, $2: the inner shell's arguments
    in_ns "$ns" sh -c '
      port=/sys/class/infiniband/$1/ports/1
      grep -q ACTIVE "$port/state" 2>/dev/null || exit 1
      for f in "$port"/gids/*; do
        n=${f##*/}
        if [ "$(cat "$f" 2>/dev/null)" = "$2" ] &&
           grep -q "RoCE v2" "$port/gid_attrs/types/$n" 2>/dev/null; then
          echo "$n"; exit 0
        fi
      done
      exit 1' sh "$dev" "$want" && return 0
    sleep 0.1
  done
  return 1
}

port_state() {  # port_state NS DEV: port 1's state, for messages
  in_ns "$1" cat "/sys/class/infiniband/$2/ports/1/state" 2>/dev/null || echo "no sysfs entry"
}

# The veth pair: end A and end B each in its namespace (netns layout), or
# end A in the root namespace (root layout).
make_ns "$NS_B"
if [ "$LAYOUT" = netns ]; then
  make_ns "$NS_A"
  ip link add "$VETH_A" netns "$NS_A" type veth peer name "$VETH_B" netns "$NS_B" \
    || die "cannot create the veth pair $VETH_A/$VETH_B"
  RUN_NS="$NS_A"
else
  ip link add "$VETH_A" type veth peer name "$VETH_B" netns "$NS_B" \
    || die "cannot create the veth pair $VETH_A/$VETH_B"
  CREATED_LINK="$VETH_A"
  RUN_NS="-"
fi
in_ns "$RUN_NS" ip addr add "$ADDR_A/24" dev "$VETH_A" || die "cannot address $VETH_A"
in_ns "$RUN_NS" ip link set "$VETH_A" up || die "cannot bring $VETH_A up"
ip -n "$NS_B" addr add "$ADDR_B/24" dev "$VETH_B" || die "cannot address $VETH_B"
ip -n "$NS_B" link set "$VETH_B" up || die "cannot bring $VETH_B up"
if command -v ping >/dev/null 2>&1; then
  in_ns "$RUN_NS" ping -c 1 -W 2 "$ADDR_B" >/dev/null 2>&1 \
    || die "$ADDR_A cannot ping $ADDR_B over the veth pair $VETH_A/$VETH_B"
fi

add_rxe "$RUN_NS" "$DEV_A" "$VETH_A"
if [ "$LAYOUT" = netns ]; then
  # rdma_rxe receives RoCE v2 (UDP port 4791) on a socket per namespace
  # where the kernel supports that; without it the device exists but no
  # packet reaches it (the kernel's selftest rxe_rping_between_netns.sh
  # checks the same socket).
  if ! in_ns "$NS_A" ss -Hlun 'sport = :4791' 2>/dev/null | grep -q .; then
    die "this kernel's rdma_rxe is not namespace-aware (no UDP socket on port 4791 in $NS_A after rdma link add): rerun with --layout root"
  fi
  add_rxe "$NS_B" "$DEV_B" "$VETH_B"
fi
GID_A="$(roce_v2_gid_index "$RUN_NS" "$DEV_A" "$ADDR_A")" \
  || die "$DEV_A has no ACTIVE port with the RoCE v2 GID of $ADDR_A after 5 s (port 1: $(port_state "$RUN_NS" "$DEV_A"))"
say "$DEV_A over $VETH_A ($ADDR_A), RoCE v2 GID index $GID_A, in ${RUN_NS/#-/the root namespace}"

if [ "$LAYOUT" = netns ] && [ "$PINGPONG" = 1 ]; then
  if ! command -v ibv_rc_pingpong >/dev/null 2>&1; then
    say "note: ibv_rc_pingpong is missing (ibverbs-utils): the traffic between $DEV_A and $DEV_B is not checked"
  else
    GID_B="$(roce_v2_gid_index "$NS_B" "$DEV_B" "$ADDR_B")" \
      || die "$DEV_B has no ACTIVE port with the RoCE v2 GID of $ADDR_B after 5 s (port 1: $(port_state "$NS_B" "$DEV_B"))"
    in_ns "$NS_B" ibv_rc_pingpong -d "$DEV_B" -g "$GID_B" -n 100 >/dev/null 2>&1 &
    PINGPONG_PID=$!
    sleep 0.5
    out="$(in_ns "$NS_A" timeout 30 ibv_rc_pingpong -d "$DEV_A" -g "$GID_A" -n 100 "$ADDR_B" 2>&1)" \
      || die "ibv_rc_pingpong from $DEV_A ($NS_A) to $DEV_B ($NS_B) failed: RDMA traffic does not cross the veth pair (a firewall on UDP 4791?): $out"
    wait "$PINGPONG_PID" 2>/dev/null; PINGPONG_PID=""
    say "ibv_rc_pingpong $DEV_A -> $DEV_B over the veth pair: $(echo "$out" | grep -m1 'bytes in' || echo ok)"
  fi
fi

# --- the tests ---

# The real libibverbs, never softnic (build/softnic), whatever the caller's
# library path holds.
LIBPATH=""
IFS=: read -r -a dirs <<< "${LD_LIBRARY_PATH:-}"
for d in "${dirs[@]}"; do
  [ -n "$d" ] || continue
  [ "$(realpath -m "$d")" = "$(realpath -m "$REPO/build/softnic")" ] && continue
  LIBPATH="${LIBPATH:+$LIBPATH:}$d"
done
ulimit -l unlimited 2>/dev/null || say "note: cannot raise the locked-memory limit (ulimit -l $(ulimit -l))"

run_pytest() {
  (cd "$REPO" && in_ns "$RUN_NS" env LD_LIBRARY_PATH="$LIBPATH" TF_RDMA_TEST_VERBS=1 \
     TF_RDMA_VERBS_DEVICE="$DEV_A" TF_RDMA_VERBS_PORT=1 \
     "$PY" -m pytest -q -p no:cacheprovider "$@" "${PYTEST_ARGS[@]}")
}

say "1/2 the verbs conformance suite on $DEV_A"
run_pytest tests/test_verbs_conformance.py
conformance=$?
say "2/2 the verbs tests on $DEV_A (pytest -k 'verbs and not conformance')"
run_pytest -k "verbs and not conformance" tests/
verbs=$?

say "conformance suite: $( [ $conformance = 0 ] && echo passed || echo "FAILED (pytest exit $conformance)" ); verbs tests: $( [ $verbs = 0 ] && echo passed || echo "FAILED (pytest exit $verbs)" )"
[ $conformance = 0 ] && [ $verbs = 0 ] && exit 0
exit 1
