"""The JSON request bodies of the Tinker API as SDK 0.38 sends them (`tinker/types/*_request.py`).

Fields the service does not use are ignored (the SDK adds fields often; a strict schema would break on
every release); a field it uses with a wrong type is an error naming it (`parse`). `user_metadata` is
kept with the session, or on disk with the run or checkpoint: at most MAX_METADATA_BYTES of JSON.
`ttl_seconds` is from 1 s to ten years.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from colora.service.backend import AdamParams
from colora.service.errors import ApiError

MAX_METADATA_BYTES = 16 << 10
TTL_MAX = 10 * 365 * 86400  # ten years, Tinker's longest ttl_seconds


def _bounded(v):
    if v is not None and len(json.dumps(v)) > MAX_METADATA_BYTES:
        raise ValueError(f"is {len(json.dumps(v))} bytes of JSON; this server keeps at most {MAX_METADATA_BYTES}")
    return v


Metadata = Annotated[Optional[dict[str, Any]], AfterValidator(_bounded)]
StrMetadata = Annotated[Optional[dict[str, str]], AfterValidator(_bounded)]
Ttl = Optional[Annotated[int, Field(ge=1, le=TTL_MAX)]]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(Body):
    tags: list[str] = []
    user_metadata: Metadata = None
    sdk_version: str = ""
    project_id: Optional[str] = None
    display_name: Optional[str] = None


class SessionRef(Body):
    session_id: str


class LoraConfig(Body):
    rank: int = 32
    seed: Optional[int] = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModel(Body):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: Optional[LoraConfig] = None
    optimizer_config: OptimizerConfig = OptimizerConfig()
    user_metadata: Metadata = None


class ModelRef(Body):
    model_id: str


class AdamParamsBody(Body):
    model_config = ConfigDict(extra="forbid")  # a misspelt setting must not silently become its default
    type: Optional[Literal["adamw", "adam"]] = None
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(Body):
    model_id: str
    seq_id: int
    adam_params: Optional[dict[str, Any]] = None
    optim_params: Optional[dict[str, Any]] = None
    optimizer_params: Optional[dict[str, Any]] = None


class SaveWeights(Body):
    model_id: str
    seq_id: int
    path: Optional[str] = None
    overwrite: bool = False
    ttl_seconds: Ttl = None
    user_metadata: StrMetadata = None


class SaveWeightsForSampler(Body):
    model_id: str
    seq_id: int
    path: Optional[str] = None
    sampling_session_seq_id: Optional[int] = None
    kind: str = "snapshot"
    ttl_seconds: Ttl = None
    user_metadata: StrMetadata = None


class SaveWeightsExternal(Body):
    model_id: str
    path: str
    seq_id: Optional[int] = None
    ttl_seconds: Ttl = None
    age_encryption_recipients: Optional[list[str]] = None


class LoadWeights(Body):
    path: str
    optimizer: bool = False
    model_id: Optional[str] = None
    seq_id: Optional[int] = None
    session_id: Optional[str] = None
    model_seq_id: Optional[int] = None
    base_model: Optional[str] = None
    user_metadata: Metadata = None
    optimizer_config: Optional[OptimizerConfig] = None


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: Optional[str] = None
    model_path: Optional[str] = None


class Chunk(Body):
    model_config = ConfigDict(extra="allow")
    type: str = "encoded_text"
    tokens: list[int] = []


class ModelInput(Body):
    chunks: list[Chunk]


class SamplingParams(Body):
    max_tokens: Optional[int] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], list[int], None] = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Sample(Body):
    sampling_session_id: Optional[str] = None
    seq_id: Optional[int] = None
    num_samples: int = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: Optional[str] = None
    model_path: Optional[str] = None
    prompt_logprobs: Optional[bool] = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Optional[Any] = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: Optional[int] = None
    record_stability_info: Optional[bool] = None


class RetrieveFuture(Body):
    request_id: str
    allow_metadata_only: bool = False


class Finish(Body):
    reason: dict[str, Any] = Field(default_factory=dict)
    detail: Optional[str] = None


class WeightsInfo(Body):
    tinker_path: str


class SetTtl(Body):
    ttl_seconds: Optional[int] = None  # its range is checked by the route, which names it


def parse(raw: bytes, model: type[Body]) -> Body:
    """A JSON body as `model`; a 400 naming the first field that does not validate."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        err = e.errors()[0]
        raise ApiError(400, f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']} (in {model.__name__})") \
            from None


def model_and_seq(raw: bytes) -> tuple[str, int] | None:
    """(model_id, seq_id) of a JSON body that has them with the right types, else None: a model's request
    whose body does not validate still takes its seq_id slot when these can be read."""
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        return None
    mid, seq = (data.get("model_id"), data.get("seq_id")) if isinstance(data, dict) else (None, None)
    return (mid, seq) if isinstance(mid, str) and mid and type(seq) is int else None


def adam_params(body: OptimStep) -> AdamParams:
    """The step's AdamParams, checked; ValueError names the field and the value."""
    raw = next((x for x in (body.adam_params, body.optim_params, body.optimizer_params) if x is not None), None)
    if raw is None:
        raise ValueError("optim_step needs adam_params")
    try:
        p = AdamParamsBody.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"adam_params.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    params = AdamParams(**{k: v for k, v in p.model_dump().items() if k != "type"})
    if problem := params.problem():
        raise ValueError(problem)
    return params
