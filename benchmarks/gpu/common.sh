# Sourced by the device scripts: the model shapes the devkit carries, the results folder
# under $OUT (or $R), and `bench SECONDS ARGS...` (headrace bench under a time limit).
M=.devkit/models
R="${R:-$OUT/r}"
mkdir -p "$R"
export HEADRACE_SHAPES=$M
bench() { timeout "$1" python -m services.cli bench "${@:2}"; }
bench_in() {  # TREE SECONDS ARGS...: `bench` in this tree (new) or in the copy in .base (base)
  local dir=$PWD shapes
  shapes=$(realpath $M)
  [ "$1" = base ] && dir=$PWD/.base
  (cd "$dir" && PYTHONPATH="/tmp/site:$dir" HEADRACE_SHAPES=$shapes timeout "$2" \
    python -m services.cli bench "${@:3}")
}
port_free() {  # PORT: fail loudly where a server from before still answers there
  if python -c "import socket,sys; sys.exit(socket.socket().connect_ex(('127.0.0.1', $1)) != 0)"; then
    echo "port $1 is taken: a server from before is still running" >&2; return 1
  fi
}
wait_healthy() {  # PORT: until the server there answers /health with 200 (at most 300 s)
  python - "$1" <<'PY'
import sys, time, urllib.request
for _ in range(300):
    try:
        url = f"http://127.0.0.1:{sys.argv[1]}/health"
        if urllib.request.urlopen(url, timeout=1).status == 200:
            break
    except OSError:
        pass
    time.sleep(1)
PY
}
