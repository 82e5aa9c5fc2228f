"""my-vllm. One process-wide setting lives here because it must precede `import torch`."""

import os

# libgomp (torch's OpenMP runtime on Linux) reads this once, when torch loads it. Its default
# spins up to 300,000 times at every barrier before sleeping; when the cores are shared with
# other processes, a spinning thread keeps the core its descheduled partner needs, and a step
# on a loaded machine ran an order of magnitude slower than with short or no spinning. 10,000
# spins (tens of microseconds) still bridge the gap between back-to-back parallel regions of one
# step. An explicit setting wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
