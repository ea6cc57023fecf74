"""An OpenAI-compatible chat server over plain transformers, for machines where vLLM is not available.

Run it as `python -m artnb.backends.engines.hf.server --model PATH --served-name NAME --port P --api-key K`;
`artnb.backends.engines.hf.client.HFEngine` does that for you and keeps it tied to the notebook's lifetime.

What it serves, and how it differs from OpenAI:
- `POST /v1/chat/completions` and `POST /v1/completions`, streamed (`stream=True`: server-sent events as
  tokens are sampled, hf/streaming.py) or not. Every chat choice carries per-token logprobs (always, whatever
  the request asks) and the sampled `token_ids` (the field vLLM adds with `return_token_ids`), and the response
  carries `prompt_token_ids`: the trainer needs exactly these tokens, not a re-tokenization of the text.
- Tools: Hermes `<tool_call>` blocks the model writes become `tool_calls` (`tool_choice` "auto", the default
  with tools); "none" leaves them as text; "required" or a named function constrains decoding to valid calls
  of the allowed tools (hf/grammar.py), several when `parallel_tool_calls` is not False.
- `presence_penalty` and `frequency_penalty` apply to sampling (not to the reported logprobs); `logit_bias`,
  and on completions `echo`, `suffix` and `best_of`, get a 400 rather than being ignored.
- `guided_choice` / `structured_outputs.choice` constrain the output to one of a few strings (vLLM's keys);
  `response_format` (`json_object`, `json_schema`), `structured_outputs.json` / `json_object` and `guided_json`
  constrain it to JSON (hf/grammar.py), each row with its own grammar. Regex and grammar constraints get a 400.
- LoRA adapters load and unload at runtime (vLLM's `/v1/load_lora_adapter` API). A model name `agent`
  resolves to the latest loaded `agent@N`, at the moment the request is scheduled.
- The newest adapter of each family (what plain `agent` resolves to, the one RL samples from) is served with
  its weights merged into the base linear layers (`--merge-newest`, default on for CPU, off for CUDA;
  merged_weights.py), so it decodes at the base model's speed: unmerged LoRA made decoding ~30% slower on a
  CPU, while on a GPU the LoRA matmuls are cheap and a merged copy costs memory. The base model and older
  `agent@k` run as LoRA on the untouched original weights. At most one adapter is merged: loading a newer
  one builds its merged weights (one pass over the adapted layers, while the trainer holds the engine) and
  frees the old; switching between merged and unmerged batches swaps parameters, with no arithmetic and
  no rounding drift. The cost is one extra copy of the adapted layers' weights. Responses still name the
  adapter (`agent@2`), and `GET /artnb/stats` says which adapter is merged right now (`merged`).
- `POST /artnb/hold` pauses scheduling without failing requests, so the trainer can swap adapters between
  batches; `/artnb/release` resumes. A hold whose client went away before it was answered is undone, so a
  timed-out `hold()` cannot leave the engine held. `GET /artnb/stats` counts requests, rows and batches,
  and rows cut short because their client disconnected.

Limits, so one client cannot stall or flood the server:
- Every route but `/health` needs the API key, checked before any body is read, and bodies over
  `--max-request-bytes` get 413 (guard.py). There are no `/docs`, `/redoc` or `/openapi.json` routes.
- Chat-template rendering, tokenization and the response's JSON run on one worker thread with its own
  tokenizer, not on the event loop: a 4 MB prompt takes seconds to tokenize, and `/health` must not wait.
  One thread, because a fast tokenizer used from two threads at once can fail ("Already borrowed").
- A request whose client disconnects stops decoding at the next step; its queued rows never run.
- A chat template sent with the request is refused unless `--trust-request-chat-template` (vLLM's flag):
  the server renders it, and a slow one stalls every request behind it. The server's own `--chat-template FILE`
  (trusted: it is the configuration) replaces the tokenizer's template, and `--default-chat-template-kwargs
  JSON` are the template's variables for every request, under a request's own `chat_template_kwargs` (vLLM's
  flags, with vLLM's meaning): so every client, not only artnb's, renders as the model is trained.

The scheduler lives in hf/scheduler.py, the decoding loop (continuous batching: requests join a running batch)
in hf/batching.py, the slot buffers it decodes from (CUDA graphs on a GPU; `--decoding`, checked at start, the
result in the log and `/artnb/stats`) in hf/slots.py, the batched sampler in hf/sampling.py, the wire format in
hf/protocol.py. A hold frees the slot buffers and their graphs, for the trainer beside the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import json
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from artnb.backends.cpu_threads import cpu_threads
from artnb.backends.engines.guard import (
    DEFAULT_MAX_REQUEST_BYTES,
    ClientGone,
    RequestGuard,
    error_body,
    while_connected,
)
from artnb.backends.engines.hf.batching import ChoiceTrie, Row, check_slots, decode_batch
from artnb.backends.engines.hf.client import API_KEY_ENV, DECODINGS
from artnb.backends.engines.hf.grammar import GrammarCompiler, JsonConstraint
from artnb.backends.engines.hf.protocol import (
    ChatRequest,
    CompletionRequest,
    DefaultsRequest,
    EngineError,
    LoadAdapterRequest,
    StructuredOutput,
    UnloadAdapterRequest,
    error_response,
    parse_tool_calls,
    sampling_refusals,
    structured_output,
    tool_choice,
)
from artnb.backends.engines.hf.scheduler import Scheduler
from artnb.backends.engines.hf.slots import SlotDecoder
from artnb.backends.engines.hf.streaming import ChunkStream
from artnb.backends.engines.merged_weights import MergedWeights, unmergeable_reason
from artnb.backends.engines.tool_calls import call_schema
from artnb.core.chat_messages import template_message  # as the trainer renders a history's messages
from artnb.core.names import check_adapter_name, from_art_step

T = TypeVar("T")


@dataclass
class _Adapter:
    internal: str  # PEFT adapter name; external names like "agent@3" are not safe module keys
    path: str
    unmergeable: str | None = None  # why it cannot be served merged (merged_weights.py); None if it can


def adapter_family(name: str) -> str:
    """The plain name that resolves to adapter `name`: "agent" for "agent@3", the name itself otherwise."""
    family, _, step = name.rpartition("@")
    return family if family and step.isdigit() else name


class HFServer:
    """The model, its tokenizer and its LoRA adapters; turns chat requests into rows and rows into JSON."""

    def __init__(
        self,
        model_path: str,
        served_name: str,
        *,
        device: str,
        max_batch_size: int,
        max_loras: int,
        trust_request_chat_template: bool = False,
        merge_newest: bool | None = None,
        chat_template: str | None = None,
        default_chat_template_kwargs: dict[str, Any] | None = None,
        decoding: str = "slots",
        cuda_graphs: bool = True,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if decoding not in DECODINGS:
            raise ValueError(f"decoding={decoding!r}: pass one of {DECODINGS}")

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model_path, self.served_name, self.max_loras = model_path, served_name, max_loras
        self.merge_newest = device == "cpu" if merge_newest is None else merge_newest
        self._merge: MergedWeights | None = None  # the merge target's weights (at most one adapter's)
        self._merge_name: str | None = None  # its served name
        self.merge_passes = 0  # merged weights built (one pass over the adapted layers each)
        self.default_temperature = 1.0  # for requests that name none (POST /artnb/defaults)
        self.trust_request_chat_template = trust_request_chat_template
        # Used only on the prep thread (templates, prompts, responses) once serving; the decoding thread
        # (stop strings) and the grammar compiler have their own instances.
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.default_template_kwargs = dict(default_chat_template_kwargs or {})
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="artnb-prep")
        self._worker_tokenizer = copy.deepcopy(self.tokenizer)
        self.base = (
            AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
            .to(device)  # pyright: ignore[reportArgumentType]  # transformers wraps `to` so pyright binds no self
            .eval()
        )
        self.peft: Any = None  # the PeftModel wrapping self.base once an adapter is loaded
        self._active: str | None = None  # the PEFT adapter last made active (set_adapter takes ~10 ms)
        self.adapters: OrderedDict[str, _Adapter] = OrderedDict()  # oldest-loaded first
        self._adapter_count = 0
        self._model_lock = threading.Lock()
        self._waiters_lock = threading.Lock()
        self._model_waiters = 0  # callers waiting for the model lock: a running batch takes no new rows then
        self.max_batch_size = max_batch_size
        self.context_length = getattr(self.base.config, "max_position_embeddings", None) or 2048
        eos = self.base.generation_config.eos_token_id
        eos = [self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])]
        self.eos_ids = list(dict.fromkeys(t for t in eos if t is not None))  # the tokenizer's EOS first
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        )
        self._token_text: dict[int, str] = {}
        output_layer = self.base.get_output_embeddings()
        assert output_layer is not None, "a causal LM has an output layer"
        vocab_size = output_layer.weight.shape[0]  # logits width, padding included
        # The compiler reads the vocabulary on first use, in another thread: give it its own tokenizer.
        self.grammars = GrammarCompiler(copy.deepcopy(self.tokenizer), vocab_size, self.eos_ids)
        self.scheduler = Scheduler(self.resolve, self.run_batch, max_batch_size)
        self._served_version = 0  # moves on whenever adapters or merged weights change (graphs are dropped)
        self.slots: SlotDecoder | None = None
        self.decoding = "dynamic, as asked (--decoding dynamic)"
        if decoding == "slots":
            slots = SlotDecoder(self.base, graphs=cuda_graphs)
            check = check_slots(self.base, slots, pad_id=self.pad_id, eos_ids=self.eos_ids)
            self.slots = slots if check.problem is None else None
            self.decoding = (
                f"slots (start check: logprobs within {check.difference:.2g} of the dynamic cache's)"
                if check.problem is None
                else f"dynamic: {check.problem}"
            )

    @contextmanager
    def _using_model(self) -> Iterator[None]:
        """The model lock, with the wait counted, so that a batch taking new rows lets an adapter change in."""
        with self._waiters_lock:
            self._model_waiters += 1
        try:
            self._model_lock.acquire()
        finally:
            with self._waiters_lock:
                self._model_waiters -= 1
        try:
            yield
        finally:
            self._model_lock.release()

    def served_names(self) -> list[str]:
        return [self.served_name, *self.adapters]

    def resolve(self, name: str) -> str:
        """The served name for a requested one: the base, an exact adapter (`name@N`, or ART's `name:stepN`),
        or the latest `name@N`."""
        name = from_art_step(name)
        if name == self.served_name or name in self.adapters:
            return name
        versions = [
            (int(key.rsplit("@", 1)[1]), key)
            for key in self.adapters
            if key.startswith(f"{name}@") and key.rsplit("@", 1)[1].isdigit()
        ]
        if versions:
            return max(versions)[1]
        raise EngineError(
            404,
            f"model {name!r} is not served here; served: {self.served_names()}. Use one of these names, "
            f"or load the adapter first (POST /v1/load_lora_adapter)",
        )

    @property
    def merged(self) -> str | None:
        """The adapter whose weights are merged into the base weights right now, if any."""
        return self._merge_name if self._merge is not None and self._merge.applied else None

    def is_newest(self, name: str) -> bool:
        """True if adapter `name` is what its plain family name resolves to (the one RL samples from)."""
        try:
            return self.resolve(adapter_family(name)) == name
        except EngineError:
            return False

    def run_batch(
        self,
        name: str,
        rows: list[Row],
        more: Callable[[int], list[Row]] | None = None,
        on_finish: Callable[[Row], None] | None = None,
    ) -> None:
        """Decode `rows` on model `name`; rows of the same model join from `more` while no adapter change waits
        for the model (a load or unload would otherwise wait for the batch to run dry)."""
        with self._using_model():
            if name == self.served_name:
                self._unmerge()
                model = self.peft if self.peft is not None else self.base
                context = self.peft.disable_adapter() if self.peft is not None else nullcontext()
            elif name in self.adapters:
                model, context = self.peft, nullcontext()
                merged = self._serve_merged(name)
                if merged is None:
                    self._unmerge()
                self._activate(self.adapters[name].internal)
                if merged is not None:
                    merged.apply()  # PEFT now runs only the base layers, which hold the merged weights
            else:
                raise EngineError(404, f"adapter {name!r} was unloaded before its request ran; load it again")
            decode = lambda ids: self._worker_tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            join = None if more is None else (lambda n: [] if self._model_waiters else more(n))
            if self.slots is not None:
                self.slots.begin(model, key=(name, self.merged, self._served_version))
            with context:
                decode_batch(
                    model,
                    rows,
                    pad_id=self.pad_id,
                    eos_ids=self.eos_ids,
                    decode=decode,
                    more=join,
                    max_rows=self.max_batch_size,
                    on_finish=on_finish,
                    slots=self.slots,
                )

    def free_decoding_memory(self) -> None:
        """Give back the slot buffers and their graphs (kept between batches): the engine is held, and the
        trainer beside it wants the memory."""
        if self.slots is not None:
            with self._using_model():
                self.slots.release()

    def decoding_stats(self) -> dict[str, Any]:
        graphs = self.slots.graphs if self.slots is not None else None
        cache = self.slots.cache if self.slots is not None else None
        return {
            "decoding": self.decoding,
            # the slot buffers' size while they are held (between batches too), None once freed by a hold
            "slot_buffers": None if cache is None else {"slots": cache.slots, "columns": cache.columns},
            "cuda_graphs": graphs is not None and graphs.enabled,
            "cuda_graphs_off_why": graphs.disabled_why if graphs is not None else None,
            "graph_captures": graphs.captures if graphs is not None else 0,
        }

    def load_adapter(self, name: str, path: str) -> list[str]:
        """Load (or replace) adapter `name`; return the names evicted to stay within max_loras."""
        from peft import PeftModel

        try:
            check_adapter_name(name)
        except ValueError as error:
            raise EngineError(400, str(error)) from None
        if name == self.served_name:
            raise EngineError(
                400, f"adapter name {name!r} is the base model's served name: pick another name"
            )
        if not (Path(path) / "adapter_config.json").is_file():
            raise EngineError(
                400,
                f"{path} is not a PEFT adapter directory (no adapter_config.json): pass the directory "
                f"written by PeftModel.save_pretrained",
            )
        internal = f"lora{self._adapter_count}"
        self._adapter_count += 1
        with self._using_model():
            self._unmerge()  # PEFT wraps and reads the base layers: let it see the original weights
            self._active = None
            try:
                if self.peft is None:
                    self.peft = PeftModel.from_pretrained(self.base, path, adapter_name=internal).eval()
                else:
                    self.peft.load_adapter(path, adapter_name=internal, is_trainable=False)
            except Exception as error:
                raise EngineError(
                    400,
                    f"could not load adapter {name!r} from {path}: {error}. Check that it was trained "
                    f"on this engine's base model ({self.model_path})",
                ) from error
            evicted = []
            if name in self.adapters:
                self._drop(name)
            while len(self.adapters) >= self.max_loras:
                evicted.append(next(iter(self.adapters)))
                self._drop(evicted[-1])
            self.adapters[name] = _Adapter(internal, str(path), unmergeable_reason(self.peft, internal))
            self._served_version += 1
            if self.merge_newest and self.is_newest(name):
                self._retarget(name)  # now, while the trainer holds the engine, not in the next request
        return evicted

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise EngineError(404, f"no adapter named {name!r} is loaded; loaded: {list(self.adapters)}")
        with self._using_model():
            self._drop(name)

    def _drop(self, name: str) -> None:
        self._unmerge()
        self._served_version += 1
        if name == self._merge_name:
            self._merge = self._merge_name = None
        internal = self.adapters.pop(name).internal
        self._active = None  # PEFT picks another active adapter when it deletes this one
        if len(self.peft.peft_config) == 1:
            # PEFT cannot run with zero adapters: go back to the plain model.
            self.base = self.peft.unload()
            self.peft = None
        else:
            self.peft.delete_adapter(internal)

    def _activate(self, internal: str) -> None:
        if internal != self._active:
            self._unmerge()  # PEFT's set_adapter would unmerge by subtracting, from our merged copy
            self.peft.set_adapter(internal)
            self._active = internal

    def _unmerge(self) -> None:
        if self._merge is not None:
            self._merge.restore()

    def _serve_merged(self, name: str) -> MergedWeights | None:
        """The merged weights to serve adapter `name` with (built if it is not the target yet), or None to serve
        it as LoRA."""
        if not self.merge_newest or self.adapters[name].unmergeable is not None or not self.is_newest(name):
            return None
        if name != self._merge_name:
            self._retarget(name)
        return self._merge

    def _retarget(self, name: str) -> None:
        """Make adapter `name` the merge target: drop the old target's merged weights, build this one's."""
        adapter = self.adapters[name]
        if adapter.unmergeable is not None:
            print(f"artnb engine: serving {name!r} as LoRA, unmerged: {adapter.unmergeable}", flush=True)
            return
        self._unmerge()
        self._merge = self._merge_name = None  # frees the old copy before the new one is built
        self._served_version += 1
        start = time.perf_counter()
        try:
            self._merge, self._merge_name = MergedWeights(self.peft, adapter.internal), name
        except (RuntimeError, MemoryError) as error:  # out of memory, most likely: LoRA still works
            adapter.unmergeable = f"building its merged weights failed ({type(error).__name__}: {error})"
            print(f"artnb engine: serving {name!r} as LoRA, unmerged: {adapter.unmergeable}", flush=True)
            return
        self.merge_passes += 1
        print(
            f"artnb engine: merged weights for {name!r} built in {time.perf_counter() - start:.2f}s "
            f"({len(self._merge.swaps)} layers, {self._merge.nbytes / 2**20:.0f} MiB)",
            flush=True,
        )

    def compile_grammar(self, constraint: StructuredOutput | None) -> Any:
        """The compiled JSON grammar a request needs (None for none); blocking, so call it off the event loop."""
        if constraint is None or not constraint.json:
            return None
        try:
            return self.grammars.compile(constraint.schema)
        except (ValueError, RuntimeError) as error:
            raise EngineError(
                400, f"{error}. Fix the schema in response_format / structured_outputs"
            ) from error

    def template_kwargs(self, request: ChatRequest) -> dict[str, Any]:
        """The extra apply_chat_template arguments: the server's defaults under the request's own, and a
        template of the request's own only if trusted."""
        kwargs = dict(request.chat_template_kwargs or {})
        if request.chat_template is not None:
            kwargs["chat_template"] = request.chat_template
        if kwargs.get("chat_template") is not None and not self.trust_request_chat_template:
            raise EngineError(
                400,
                "this request sends its own chat template (chat_template or chat_template_kwargs.chat_template),"
                " which this engine refuses: the server would render it, and a slow template stalls every "
                "request. Drop it to use the model's template, or start the engine with "
                "HFEngine(..., trust_request_chat_template=True) (--trust-request-chat-template) if you "
                "trust every client",
            )
        return {**self.default_template_kwargs, **kwargs}

    def chat_prompt(self, request: ChatRequest) -> list[int]:
        """The conversation rendered by the chat template and tokenized; blocking, so call it on the prep thread."""
        kwargs = self.template_kwargs(request)
        try:
            text = self.tokenizer.apply_chat_template(
                [template_message(m) for m in request.messages],
                tools=request.tools,
                add_generation_prompt=True,
                tokenize=False,
                **kwargs,
            )
        except Exception as error:
            raise EngineError(400, f"the chat template rejected these messages: {error}") from error
        return self.tokenizer.encode(text, add_special_tokens=False)

    def completion_prompt(self, request: CompletionRequest) -> list[int]:
        """The prompt's token ids (given as ids, or text tokenized as vLLM does: with special tokens)."""
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list (sampling_refusals refuses several)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = [t for t in prompt if isinstance(t, int) and 0 <= t < len(self.tokenizer)]
        if not prompt or len(ids) != len(prompt):
            raise EngineError(
                400, f"prompt token ids must be a non-empty list of ids below {len(self.tokenizer)}"
            )
        return ids

    def rows_for(
        self,
        request: ChatRequest | CompletionRequest,
        constraint: StructuredOutput | None = None,
        grammar: Any = None,
    ) -> tuple[list[int], list[Row]]:
        """Tokenize the prompt and expand the request into `n` rows; raises EngineError if invalid.

        `constraint` is `structured_output(request)`; `grammar` the compiled grammar (JSON or forced tool
        calls) every row follows, if any. Blocking (a long prompt takes seconds), so call it on the prep thread.
        """
        sampling_refusals(request)
        if isinstance(request, ChatRequest):
            prompt = self.chat_prompt(request)
            max_tokens = request.max_completion_tokens or request.max_tokens
            top_logprobs = request.top_logprobs or 0
        else:
            prompt = self.completion_prompt(request)
            max_tokens, top_logprobs = request.max_tokens, request.logprobs or 0
        room = self.context_length - len(prompt)
        if room < 1:
            raise EngineError(
                400,
                f"the prompt has {len(prompt)} tokens, which leaves no room to generate in the model's context "
                f"of {self.context_length} tokens: shorten the conversation",
            )
        max_tokens = max_tokens or room
        if max_tokens > room:
            raise EngineError(
                400,
                f"prompt has {len(prompt)} tokens, max_tokens {max_tokens}, context {self.context_length}: "
                f"shorten the conversation or lower max_tokens to at most {room}",
            )
        choices = constraint.choices if constraint is not None else None
        trie = None
        if choices:
            trie = ChoiceTrie([self.tokenizer.encode(c, add_special_tokens=False) for c in choices])
        stop = [request.stop] if isinstance(request.stop, str) else [s for s in request.stop or [] if s]
        rows = [
            Row(
                prompt_ids=prompt,
                max_tokens=max_tokens,
                temperature=self.default_temperature if request.temperature is None else request.temperature,
                top_p=request.top_p or 1.0,
                stop=stop,
                seed=None if request.seed is None else (request.seed * 1_000_003 + i) % 2**63,
                choices=trie,
                grammar=JsonConstraint(grammar) if grammar is not None else None,
                top_logprobs=top_logprobs,
                min_tokens=request.min_tokens,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
            )
            for i in range(request.n)
        ]
        return prompt, rows

    def _text(self, token: int) -> str:
        if token not in self._token_text:
            self._token_text[token] = self.tokenizer.decode([token])
        return self._token_text[token]

    def _logprob(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def visible_text(self, row: Row) -> str:
        """The row's text so far: special tokens dropped, cut at the first stop string."""
        text = self.tokenizer.decode(
            [t for t in row.token_ids if t not in self.eos_ids], skip_special_tokens=True
        )
        cuts = [text.find(s) for s in row.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def token_logprobs(self, row: Row, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
        """Chat logprobs of tokens `start:end` of the row (each with its requested top logprobs)."""
        picked = zip(row.token_ids[start:end], row.logprobs[start:end], row.top[start:end], strict=True)
        return [
            {**self._logprob(t, lp), "top_logprobs": [self._logprob(*pair) for pair in top]}
            for t, lp, top in picked
        ]

    def legacy_logprobs(self, row: Row, start: int, end: int | None, offset: int) -> dict[str, Any]:
        """`/v1/completions` logprobs (tokens, token_logprobs, top_logprobs, text_offset) of tokens `start:end`."""
        tokens = [self._text(t) for t in row.token_ids[start:end]]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": row.logprobs[start:end],
            "top_logprobs": [{self._text(t): lp for t, lp in top} for top in row.top[start:end]],
            "text_offset": offsets,
        }

    def choice_json(self, index: int, row: Row, with_tools: bool) -> dict[str, Any]:
        text = self.visible_text(row)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish_reason = row.finish_reason
        if with_tools:
            calls, rest = parse_tool_calls(text)
            if calls:
                message.update(content=rest if rest.strip() else None, tool_calls=calls)
                finish_reason = "tool_calls"
        return {
            "index": index,
            "message": message,
            "finish_reason": finish_reason,
            "logprobs": {"content": self.token_logprobs(row)},
            "token_ids": row.token_ids,
        }

    def completion_choice_json(self, index: int, row: Row, top_logprobs: int | None) -> dict[str, Any]:
        logprobs = None if top_logprobs is None else self.legacy_logprobs(row, 0, None, 0)
        return {
            "index": index,
            "text": self.visible_text(row),
            "finish_reason": row.finish_reason,
            "logprobs": logprobs,
            "token_ids": row.token_ids,
        }

    def response_body(
        self, request: ChatRequest | CompletionRequest, served: str, prompt: list[int], rows: list[Row]
    ) -> bytes:
        """The response's JSON; blocking (n rows of logprobs can be megabytes), so call it on the prep thread."""
        completion_tokens = sum(len(r.token_ids) for r in rows)
        if isinstance(request, ChatRequest):
            with_tools = tool_choice(request).mode != "none"
            kind, choices = (
                "chat.completion",
                [self.choice_json(i, r, with_tools) for i, r in enumerate(rows)],
            )
        else:
            kind, choices = (
                "text_completion",
                [self.completion_choice_json(i, r, request.logprobs) for i, r in enumerate(rows)],
            )
        completion = {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{secrets.token_hex(12)}",
            "object": kind,
            "created": int(time.time()),
            "model": served,
            "choices": choices,
            "prompt_token_ids": prompt,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt)
                + completion_tokens,  # the prompt once, as OpenAI and vLLM count it
            },
        }
        return json.dumps(completion, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

    async def on_prep_thread(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._prep, functools.partial(function, *args)
        )

    async def prepare(self, request: ChatRequest | CompletionRequest) -> tuple[list[int], list[Row]]:
        """Check the request, compile its grammar and build its rows (off the event loop); raises EngineError."""
        self.resolve(request.model)  # an unknown model is a 404 now, not in the middle of a stream
        grammar: Any = None
        if isinstance(request, ChatRequest):
            constraint = structured_output(request)
            tools = tool_choice(request)
            if tools.mode == "required" and constraint is not None:
                raise EngineError(
                    400, "the request forces a tool call and sets an output constraint: pass only one of them"
                )
            if tools.mode == "required":
                schema = call_schema(request.tools or [], tools.names)
                grammar = await asyncio.to_thread(self.compile_tool_grammar, schema, tools.parallel)
            elif constraint is not None:
                grammar = await asyncio.to_thread(self.compile_grammar, constraint)
        else:
            constraint = None
        return await self.on_prep_thread(self.rows_for, request, constraint, grammar)

    def compile_tool_grammar(self, schema: dict[str, Any], parallel: bool) -> Any:
        try:
            return self.grammars.compile_tool_calls(schema, parallel)
        except (ValueError, RuntimeError) as error:
            raise EngineError(400, f"{error}. Fix the tools' parameters") from error

    async def answer(self, request: ChatRequest | CompletionRequest) -> bytes:
        """Answer one request (the response's JSON); the event loop only waits, it never tokenizes."""
        prompt, rows = await self.prepare(request)
        served = await self.scheduler.submit(request.model, rows)
        return await self.on_prep_thread(self.response_body, request, served, prompt, rows)

    async def stream(
        self, request: ChatRequest | CompletionRequest, prompt: list[int], rows: list[Row]
    ) -> AsyncIterator[bytes]:
        """The server-sent events of a prepared request, sent as its rows are sampled (hf/streaming.py)."""
        chat = isinstance(request, ChatRequest)
        chunks = ChunkStream(
            self,
            rows,
            prompt,
            chat=chat,
            with_tools=chat and tool_choice(request).mode != "none",
            include_usage=bool((request.stream_options or {}).get("include_usage")),
            top_logprobs=None if chat else request.logprobs,
        )
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        for row in rows:
            row.on_token = functools.partial(loop.call_soon_threadsafe, woken.set)
        job = asyncio.ensure_future(self.scheduler.submit(request.model, rows))
        try:
            while not job.done():
                wake = asyncio.ensure_future(woken.wait())
                await asyncio.wait({job, wake}, return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                woken.clear()
                served = getattr(rows[0].job, "resolved", None) or request.model
                for event in await self.on_prep_thread(chunks.advance, served):
                    yield event
            try:
                served = job.result()
            except Exception as error:  # the response has begun: report the error as OpenAI streams do
                status, message = (
                    (error.status, error.message)
                    if isinstance(error, EngineError)
                    else (500, f"the engine failed on this request: {type(error).__name__}: {error}")
                )
                yield b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"
                return
            for event in await self.on_prep_thread(chunks.advance, served):
                yield event
            for event in chunks.usage(served):
                yield event
            yield b"data: [DONE]\n\n"
        finally:
            if not job.done():  # the client went away: its rows leave the batch at the next step
                job.cancel()


def create_app(
    server: HFServer, api_key: str, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> RequestGuard:
    """The ASGI app: FastAPI routes behind a RequestGuard (every route but /health needs the API key)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        yield

    app = FastAPI(title="artnb HF engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, error: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, error: EngineError) -> JSONResponse:
        return error_response(error.status, error.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in error.errors())
        return error_response(400, f"invalid request: {problems}. Fix these fields and retry")

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> JSONResponse:
        return error_response(500, f"the engine failed on this request: {type(error).__name__}: {error}")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": server.served_name, "object": "model", "owned_by": "artnb", "root": server.model_path}]
        data += [
            {"id": name, "object": "model", "owned_by": "artnb", "root": a.path, "parent": server.served_name}
            for name, a in server.adapters.items()
        ]
        return {"object": "list", "data": data}

    async def respond(body: ChatRequest | CompletionRequest, request: Request) -> Response:
        if not body.stream:
            return Response(
                await while_connected(request, server.answer(body)), media_type="application/json"
            )
        prompt, rows = await while_connected(request, server.prepare(body))
        return StreamingResponse(server.stream(body, prompt, rows), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await respond(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await respond(body, request)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadAdapterRequest) -> dict[str, Any]:
        evicted = await asyncio.to_thread(server.load_adapter, request.lora_name, request.lora_path)
        return {"lora_name": request.lora_name, "evicted": evicted}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadAdapterRequest) -> dict[str, Any]:
        await asyncio.to_thread(server.unload_adapter, request.lora_name)
        return {"lora_name": request.lora_name}

    @app.post("/artnb/hold")
    async def hold(request: Request) -> dict[str, bool]:
        try:
            await while_connected(request, server.scheduler.hold())
        except ClientGone:
            server.scheduler.release()  # the client gave up (e.g. timed out): nobody will release this hold
            raise
        await asyncio.to_thread(server.free_decoding_memory)
        return {"held": True}

    @app.post("/artnb/release")
    async def release() -> dict[str, bool]:
        server.scheduler.release()
        return {"held": False}

    @app.post("/artnb/defaults")
    async def defaults(request: DefaultsRequest) -> dict[str, float]:
        server.default_temperature = 1.0 if request.temperature is None else request.temperature
        return {"temperature": server.default_temperature}

    @app.get("/artnb/stats")
    async def stats() -> dict[str, Any]:
        return {
            **server.scheduler.stats,
            "adapters": list(server.adapters),
            "merged": server.merged,
            "merge_passes": server.merge_passes,
            "default_temperature": server.default_temperature,
            **server.decoding_stats(),
        }

    return RequestGuard(
        app, api_key=api_key, max_request_bytes=max_request_bytes, key_source="HFEngine.api_key"
    )


def exit_with_parent(parent: int, interval_s: float = 1.0) -> None:
    """Exit once process `parent` is no longer our parent, so a killed kernel leaves no server behind."""

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                print(f"artnb engine: parent process {parent} exited; shutting down", flush=True)
                os._exit(0)

    threading.Thread(target=watch, name="artnb-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", required=True, help="model directory (or hub id) for from_pretrained")
    parser.add_argument("--served-name", required=True, help="the name clients pass as `model` for the base")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"default: ${API_KEY_ENV}")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--max-batch-size", type=int, default=32, help="rows decoded together at most")
    parser.add_argument(
        "--max-loras", type=int, default=4, help="adapters kept loaded; the oldest is evicted"
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413 before they are read",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat_template sent with a request (refused with 400 by default)",
    )
    parser.add_argument(
        "--chat-template",
        type=Path,
        help="a file holding the chat template to render with instead of the tokenizer's",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=json.loads,
        default={},
        help="the chat template's variables for every request, as a JSON object; a request's own override them",
    )
    parser.add_argument(
        "--merge-newest",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve each family's newest adapter merged into the base weights (default: on for CPU, off for CUDA)",
    )
    parser.add_argument(
        "--decoding",
        choices=DECODINGS,
        default="slots",
        help="slots: fixed KV buffers (CUDA graphs on a GPU) where the model passes the start check, else "
        "dynamic; dynamic: a growing cache (hf/slots.py says why)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, replay slot decode steps as CUDA graphs",
    )
    parser.add_argument("--parent-pid", type=int, default=os.getppid(), help="exit when this process dies")
    args = parser.parse_args(argv)
    if not args.api_key:
        parser.error(f"no API key: pass --api-key or set ${API_KEY_ENV}")
    exit_with_parent(args.parent_pid)
    torch.set_num_threads(cpu_threads())
    import uvicorn

    server = HFServer(
        args.model,
        args.served_name,
        device=args.device,
        max_batch_size=args.max_batch_size,
        max_loras=args.max_loras,
        trust_request_chat_template=args.trust_request_chat_template,
        merge_newest=args.merge_newest,
        chat_template=args.chat_template.read_text(encoding="utf-8") if args.chat_template else None,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        decoding=args.decoding,
        cuda_graphs=args.cuda_graphs,
    )
    graphs = " with CUDA graphs" if server.decoding_stats()["cuda_graphs"] else ""
    print(
        f"artnb engine: {args.model} loaded on {server.base.device}; serving as {args.served_name!r}; "
        f"decoding: {server.decoding}{graphs}",
        flush=True,
    )
    uvicorn.run(
        create_app(server, args.api_key, args.max_request_bytes),
        host=args.host,
        port=args.port,
        access_log=False,
        timeout_graceful_shutdown=2,  # an in-flight batch must not hold up stop()
    )


if __name__ == "__main__":
    main()
