"""Engine load in a fresh process: `import levee`, `levee.Engine(...)` (the component compiled or read
from the cache, instantiated, the document parsed), the process's peak RSS; tenacity's import for
comparison. Each run is one process; run it with an empty cache directory, then again (warm):

    d=$(mktemp -d); for i in 1 2 3; do LEVEE_CACHE_DIR=$d python bench/coldstart.py; done
"""

from __future__ import annotations

import resource
import time

t0 = time.perf_counter()
import levee  # noqa: E402

t1 = time.perf_counter()
engine = levee.Engine("policies:\n  p:\n    attempts: 3\n", seed=1)
t2 = time.perf_counter()
assert engine.policy("p")(lambda: 1)() == 1
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t3 = time.perf_counter()
import tenacity  # noqa: E402, F401

t4 = time.perf_counter()
print(
    f"python: import {(t1 - t0) * 1e3:.0f} ms, load {(t2 - t1) * 1e3:.1f} ms, max RSS {rss:.1f} MB; "
    f"tenacity import {(t4 - t3) * 1e3:.0f} ms (after levee's)"
)
