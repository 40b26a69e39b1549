"""PDD: cross-datacenter Prefill → RelayDecode → MainDecode LLM serving."""

import os as _os

# NOTE: OpenMP workers that finish a parallel region sleep instead of spinning (libgomp spins
# ~300k iterations by default). An engine process shares its cores with its own event loop and,
# on one host, with the other roles' engines and the gateway: spinning workers hold exactly the
# cores those need, and a parallel region stalls whenever one of its workers was descheduled
# (docs/engine-performance.md, "Threads"). It must be set before torch loads libgomp, which
# reads it once, so it is set on the first import of the package; an operator's own value wins.
# An operator's GOMP_SPINCOUNT (a spin of its own length) wins too (docs/engine-performance.md).
# Whether the value is ours (benchmarks start other systems' servers without it).
OMP_WAIT_POLICY_SET_HERE = not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys()
if OMP_WAIT_POLICY_SET_HERE:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

__version__ = "0.1.0"
