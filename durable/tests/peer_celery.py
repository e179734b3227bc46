"""The same job through Celery with Redis, for docs/performance.md: N tasks, one in ten fails once
with a retryable error and is retried (acks_late, so a worker death re-delivers the task).

    python peer_celery.py --redis redis://127.0.0.1:56379/0 --calls 2000 --workers 1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from celery import Celery

app = Celery("levee_peer", broker=os.environ.get("PEER_REDIS", "redis://127.0.0.1:56379/0"),
             backend=os.environ.get("PEER_REDIS", "redis://127.0.0.1:56379/0"))
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=32, task_reject_on_worker_lost=True,
                result_expires=600, broker_connection_retry_on_startup=True)


@app.task(name="levee_peer.work", bind=True, max_retries=9, acks_late=True)
def work(self, n: int) -> str:
    time.sleep(0.001)
    if (n * 7 + self.request.retries + 1) % 10 == 0:
        raise self.retry(countdown=0.05)
    return "ok"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, "-m", "celery", "-A", "peer_celery", "worker", "-P", "threads",
                               "-c", "32", "-l", "WARNING", "-n", f"w{i}@%h"], cwd=here,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(args.workers)]
    time.sleep(5)  # let the workers connect (not timed)
    try:
        t0 = time.monotonic()
        results = [work.delay(i) for i in range(args.calls)]
        for r in results:
            r.get(timeout=300)
        dt = time.monotonic() - t0
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
    print(f"peer bench: celery+redis, {args.workers} worker(s): {args.calls} tasks in {dt:.2f}s = {args.calls / dt:.0f} tasks/s")


if __name__ == "__main__":
    main()
