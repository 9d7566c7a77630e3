"""Request bodies of the OpenAI-compatible and native endpoints (pydantic models).

Field names follow the OpenAI API and SGLang's extensions to it, so SGLang and OpenAI
clients work unchanged. Every field a body may carry falls in one of three groups:

- implemented;
- accepted and ignored: only fields OpenAI or SGLang document as not changing the output
  (`user`, `metadata`, `service_tier`, reasoning-parser switches without a parser...);
- known but not implemented (`REFUSED`): a 400 naming them unless left at their default.

Anything else is an unknown field and a 400, on every route alike: a typo in a sampling
parameter must not silently give unconstrained output. Types are strict (no "5" for 5, no
true for 1, no NaN), and text fields may not hold lone surrogates (not Unicode).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, model_validator


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_int(t) for t in v)


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


class Body(BaseModel):
    """Strict, closed request body. `REFUSED`: known fields kiln does not implement."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    REFUSED: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        where = lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where} holds a lone surrogate, which is not valid Unicode")
        return data

    def unsupported(self) -> list[str]:
        """Refused fields given a value other than their default."""
        fields = type(self).model_fields
        return [n for n in self.REFUSED if getattr(self, n) != fields[n].default]


# SGLang extensions both OpenAI routes define and kiln does not implement (yet).
_SGLANG_REFUSED = (
    "regex",
    "ebnf",
    "stop_regex",
    "lora_path",
    "session_id",
    "session_params",
    "custom_params",
    "custom_logit_processor",
    "images_config",
    "return_hidden_states",
    "return_routed_experts",
    "routed_experts_start_len",
    "return_cached_tokens_details",
    "return_token_ids",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
    "data_parallel_rank",
    "extra_key",
    "cache_salt",
    "ngram_corpus_id",
    "custom_labels",
)


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    REFUSED = ("continuous_usage_stats",)


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
    # Accepted and ignored: who is asking, not what to generate (OpenAI).
    user: str | None = None
    # Known, not implemented: defaults accepted, anything else refused (see REFUSED).
    regex: Any = None
    ebnf: Any = None
    stop_regex: Any = None
    lora_path: Any = None
    session_id: Any = None
    session_params: Any = None
    custom_params: Any = None
    custom_logit_processor: Any = None
    images_config: Any = None
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    routed_experts_start_len: Any = 0
    return_cached_tokens_details: Any = False
    return_token_ids: Any = False
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    routed_dp_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    data_parallel_rank: Any = None
    extra_key: Any = None
    cache_salt: Any = None
    ngram_corpus_id: Any = None
    custom_labels: Any = None

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
        }
        return {k: v for k, v in params.items() if v is not None}


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Any = None


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None
    json_schema: Any = None
    response_format: ResponseFormat | None = None

    REFUSED = ("suffix", "json_schema", *_SGLANG_REFUSED)

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.response_format is not None and self.response_format.type != "text":
            out.append(f"response_format {self.response_format.type!r}")
        return out


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_call_id: Any = None
    tool_calls: Any = None

    REFUSED = ("tool_call_id", "tool_calls")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tool_choice: Any = None
    # Accepted and ignored: no effect without tools or a reasoning parser, or metadata.
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    store: bool = False
    modalities: list[Literal["text"]] | None = None
    # Known, not implemented.
    tools: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    reasoning: Any = None
    continue_final_message: Any = False
    return_prompt_token_ids: Any = False
    return_meta_info: Any = False
    input_ids: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    use_audio_in_video: Any = False
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    task: Any = None

    REFUSED = (
        "tools",
        "functions",
        "function_call",
        "reasoning_effort",
        "reasoning",
        "continue_final_message",
        "return_prompt_token_ids",
        "return_meta_info",
        "input_ids",
        "max_dynamic_patch",
        "min_dynamic_patch",
        "use_audio_in_video",
        "audio",
        "prediction",
        "web_search_options",
        "verbosity",
        "task",
        "store",
        *_SGLANG_REFUSED,
    )

    def unsupported(self) -> list[str]:
        out = [n for n in super().unsupported() if n != "tools" or self.tools]
        if self.response_format is not None and self.response_format.type != "text":
            out.append(f"response_format {self.response_format.type!r}")
        if self.tool_choice not in (None, "none", "auto"):
            out.append("tool_choice")
        return out


class GenerateRequest(Body):
    """SGLang's native /generate body."""

    text: Texts | None = None
    input_ids: TokenIds | None = None
    sampling_params: SamplingParamsField | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    rid: Texts | None = None
    priority: int = 0
    # Accepted and ignored: metric and logging switches (kiln logs no request content).
    log_metrics: bool = True
    no_logs: bool = False
    # Known, not implemented.
    logprob_start_len: Any = None
    token_ids_logprob: Any = None
    return_text_in_logprobs: Any = False
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    modalities: Any = None
    lora_path: Any = None
    lora_id: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    extra_key: Any = None
    cache_salt: Any = None
    background: Any = False
    custom_labels: Any = None

    REFUSED = (
        "token_ids_logprob",
        "return_text_in_logprobs",
        "input_embeds",
        "image_data",
        "video_data",
        "audio_data",
        "modalities",
        "lora_path",
        "lora_id",
        "session_params",
        "custom_logit_processor",
        "return_hidden_states",
        "return_routed_experts",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "routed_dp_rank",
        "data_parallel_rank",
        "extra_key",
        "cache_salt",
        "background",
        "custom_labels",
    )

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.logprob_start_len not in (None, -1):
            out.append("logprob_start_len")
        return out
