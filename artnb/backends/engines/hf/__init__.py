"""The HF engine, an OpenAI-compatible server over plain transformers, split by side.

client.py runs in the notebook (`HFEngine`: start, stop, control calls); server.py and the rest run in the
server's child process (scheduler.py: requests into batches; batching.py: the decoding loop; slots.py: the
fixed KV buffers and CUDA graphs it decodes from; sampling.py, streaming.py, grammar.py, protocol.py: the wire
format).
"""
