"""The testbed: what stands in for two datacenters on one machine — never part of a deployment.

``link_emulator`` (+ ``link_shaper``: a userspace WAN: shared bandwidth, delay, jitter, loss,
stall), ``netns_link`` (the kernel's ``tc tbf`` inside network namespaces), ``link_bench``
(measures a link), ``launcher`` + ``stack`` (every service as its own process: ``pdd up``,
``pdd demo``, the e2e tests).
"""
