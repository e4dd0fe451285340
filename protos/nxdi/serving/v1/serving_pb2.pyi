from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[DType]

class KVQuantization(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_QUANTIZATION_UNSPECIFIED: _ClassVar[KVQuantization]
    KV_QUANTIZATION_NONE: _ClassVar[KVQuantization]
    KV_QUANTIZATION_FP8_E4M3FN: _ClassVar[KVQuantization]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT8_E4M3FN: DType
KV_QUANTIZATION_UNSPECIFIED: KVQuantization
KV_QUANTIZATION_NONE: KVQuantization
KV_QUANTIZATION_FP8_E4M3FN: KVQuantization
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "structured_output", "repetition_penalty", "min_p", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    repetition_penalty: float
    min_p: float
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "regex", "choice", "lark_grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    LARK_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    choice: Choices
    lark_grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., lark_grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class StopCriteria(_message.Message):
    __slots__ = ("max_tokens", "stop_token_ids", "stop_strings", "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    min_tokens: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    def __init__(self, max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function: str
    def __init__(self, mode: _Optional[str] = ..., function: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "prompt_token_ids", "chat", "sampling", "stop", "tools", "tool_choice", "parallel_tool_calls", "truncate_prompt_tokens", "add_generation_prompt", "continue_final_message", "chat_template_kwargs_json", "priority", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    prompt_token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    stop: StopCriteria
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    truncate_prompt_tokens: int
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs_json: str
    priority: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[StopCriteria, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs_json: _Optional[str] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "owned_by", "created_unix_seconds", "max_model_len", "fingerprint")
    ID_FIELD_NUMBER: _ClassVar[int]
    OWNED_BY_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    id: str
    owned_by: str
    created_unix_seconds: int
    max_model_len: int
    fingerprint: ModelFingerprint
    def __init__(self, id: _Optional[str] = ..., owned_by: _Optional[str] = ..., created_unix_seconds: _Optional[int] = ..., max_model_len: _Optional[int] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class PromptTokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "token_id", "text", "logprob", "top_logprobs", "index", "finish_reason", "usage", "prompt_logprobs", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    text: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    finish_reason: FinishReason
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptTokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptTokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stop", "prefill_candidates", "local_prefill_fallback", "priority", "cache_salt", "hold_steps_for_prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    HOLD_STEPS_FOR_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    stop: StopCriteria
    prefill_candidates: _containers.RepeatedScalarFieldContainer[str]
    local_prefill_fallback: bool
    priority: int
    cache_salt: str
    hold_steps_for_prefill: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[StopCriteria, _Mapping]] = ..., prefill_candidates: _Optional[_Iterable[str]] = ..., local_prefill_fallback: _Optional[bool] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., hold_steps_for_prefill: _Optional[bool] = ...) -> None: ...

class ModelFingerprint(_message.Message):
    __slots__ = ("model_name", "num_layers", "num_kv_heads", "head_dim", "dtype", "kv_quantization", "weights_hash")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_HASH_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    kv_quantization: KVQuantization
    weights_hash: str
    def __init__(self, model_name: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., kv_quantization: _Optional[_Union[KVQuantization, str]] = ..., weights_hash: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "fingerprint", "kv_token_start", "head_start", "head_end", "max_chunk_bytes", "accept_kv_socket", "banned_first_token_ids", "priority", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_KV_SOCKET_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    fingerprint: ModelFingerprint
    kv_token_start: int
    head_start: int
    head_end: int
    max_chunk_bytes: int
    accept_kv_socket: bool
    banned_first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., kv_token_start: _Optional[int] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., accept_kv_socket: _Optional[bool] = ..., banned_first_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "cached_prompt_tokens", "compute_ns", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    cached_prompt_tokens: int
    compute_ns: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptTokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., cached_prompt_tokens: _Optional[int] = ..., compute_ns: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptTokenLogprob, _Mapping]]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("request_id", "layer_start", "layer_end", "token_start", "token_end", "head_start", "head_end", "dtype", "k_scale", "v_scale", "k", "v", "crc32c")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    K_SCALE_FIELD_NUMBER: _ClassVar[int]
    V_SCALE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    head_start: int
    head_end: int
    dtype: DType
    k_scale: float
    v_scale: float
    k: bytes
    v: bytes
    crc32c: int
    def __init__(self, request_id: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., k_scale: _Optional[float] = ..., v_scale: _Optional[float] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class KVSocket(_message.Message):
    __slots__ = ("port", "token")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    port: int
    token: bytes
    def __init__(self, port: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("num_chunks", "payload_bytes", "transfer_ns")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_NS_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    payload_bytes: int
    transfer_ns: int
    def __init__(self, num_chunks: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., transfer_ns: _Optional[int] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "kv_chunk", "done", "kv_socket")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    KV_SOCKET_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    kv_chunk: KVChunk
    done: PrefillDone
    kv_socket: KVSocket
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., kv_chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ..., kv_socket: _Optional[_Union[KVSocket, _Mapping]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ("cache_cursor",)
    CACHE_CURSOR_FIELD_NUMBER: _ClassVar[int]
    cache_cursor: CacheCursor
    def __init__(self, cache_cursor: _Optional[_Union[CacheCursor, _Mapping]] = ...) -> None: ...

class CacheCursor(_message.Message):
    __slots__ = ("instance", "seq")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    instance: int
    seq: int
    def __init__(self, instance: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class PrefixCacheReport(_message.Message):
    __slots__ = ("instance", "seq", "snapshot", "stored", "removed")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    instance: int
    seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, instance: _Optional[int] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("role", "address", "fingerprint", "queued_prompt_tokens", "queued_requests", "running_sequences", "max_running_sequences", "kv_blocks_used", "kv_blocks_free", "kv_block_size", "open_transfers", "reported_at_unix_ns", "running_prompt_tokens", "prefill_tokens_per_s", "prefix_cache", "whole_core_prefill_tokens_per_s", "hold_budget_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPEN_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    WHOLE_CORE_PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    HOLD_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    address: str
    fingerprint: ModelFingerprint
    queued_prompt_tokens: int
    queued_requests: int
    running_sequences: int
    max_running_sequences: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_block_size: int
    open_transfers: int
    reported_at_unix_ns: int
    running_prompt_tokens: int
    prefill_tokens_per_s: float
    prefix_cache: PrefixCacheReport
    whole_core_prefill_tokens_per_s: float
    hold_budget_s: float
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., queued_prompt_tokens: _Optional[int] = ..., queued_requests: _Optional[int] = ..., running_sequences: _Optional[int] = ..., max_running_sequences: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., open_transfers: _Optional[int] = ..., reported_at_unix_ns: _Optional[int] = ..., running_prompt_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., prefix_cache: _Optional[_Union[PrefixCacheReport, _Mapping]] = ..., whole_core_prefill_tokens_per_s: _Optional[float] = ..., hold_budget_s: _Optional[float] = ...) -> None: ...
