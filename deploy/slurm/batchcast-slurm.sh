# Functions for running batchcast brokers in a Slurm allocation, sourced by
# batchcast.sbatch (or your own batch script). Bash; needs srun.
#
#   batchcast_env                  checks the allocation and the binary
#   batchcast_start_brokers CONFIG a broker per node, in the background
#   batchcast_wait_brokers         until every node's broker answers
#   batchcast_run COMMAND...       the job's tasks, each with BATCHCAST_SOCKET
#   batchcast_stop_brokers         stops them (SIGTERM; they drain and exit)

batchcast_fail() {
    echo "batchcast-slurm: $*" >&2
    return 2
}

# Checks the allocation's variables and sets BATCHCAST_NODES (its node
# count) and BATCHCAST_BIN. Each node's socket is node-local, set by
# BATCHCAST_NODE_ENV in every step: $BATCHCAST_RUN_DIR, else $TMPDIR (often
# a per-job directory on each node), else /tmp, plus batchcast-$SLURM_JOB_ID.
batchcast_env() {
    [ -n "${SLURM_JOB_ID:-}" ] || { batchcast_fail "SLURM_JOB_ID is not set: run inside an allocation (sbatch or salloc)"; return 2; }
    case "$SLURM_JOB_ID" in
        *[!0-9_]*) batchcast_fail "SLURM_JOB_ID '$SLURM_JOB_ID' is not a job id"; return 2 ;;
    esac
    local nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}"
    case "$nodes" in
        '' | *[!0-9]* | 0) batchcast_fail "SLURM_JOB_NUM_NODES is '${nodes}', not a node count"; return 2 ;;
    esac
    export BATCHCAST_NODES="$nodes"
    if [ -n "${BATCHCAST_RUN_DIR:-}" ] && [ "${BATCHCAST_RUN_DIR#/}" = "$BATCHCAST_RUN_DIR" ]; then
        batchcast_fail "BATCHCAST_RUN_DIR '$BATCHCAST_RUN_DIR' is not an absolute path"
        return 2
    fi
    BATCHCAST_BIN="${BATCHCAST_BIN:-$(command -v batchcast || true)}"
    [ -n "$BATCHCAST_BIN" ] || { batchcast_fail "no batchcast binary: pip install batchcast (it carries the broker) or set BATCHCAST_BIN"; return 2; }
    export BATCHCAST_BIN
}

# Run first by every step's shell on its node: that node's socket.
# shellcheck disable=SC2016 # expanded on each node
BATCHCAST_NODE_ENV='export BATCHCAST_SOCKET="${BATCHCAST_RUN_DIR:-${TMPDIR:-/tmp}}/batchcast-$SLURM_JOB_ID/batchcast.sock"
if [ ${#BATCHCAST_SOCKET} -ge 100 ]; then
    echo "batchcast-slurm: socket path $BATCHCAST_SOCKET is too long for a Unix socket; set BATCHCAST_RUN_DIR to a short node-local directory" >&2
    exit 2
fi'
export BATCHCAST_NODE_ENV

# Runs COMMAND [ARGS...] as the job's tasks (srun's defaults: the
# allocation's tasks per node), each with its node's BATCHCAST_SOCKET.
batchcast_run() {
    # shellcheck disable=SC2016 # expanded by each task's shell
    srun --overlap --kill-on-bad-exit=1 bash -c 'eval "$BATCHCAST_NODE_ENV" && exec "$@"' batchcast-task "$@"
}

# One broker per node, as one background job step. Its node's share of a
# `rank = "slurm"` stream comes from the step's SLURM_NODEID / SLURM_NNODES.
# The socket's directory must be this user's (another user could otherwise
# have made it, on a shared /tmp, to replace the socket); it is made 0700.
batchcast_start_brokers() {
    local config="$1"
    [ -f "$config" ] || { batchcast_fail "broker config '$config' is not a file"; return 2; }
    config="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"
    # shellcheck disable=SC2016 # expanded by each node's shell
    srun --overlap --nodes="$BATCHCAST_NODES" --ntasks-per-node=1 --ntasks="$BATCHCAST_NODES" \
        --cpus-per-task="${BATCHCAST_BROKER_CPUS:-4}" --kill-on-bad-exit=0 \
        bash -c 'eval "$BATCHCAST_NODE_ENV" && d="$(dirname "$BATCHCAST_SOCKET")" && mkdir -p -m 700 "$d" &&
            { [ -O "$d" ] && [ ! -L "$d" ] || { echo "batchcast-slurm: $d on $(hostname) is not a directory of yours; remove it or set BATCHCAST_RUN_DIR" >&2; exit 2; }; } &&
            chmod 700 "$d" && exec "$BATCHCAST_BIN" serve --config "$1" --socket "$BATCHCAST_SOCKET"' \
        batchcast-broker "$config" &
    BATCHCAST_BROKERS_PID=$!
    export BATCHCAST_BROKERS_PID
}

# Waits until the broker of every node answers `batchcast stats` (up to
# BATCHCAST_START_TIMEOUT seconds, default 120), or fails naming the nodes.
batchcast_wait_brokers() {
    local deadline=$((SECONDS + ${BATCHCAST_START_TIMEOUT:-120}))
    local up
    while :; do
        if ! kill -0 "${BATCHCAST_BROKERS_PID:-0}" 2>/dev/null; then
            batchcast_fail "the broker step exited before every broker answered; see the job's output"
            return 2
        fi
        # shellcheck disable=SC2016 # expanded by each node's shell
        up=$(srun --overlap --nodes="$BATCHCAST_NODES" --ntasks-per-node=1 --ntasks="$BATCHCAST_NODES" \
            bash -c 'eval "$BATCHCAST_NODE_ENV" && "$BATCHCAST_BIN" stats --socket "$BATCHCAST_SOCKET" >/dev/null 2>&1 && echo up' \
            2>/dev/null | grep -c '^up$' || true)
        [ "$up" -eq "$BATCHCAST_NODES" ] && return 0
        if [ $SECONDS -ge $deadline ]; then
            batchcast_fail "$up of $BATCHCAST_NODES brokers answered within ${BATCHCAST_START_TIMEOUT:-120} s"
            return 2
        fi
        sleep 1
    done
}

batchcast_stop_brokers() {
    local pid="${BATCHCAST_BROKERS_PID:-}"
    [ -n "$pid" ] || return 0
    # SIGTERM to srun is passed on to the step's tasks: each broker stops.
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    BATCHCAST_BROKERS_PID=""
}
