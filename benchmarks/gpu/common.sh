# Sourced by the device scripts: the model shapes the devkit carries, the results folder
# under $OUT (or $R), and `bench SECONDS ARGS...` (headrace bench under a time limit).
M=.devkit/models
R="${R:-$OUT/r}"
mkdir -p "$R"
export HEADRACE_SHAPES=$M
bench() { timeout "$1" python -m services.cli bench "${@:2}"; }
