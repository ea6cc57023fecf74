"""The vLLM engine, split by the process each part runs in.

client.py runs in the notebook (`VLLMEngine`: vLLM's command line, adapters, merged serving); server.py runs
in vLLM's API server process (the launcher and the ASGI middleware); worker.py runs in vLLM's worker (the
extension that reloads merged weights).
"""
