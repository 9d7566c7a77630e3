"""Request bodies of the OpenAI-compatible and native endpoints (pydantic models).

Field names follow the OpenAI API and SGLang's extensions to it, so SGLang and OpenAI
clients work unchanged. Every field a body may carry falls in one of three groups:

- implemented;
- accepted and ignored: only fields OpenAI or SGLang document as not changing the output
  (`user`, `metadata`, `service_tier`, reasoning-parser switches without a parser...);
- known but not implemented (`REFUSED`, each with its default): a 400 naming them unless
  given their default (or null), screened out before the model sees the body.

Anything else is an unknown field and a 400, on every route alike: a typo in a sampling
parameter must not silently give unconstrained output. Types are strict (no "5" for 5, no
true for 1, no NaN), and text fields may not hold lone surrogates (not Unicode).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    model_validator,
)

from kiln.runtime.grammar import KINDS


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(map(_is_int, v))


def _is_ids(v: Any) -> bool:
    return bool(v) and _is_int_list(v)


def _prompt(v: Any) -> Any:
    if isinstance(v, str):
        return v
    nonempty = isinstance(v, list) and bool(v)
    if nonempty and (all(isinstance(p, str) for p in v) or _is_ids(v) or all(map(_is_ids, v))):
        return v
    raise ValueError(
        "expected a string, a list of strings, a list of token ids or a list of lists of "
        "token ids (none empty)"
    )


def _token_ids(v: Any) -> Any:
    if _is_ids(v) or (isinstance(v, list) and bool(v) and all(_is_ids(p) for p in v)):
        return v
    raise ValueError("expected a list of token ids or a list of lists of token ids (none empty)")


def _texts(v: Any) -> Any:
    if isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        return v
    raise ValueError("expected a string or a list of strings")


def _token_lists(v: Any) -> Any:
    if _is_int_list(v) or (isinstance(v, list) and all(map(_is_int_list, v))):
        return v
    raise ValueError("expected a list of token ids or a list of lists of token ids")


def _params(v: Any) -> Any:
    if isinstance(v, dict) or (isinstance(v, list) and all(isinstance(p, dict) for p in v)):
        return v
    raise ValueError("expected an object or a list of objects (one per prompt)")


Prompt = Annotated[Any, PlainValidator(_prompt)]
SamplingParamsField = Annotated[Any, PlainValidator(_params)]
TokenIds = Annotated[Any, PlainValidator(_token_ids)]
Texts = Annotated[Any, PlainValidator(_texts)]


def lone_surrogate(data: Any, path: str = "") -> str | None:
    """The path of the first string holding a lone surrogate (which JSON's \\ud800 escapes
    can produce, but UTF-8 cannot encode), or None."""
    stack = [(path, data)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(v, dict):
            stack += [(f"{where}.{k}" if where else str(k), x) for k, x in v.items()]
            stack += [(where or "body", k) for k in v]
        elif isinstance(v, list):
            stack += [(f"{where}.{i}", x) for i, x in enumerate(v)]
    return None


def _is_default(value: Any, default: Any) -> bool:
    return value is None or value == default or value in ([], {})


class Body(BaseModel):
    """Strict, closed request body. `REFUSED`: fields OpenAI or SGLang define and kiln does
    not implement, with their defaults."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    REFUSED: ClassVar[dict[str, Any]] = {}
    _refused: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _screen(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        where = lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where} holds a lone surrogate, which is not valid Unicode")
        refused: list[str] = []
        if isinstance(data, dict) and cls.REFUSED:
            refused = [
                k for k, d in cls.REFUSED.items() if k in data and not _is_default(data[k], d)
            ]
            data = {k: v for k, v in data.items() if k not in cls.REFUSED}
        model = handler(data)
        model._refused = refused
        return model

    def unsupported(self, where: str = "") -> list[str]:
        """Refused fields the body gave a value other than their default, with their path
        (`messages[1].tool_calls`), nested objects included."""
        out = [f"{where}{name}" for name in self._refused]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, Body):
                out += value.unsupported(f"{where}{name}.")
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, Body):
                        out += item.unsupported(f"{where}{name}[{i}].")
        return out


# SGLang extensions both OpenAI routes define and kiln does not implement (yet).
_SGLANG_REFUSED: dict[str, Any] = {
    "stop_regex": None,
    "session_id": None,
    "session_params": None,
    "custom_params": None,
    "custom_logit_processor": None,
    "images_config": None,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_cached_tokens_details": False,
    "return_token_ids": False,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "routed_dp_rank": None,
    "disagg_prefill_dp_rank": None,
    "data_parallel_rank": None,
    "ngram_corpus_id": None,
    "custom_labels": None,
}


class StreamOptions(Body):
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Body):
    """OpenAI's response_format.json_schema: the schema under `schema`."""

    model_config = ConfigDict(populate_by_name=False)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> dict[str, str]:
        """The SGLang sampling parameter this format asks for (json_object: any object)."""
        if self.type == "json_object":
            return {"json_schema": json.dumps({"type": "object"})}
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema.schema: a JSON schema is required")
            return {"json_schema": json.dumps(self.json_schema.schema_)}
        return {}


class _Sampling(Body):
    """Fields common to completions and chat completions."""

    model: str = "default"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    n: int = 1
    stop: Texts | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    rid: Texts | None = None
    priority: int = 0  # used with --enable-priority-scheduling
    # SGLang's (vLLM's cache_salt): a request shares cached prefixes only with requests
    # of the same salt and key; a string, or one per prompt.
    cache_salt: Texts | None = None
    extra_key: Texts | None = None
    # SGLang's: a loaded LoRA adapter's name (--lora-paths); `model` "BASE:ADAPTER" wins
    lora_path: str | None = None
    response_format: ResponseFormat | None = None
    # SGLang's constraints, as extra body fields (runtime/grammar.py): at most one, and not
    # with a response_format that constrains.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    # Accepted and ignored: who is asking, not what to generate (OpenAI).
    user: str | None = None
    # SGLang's: each choice's `hidden_states`, a final hidden state (an
    # --enable-return-hidden-states artefact)
    return_hidden_states: bool = False

    REFUSED = _SGLANG_REFUSED

    def constraint(self) -> dict[str, Any]:
        """The grammar fields of the sampling parameters this body asks for."""
        given = {k: getattr(self, k) for k in KINDS if getattr(self, k) is not None}
        if self.response_format is not None:
            fmt = self.response_format.constraint()
            if fmt and given:
                raise ValueError(
                    f"response_format {self.response_format.type} and "
                    f"{', '.join(given)}: give one constraint"
                )
            given |= fmt
        return given

    @model_validator(mode="after")
    def _options_need_their_switch(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        self.constraint()  # one constraint at most, each complete
        return self

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "min_new_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "logit_bias": self.logit_bias,
            "max_new_tokens": max_tokens,
            **self.constraint(),
        }
        # The switches' defaults are the sampler's: left out unless the client set them,
        # so --preferred-sampling-params can set them for it.
        given = self.model_fields_set
        switches = ("ignore_eos", "skip_special_tokens", "no_stop_trim")
        return {
            k: v for k, v in params.items() if v is not None and (k not in switches or k in given)
        }


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = None
    # the text after the completion (code infilling): with --completion-template only
    suffix: str | None = None

    REFUSED = _SGLANG_REFUSED


# OpenAI's limit on the tools of one request.
MAX_TOOLS = 128
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionCall(Body):
    name: FunctionName
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    """An assistant message's earlier call, in the conversation history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # present when a client echoes streamed calls back


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(Body):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(Body):
    name: FunctionName


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # No effect without tools or a reasoning parser (serve/chat_output.py).
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # Accepted and ignored: metadata.
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[Literal["text"]] | None = None

    REFUSED = {
        **_SGLANG_REFUSED,
        "functions": None,
        "function_call": None,
        "reasoning_effort": None,
        "reasoning": None,
        "continue_final_message": False,
        "return_prompt_token_ids": False,
        "return_meta_info": False,
        "input_ids": None,
        "max_dynamic_patch": None,
        "min_dynamic_patch": None,
        "use_audio_in_video": False,
        "audio": None,
        "prediction": None,
        "web_search_options": None,
        "verbosity": None,
        "task": None,
        "store": False,
    }

    @model_validator(mode="after")
    def _options_need_what_they_act_on(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed with logprobs: true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice: only allowed with tools")
        names = [t.function.name for t in self.tools or []]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tools: function {twice[0]!r} is defined twice")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, else the older max_tokens (a 0 is a 0)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class SessionParams(Body):
    """SGLang's session_params (serve/sessions.py): the session, the request of it this one
    continues, where to cut that request's tokens, and whether to branch."""

    id: str | None = None
    rid: str | None = None
    offset: int | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None


class OpenSession(Body):
    """SGLang's /open_session body; capacity_of_str_len is required there and kept, as
    there, without bounding anything."""

    capacity_of_str_len: int = Field(ge=0)
    session_id: str | None = None


class CloseSession(Body):
    session_id: str


class GenerateRequest(Body):
    """SGLang's native /generate body."""

    text: Texts | None = None
    input_ids: TokenIds | None = None
    sampling_params: SamplingParamsField | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    # With return_logprob: the prompt's logprobs from this position on (-1: none).
    logprob_start_len: int = Field(default=-1, ge=-1)
    # With return_logprob: these tokens' logprobs at every position (one list for all
    # prompts, or one per prompt), and each entry's token text.
    token_ids_logprob: Annotated[Any, PlainValidator(_token_lists)] | None = None
    return_text_in_logprobs: bool = False
    rid: Texts | None = None
    priority: int = 0
    extra_key: Texts | None = None  # prefix-cache isolation, as on the OpenAI routes
    # a loaded LoRA adapter's name for all prompts, or one (or null) per prompt
    lora_path: str | list[str | None] | None = None
    # meta_info hidden_states (an --enable-return-hidden-states artefact)
    return_hidden_states: bool = False
    # Accepted and ignored: metric and logging switches (kiln logs no request content).
    log_metrics: bool = True
    no_logs: bool = False
    # Accepted and ignored: the model SGLang's router routes by (it adds the field, with
    # return_bytes and return_entropy at their defaults, to every /generate it forwards).
    model: str | None = None
    # A request in an open session (serve/sessions.py); one prompt only
    session_params: SessionParams | None = None

    REFUSED = {
        "return_bytes": False,
        "return_entropy": False,
        "input_embeds": None,
        "image_data": None,
        "video_data": None,
        "audio_data": None,
        "modalities": None,
        "lora_id": None,
        "custom_logit_processor": None,
        "return_routed_experts": False,
        "bootstrap_host": None,
        "bootstrap_port": None,
        "bootstrap_room": None,
        "routed_dp_rank": None,
        "data_parallel_rank": None,
        "cache_salt": None,
        "background": False,
        "custom_labels": None,
    }


class TokenizeRequest(Body):
    """SGLang's /v1/tokenize body (vLLM's, less its chat form)."""

    model: str = "default"
    prompt: Texts
    add_special_tokens: bool = True


class DetokenizeRequest(Body):
    """SGLang's /v1/detokenize body: ids, or lists of ids (each may be empty)."""

    model: str = "default"
    tokens: Annotated[Any, PlainValidator(_token_lists)]
    skip_special_tokens: bool = True


def _score_items(v: Any) -> Any:
    if isinstance(v, str) or (
        isinstance(v, list) and (all(isinstance(s, str) for s in v) or all(map(_is_ids, v)))
    ):
        return v
    raise ValueError(
        "expected a string, a list of strings or a list of lists of token ids (none empty)"
    )


class ScoreRequest(Body):
    """SGLang's /v1/score body: the probability of each label token right after query +
    item (item + query with item_first), per item."""

    model: str = "default"
    query: str | list[int] | None = None
    items: Annotated[Any, PlainValidator(_score_items)] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False

    @model_validator(mode="after")
    def _complete(self) -> ScoreRequest:
        if self.query is None or self.items is None:
            raise ValueError("query and items are required")
        if not self.label_token_ids:
            raise ValueError("label_token_ids: at least one token id is required")
        text = isinstance(self.query, str)
        items = [self.items] if isinstance(self.items, str) else self.items
        if not items:
            raise ValueError("items: at least one item is required")
        if text != isinstance(items[0], str):
            raise ValueError("query and items: both text or both token ids")
        return self

    def prompts(self) -> list[Any]:
        """Each item's prompt: texts joined as strings, token ids as lists."""
        items: list[Any] = [self.items] if isinstance(self.items, str) else self.items or []
        query: Any = self.query
        return [item + query if self.item_first else query + item for item in items]


class LoadLoraAdapter(Body):
    """SGLang's /load_lora_adapter body: the adapter's name and its PEFT folder."""

    lora_name: str
    lora_path: str
    pinned: bool = False  # every adapter stays loaded until unloaded: accepted


class UnloadLoraAdapter(Body):
    """SGLang's /unload_lora_adapter body."""

    lora_name: str


class AbortRequest(Body):
    """SGLang's /abort_request body: one request's id, or every request."""

    rid: str = ""
    abort_all: bool = False


class PauseGeneration(Body):
    """SGLang's /pause_generation body: what happens to the requests in flight."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ConfigureLogging(Body):
    """SGLang's /configure_logging body: what it sets of request logging (unset: kept).
    SGLang's request dumps (dump_requests_folder, crash_dump_folder: files a request
    would name on the server) are refused."""

    log_requests: bool | None = None
    log_requests_level: Literal[0, 1, 2, 3] | None = None

    REFUSED = {
        "dump_requests_folder": None,
        "dump_requests_threshold": None,
        "crash_dump_folder": None,
    }


class ProfileRequest(Body):
    """SGLang's /start_profile body (runtime/profiler.py)."""

    output_dir: str | None = Field(default=None, max_length=4096)
    start_step: int | None = Field(default=None, ge=0)
    num_steps: int | None = Field(default=None, ge=1)
    activities: list[Literal["CPU", "GPU"]] | None = None
    profile_prefix: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    # Accepted and moot: kiln's trace names each call's op and shapes, and has no stacks.
    with_stack: bool | None = None
    record_shapes: bool | None = None

    REFUSED = {"profile_by_stage": False, "merge_profiles": False, "profile_stages": None}


class UpdateWeightsFromDisk(Body):
    """SGLang's /update_weights_from_disk body (serve/weight_update.py)."""

    model_path: str = Field(min_length=1, max_length=4096)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)
    # Accepted and moot: the new weights are copied into the memory captured CUDA graphs
    # and the native step already read, and no cache of torch's is left to empty.
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False

    # The prefix cache is always dropped (its K/V are the old weights'); the update is
    # always waited for.
    REFUSED = {"flush_cache": True, "is_async": False, "keep_pause": False, "token_step": 0}


class UpdateWeightVersion(Body):
    """SGLang's /update_weight_version body."""

    new_version: str = Field(min_length=1, max_length=256)
    abort_all_requests: bool = True


class ParseFunctionCallRequest(Body):
    """SGLang's /parse_function_call body: model text, the tools it may call, and the
    parser (default: the server's --tool-call-parser)."""

    text: str
    tools: list[Tool] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_call_parser: str | None = None


class SeparateReasoningRequest(Body):
    """SGLang's /separate_reasoning body: model text and the reasoning parser (default: the
    server's --reasoning-parser)."""

    text: str
    reasoning_parser: str | None = None


class EmbeddingRequest(Body):
    """OpenAI's /v1/embeddings body (an embedding model's server)."""

    model: str = "default"
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    # A Matryoshka model's vectors cut to this width (Engine.check_dimensions).
    dimensions: int | None = None
    # Accepted and ignored: who is asking, not what to compute (OpenAI).
    user: str | None = None


class ClassifyRequest(Body):
    """SGLang's /v1/classify body (a sequence classifier's server): one prompt or a batch,
    as text or token ids."""

    model: str = "default"
    input: Prompt
    rid: Texts | None = None
    # Accepted and ignored: who is asking, not what to compute (OpenAI).
    user: str | None = None


class RerankRequest(Body):
    """SGLang's /v1/rerank body (a one-label classifier's server): a query and the
    documents to order by their relevance to it."""

    query: str
    documents: list[str] = Field(min_length=1)  # at most MAX_REQUESTS_PER_CALL (context.py)
    model: str = "default"
    # SGLang's router sends these with every rerank it forwards: false leaves each
    # result's document text out; rid and user are accepted and ignored (as SGLang does)
    return_documents: bool = True
    rid: Texts | None = None
    user: str | None = None


class EncodeRequest(Body):
    """SGLang's native /encode body: text or token ids, one prompt or a batch."""

    text: Texts | None = None
    input_ids: TokenIds | None = None
    rid: Texts | None = None
    dimensions: int | None = None  # as /v1/embeddings'


class ResponsesRequest(Body):
    """OpenAI's /v1/responses body (serve/responses_api.py serves it as a chat completion)."""

    model: str = "default"
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    # SGLang's sampling extensions (its router sends the first five, at their defaults,
    # with every body it forwards), as the chat request's
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int = 0
    stop: Texts | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    extra_key: str | None = None
    cache_salt: str | None = None
    stream: bool | None = False  # null (SGLang's router's when unset): False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    # Kept for GET, continuation and cancel (serve/response_store.py), as OpenAI's default.
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    # Accepted and echoed: metadata, who is asking, how the input is cut (it never is).
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None

    REFUSED = {
        "conversation": None,
        "include": None,
        "reasoning": None,
        "prompt": None,
        "top_logprobs": None,
        "max_tool_calls": None,
        "service_tier": None,
    }
