"""Request bodies of the OpenAI-compatible and native endpoints (pydantic models).

Field names follow the OpenAI API, plus SGLang's extra sampling fields that clients such as
SGLang's bench_serving send (`ignore_eos`, `top_k`, ...). Unknown fields are ignored, as
OpenAI-compatible servers do; wrong types are a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Sampling fields common to completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = "default"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
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
    user: str | None = None
    priority: int = 0  # used with --enable-priority-scheduling

    def unsupported(self) -> list[str]:
        """Fields given with a meaning kiln does not implement: refused, never ignored."""
        return []

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
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


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        return ["suffix"] if self.suffix else []


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    functions: list[dict[str, Any]] | None = None

    def unsupported(self) -> list[str]:
        out = [name for name in ("tools", "functions") if getattr(self, name)]
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(f"response_format {self.response_format.get('type')!r}")
        return out


class GenerateRequest(BaseModel):
    """SGLang's native /generate body."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    rid: str | None = None
    priority: int = 0
