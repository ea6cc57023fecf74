"""Inference engines: OpenAI-compatible servers in a child process, and the clients that run them.

Laid out by side: hf/ and vllm/ each hold a client (runs in the notebook) and what runs in the server's
process. Shared by both: child_process.py (the clients' lifecycle: start, stop, alive, logs, control calls),
merged_weights.py (serving the newest adapter merged into the base weights), guard.py (API key and body
limits), json_grammar.py and tool_calls.py (the same constrained decoding on both engines).
"""
