"""Request bodies of the HTTP API, validated by pydantic: OpenAI's completions and chat
completions, and SGLang's native /generate.

Fields are strict (a string is never taken for a number) and range-checked here, so that a bad
value comes back as a 400 naming the field. Unknown fields are ignored, as OpenAI-compatible
servers do, so that clients sending extra options still work. Parameters that mlaserve does not
implement are accepted only at their neutral value (see `unsupported`).
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TOP_LOGPROBS = 20
MAX_N = 128
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1     # seeds: what a torch.Generator takes


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)            # SGLang/vLLM extension
    min_tokens: int = Field(0, ge=0)                  # vLLM extension
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None           # SGLang/vLLM extension
    ignore_eos: bool = False                          # SGLang/vLLM extension (bench tools)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first parameter set to something mlaserve cannot do."""
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != neutral:
                return name, f"{name} is not supported by mlaserve (only {neutral})"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported by mlaserve"
        return None


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def unsupported(self):
        if self.echo:
            return "echo", "echo is not supported by mlaserve"
        if self.suffix:
            return "suffix", "suffix is not supported by mlaserve"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", f"best_of must equal n ({self.n}) in mlaserve, got {self.best_of}"
        return super().unsupported()


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. Extra keys (name, tool_calls, tool_call_id, reasoning_content...) travel to the
    chat template unchanged."""
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: content parts joined into one string."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            msg["content"] = ""
        return msg


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self):
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", f"response_format {self.response_format.get('type')!r} is not supported"
        if self.add_generation_prompt and self.continue_final_message:
            return "continue_final_message", "continue_final_message needs add_generation_prompt=false"
        return super().unsupported()


class GenerateSamplingParams(_Body):
    """SGLang's `sampling_params` of /generate."""
    max_new_tokens: int | None = Field(128, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(1, ge=1, le=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def unsupported(self):
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != neutral:
                return f"sampling_params.{name}", f"{name} is not supported by mlaserve (only {neutral})"
        return None


class GenerateRequest(_Body):
    """SGLang's /generate: one prompt (`text` or `input_ids`) or a list of them."""
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None

    def unsupported(self):
        return None     # per-prompt sampling_params are checked one by one

    @field_validator("input_ids")
    @classmethod
    def _non_empty(cls, v):
        if v is not None and (len(v) == 0 or any(isinstance(x, list) and not x for x in v)):
            raise ValueError("input_ids must not be empty")
        return v
