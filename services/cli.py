"""`headrace <command> ...`: each command lives in its own module, imported only when run,
so `headrace queues` does not pay for importing torch."""

from __future__ import annotations

import importlib
import sys

# The tools (benchmarks/) sit above the services: they import services' public entry
# points, never the other way round. The CLI may still name them because it names every
# command only as a module path, imported when that command runs; no service, and not the
# CLI itself at import time, depends on benchmarks/, and one `headrace` script keeps every
# command in one place.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("services.launcher", "start Redis (embedded unless --redis-url) and every service"),
    "gateway": ("services.gateway.shell", "run the HTTP gateway process"),
    "tokenizer": ("services.tokenizer.shell", "run one tokenizer process"),
    "scheduler": ("services.scheduler.shell", "run the scheduler process"),
    "worker": ("services.worker.shell", "run the GPU worker process"),
    "detokenizer": ("services.detokenizer.shell", "run one detokenizer process"),
    "generate": ("services.offline.generate", "generate completions offline and print them"),
    "run-batch": ("services.offline.run_batch", "run an OpenAI batch file (JSON lines) offline"),
    "queues": ("services.queues", "show every hr:* stream: length, groups, pending, lag"),
    "bench": ("benchmarks.bench", "benchmarks: bus, throughput, latency, serve, soak"),
    "profile": ("benchmarks.profiler.run", "layerwise profile of prefill and decode steps"),
    "profile-table": ("benchmarks.profiler.table", "print a table from a saved profile JSON"),
    "profile-plot": ("benchmarks.profiler.plot", "plot a saved profile JSON as stacked bars"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: headrace <command> [args]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`headrace <command> --help` describes each command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"headrace: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
