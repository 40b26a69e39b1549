"""The domain of each serving role (prefill, relay, main_decode, gateway).

Each module here holds one role's request life, written against plain
Python objects; the gRPC servicers in ``services/<name>/server.py`` only
convert messages and call into these.
"""
