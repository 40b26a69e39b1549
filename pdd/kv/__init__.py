"""KV transport: how a request's KV cache travels between instances.

Records and wire format
    ``layout``       KvDtype, KvLayout (axis order, wire dtype)
    ``transfer``     TransferHeader, Chunk, Commit, TransferStatus; chunk geometry
    ``compression``  dtype cast on the wire (bf16 / fp16 / fp8), per-chunk zlib
    ``chunking``     encode_chunk / split, Reassembler (any order, dedup, CRC)
    ``checksum``     fast CRC-32 of chunks and regions (ISA-L when installed)
    ``messages``     every KV-transfer record ↔ proto message, validated
    ``source``       KvSource: what a sender reads, lazily, with back-pressure

WAN link (prefill / relay → MainDecode, gRPC ``PushKv``)
    ``wan``          KvPusher (resumable pushes), re-exports StreamPool, KvReceiver
    ``stream_pool``  at most K concurrent pushes per link, FIFO, measured waits
    ``receiver``     KvReceiver: per-request reassembly, exactly-once delivery
    ``waiters``      waiting on a transfer by request id

Fast link (prefill → relay): ``fast_link/`` (RDMA, shared memory, TCP)

The WAN emulator and the link benchmark are the testbed's: ``pdd.testbed``.
"""
