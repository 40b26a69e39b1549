"""PDD: cross-datacenter Prefill → RelayDecode → MainDecode LLM serving."""

import os as _os

# NOTE: how long an OpenMP worker that finished a parallel region spins before it sleeps, in
# libgomp's iterations (~25 ns each on the AMD hosts measured): 1000, ~25 us. libgomp's own
# default, 300,000 (~7.5 ms), holds cores that the other roles' engines, the event loops and the
# gateway need when they share a host. No spin at all (OMP_WAIT_POLICY=PASSIVE, the default until
# 2026-12-06) puts the worker to sleep after every region, and a decode step is ~55 regions (the
# projections, attention): each then starts by waking it, ~2 ms of a ~17 ms step here. 25 us
# spans the gaps between one step's regions and not much more (docs/engine-performance.md,
# "Threads"). Set before torch loads libgomp, which reads it once: on the first import of the
# package; an operator's own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins, and the services' child
# processes inherit it.
SPIN_COUNT = "1000"
# Whether the value is ours (benchmarks start other systems' servers without it).
OMP_SPIN_SET_HERE = not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys()
if OMP_SPIN_SET_HERE:
    _os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT

__version__ = "0.1.0"
