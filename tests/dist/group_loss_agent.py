"""A stand-in for torchrun's agent and two workers of one node, for `GroupLossExit`'s test.

`python -m tests.dist.group_loss_agent dead|alive` starts worker A (this module's `worker`, with
torchrun's environment) and a sibling B, then, like torchrun: `dead` SIGKILLs B, reaps it and
SIGTERMs A; `alive` SIGTERMs A with B alive and then lets A's main thread go on. A's main thread
blocks in a read that Python's signal handler cannot end (PEP 475 resumes it), as a rank blocked
in torchft's client does. Prints A's exit code and output as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys


def worker() -> None:
    from plait.plugins.fault_tolerance.group_loss import GroupLossExit

    received: list[int] = []
    # The trainer's graceful stop: the handler only records the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    watch = GroupLossExit(replica_group=1).start()
    print("ready", flush=True)
    sys.stdin.buffer.read(1)
    watch.judged.wait(60)
    print(f"graceful stop after {received}", flush=True)
    watch.stop()


def agent(mode: str) -> None:
    env = dict(os.environ, TORCHELASTIC_RUN_ID="group-loss-test", LOCAL_WORLD_SIZE="2", RANK="0")
    a = subprocess.Popen(
        [sys.executable, "-m", "tests.dist.group_loss_agent", "worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert a.stdout is not None and a.stdin is not None
        assert a.stdout.readline() == b"ready\n"
        if mode == "dead":
            b.kill()
            b.wait()
        a.send_signal(signal.SIGTERM)
        if mode == "alive":
            a.stdin.write(b"x")
            a.stdin.flush()
        out, err = a.communicate(timeout=60)
    finally:
        a.kill()
        b.kill()
    print(json.dumps({"code": a.returncode, "out": out.decode(), "err": err.decode()}))


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker()
    else:
        agent(sys.argv[1])
