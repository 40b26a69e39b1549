"""The gateway's OpenAI-compatible HTTP face (aiohttp, in the gateway's event loop).

``openai_api`` holds the routes and the server, ``openai_convert`` turns JSON
into a ``GenerateJob`` (validated by ``pdd.wire.gateway``, like gRPC) and
events into OpenAI's JSON, ``errors`` maps domain errors to HTTP codes, and
``chat_template``/``stop_strings``/``text_stream`` are the text-level pieces.
"""
