"""How `run_service` sets up a stage's process before its body serves, seen from inside a
real process: the heap of imports frozen out of garbage collection, uvloop, and a short
GIL switch interval."""

from __future__ import annotations

import json
import subprocess
import sys

from common.service import GIL_SWITCH_S

BODY = """
import asyncio, gc, json, sys
from common.service import run_service

async def body(ctx):
    print(json.dumps({"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects()),
                      "loop": type(asyncio.get_running_loop()).__module__,
                      "switch": sys.getswitchinterval()}))

sys.exit(run_service("probe", sys.argv[1:], body))
"""


def test_a_stage_serves_with_its_setup_heap_frozen_on_uvloop(redis_url):
    done = subprocess.run([sys.executable, "-c", BODY, "some-model", "--redis-url", redis_url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # the imports (torch-free here, still tens of thousands of objects) are frozen, and
    # collections walk only what was made since
    assert seen["frozen"] > 10_000 and seen["tracked"] < seen["frozen"] / 2
    assert seen["loop"].startswith("uvloop")
    assert seen["switch"] == GIL_SWITCH_S
