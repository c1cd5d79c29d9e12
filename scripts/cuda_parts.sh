# Sourced by scripts/cuda_session.sh and scripts/cuda_ab.sh: what both do on a GPU machine without network access.
# Needs PY (the interpreter that has torch), OUT (the results' folder) and start (the run's start, `date +%s`).

install_wheels() {  # install_wheels TARGET WHEEL...: the wheels into folder TARGET, without their dependencies
    local target=$1
    shift
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@"
}

part() {  # part SECONDS NAME COMMAND...: the command's output to $OUT/NAME.txt, its time and exit status printed
    local limit=$1 name=$2
    shift 2
    if [ -n "${PARTS:-}" ] && [[ " $PARTS " != *" $name "* ]]; then
        return
    fi
    echo "=== [$(( $(date +%s) - start )) s] $name: $*"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "=== $name: exit $? after $(( $(date +%s) - start )) s"
}
