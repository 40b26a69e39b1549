"""The prefill → relay fast link: one protocol, three transports.

- ``state``     — ``Transport`` and the ``TransferState`` machine.
- ``region``    — handshake records (``PrepareRequest``, ``Reservation``,
                  ``Completion``) and the two interfaces a transport implements.
- ``receiver``  — the relay's side: reserve, lease, CRC check, hand over, clean up.
- ``sender``    — prefill's side: write chunk by chunk, complete with the CRC.
- ``shm`` / ``tcp`` / ``rdma`` — the transports' byte paths.
- ``select``    — probe the host and choose a transport at start-up.

Modules are imported directly (``from pdd.kv.fast_link.receiver import ...``);
this package imports nothing, so ``pdd.kv.messages`` can use its records.
"""
