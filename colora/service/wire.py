"""The protobuf routes' messages <-> the backend's numpy dataclasses, with every check of their content.

`parse_forward_backward` splits decoding in two: what identifies the request (model_id, seq_id), which
must decode for the request to exist at all, and its content, whose errors (`InputError`, naming the
field) fail that request in its seq_id slot instead of refusing the POST. A stable_reinforce datum's
provenance (its `model_input_spans` and `loss_fn_input_spans`) is read here and resolved against the
server's records by the service (colora/service/records.py); other losses ignore it. Results are encoded as the
SDK 0.38 reads them (`tinker/proto/response_conv.py`): per-datum arrays concatenated in one
BatchedTensor per field with int64 byte offsets; sampled tokens as int32 bytes, log-probs float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from colora.service import tinker_public_pb2 as pb
from colora.service.backend import (
    LOSS_CONFIG,
    LOSS_INPUTS,
    LOSSES,
    SCORE_WEIGHTED,
    BackendError,
    Capabilities,
    Datum,
    ForwardResult,
    SampleResult,
    scores_weighted,
)
from colora.service.records import Provenance, Span

# every loss the Tinker API names (types/loss_fn_type.py); those outside LOSSES and STABLE are refused by name
TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce", "custom")
_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
# stable_reinforce is served above the backend, as cispo with the ratio clipped to [0, clip_high_threshold]
# against the sampler's log-probs the server recorded (colora/service/service.py): its inputs from the client
# (`logprobs` may be sent too: it is checked and replaced by the recorded ones) and its config. kl_coeff is
# Tinker's; this server adds no KL term, so it takes 0 alone.
STABLE = "stable_reinforce"
STABLE_INPUTS = ("target_tokens", "advantages")
STABLE_CONFIG = {"clip_high_threshold": 2.0, "kl_coeff": 0.0, SCORE_WEIGHTED: 0.0}


class InputError(ValueError):
    """The client's request content is wrong; the message names the field and the value."""


@dataclass(frozen=True)
class ForwardRequest:
    """A decoded forward_backward request; `error` is set (and the rest may be empty) when its content
    is invalid: the request still takes its seq_id slot and fails there."""

    model_id: str
    seq_id: int
    loss_fn: str = ""
    loss_fn_config: dict | None = None
    forward_only: bool = False
    datums: tuple[Datum, ...] = ()
    error: str | None = None
    provenance: tuple[Provenance | None, ...] = ()  # stable_reinforce's, one per datum (None: none sent)


def parse_forward_backward(body: bytes, caps: Capabilities, max_datums: int) -> ForwardRequest:
    """Raises InputError when even model_id / seq_id cannot be read (the POST is refused)."""
    try:
        msg = pb.ForwardBackwardRequest.FromString(body)
    except DecodeError as e:
        raise InputError(f"body is not a ForwardBackwardRequest protobuf ({e})") from None
    if not msg.model_id:
        raise InputError("model_id is missing")
    if msg.seq_id < 1:
        raise InputError(f"seq_id ({msg.seq_id}) must be at least 1")
    try:
        loss_fn, config = _loss(msg, caps)
        if not msg.data:
            raise InputError("data is empty: send at least one datum")
        if len(msg.data) > max_datums:
            raise InputError(f"data has {len(msg.data)} datums, more than this server's max_datums ({max_datums}); "
                             "send fewer per call")
        datums = tuple(_datum(d, i, loss_fn, caps) for i, d in enumerate(msg.data))
        prov = tuple(_provenance(d, f"data[{i}]") for i, d in enumerate(msg.data)) if loss_fn == STABLE else ()
    except InputError as e:
        return ForwardRequest(msg.model_id, msg.seq_id, error=str(e))
    return ForwardRequest(msg.model_id, msg.seq_id, loss_fn, config, bool(msg.forward_only), datums, None, prov)


def _loss(msg, caps: Capabilities) -> tuple[str, dict[str, float]]:
    name = msg.loss_fn
    supported = [x for x in caps.losses if x in LOSSES]  # never more than the losses specified here
    if "cispo" in supported:
        supported.append(STABLE)
    if name not in supported:
        known = "a Tinker loss this server does not support" if name in TINKER_LOSSES else "not a Tinker loss"
        raise InputError(f"loss_fn {name!r} is {known}; supported: {', '.join(supported)}")
    given: dict[str, float] = {}
    if msg.loss_fn_config_v2:
        for key, v in msg.loss_fn_config_v2.items():
            if v.WhichOneof("value") != "number":
                raise InputError(f"loss_fn_config[{key!r}] must be a number, not {v.WhichOneof('value')}")
            given[key] = v.number
    else:
        given = dict(msg.loss_fn_config)
    accepted = STABLE_CONFIG if name == STABLE else LOSS_CONFIG.get(name, {})
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise InputError(f"loss_fn_config key(s) {unknown} are not used by {name}; accepted: {sorted(accepted) or 'none'}")
    config = {**accepted, **given}
    for key, v in config.items():
        if not math.isfinite(v) or v < 0:
            raise InputError(f"loss_fn_config[{key!r}] ({v}) must be a finite number >= 0")
    try:
        scores_weighted(config)
    except BackendError as e:
        raise InputError(str(e)) from None
    if "clip_low_threshold" in config and config["clip_low_threshold"] > config["clip_high_threshold"]:
        raise InputError(f"loss_fn_config clip_low_threshold ({config['clip_low_threshold']}) is above "
                         f"clip_high_threshold ({config['clip_high_threshold']})")
    if name == STABLE:
        if config["kl_coeff"] != 0:
            raise InputError(f"loss_fn_config['kl_coeff'] ({config['kl_coeff']}): this server's stable_reinforce "
                             "has no KL term; send 0 or leave it out (a KL penalty can go into the advantages, "
                             "as the cookbook's kl_penalty_coef does)")
        if config["clip_high_threshold"] < 1:
            raise InputError(f"loss_fn_config['clip_high_threshold'] ({config['clip_high_threshold']}) is "
                             "stable_reinforce's cap on the importance ratio; it must be at least 1 (a cap below 1 "
                             "would shrink the weight of every on-policy token)")
    return name, config


def _datum(d, i: int, loss_fn: str, caps: Capabilities) -> Datum:
    where = f"data[{i}]"
    tokens = tokens_of_chunks(d.model_input, f"{where}.model_input", caps)
    n = len(tokens)
    needed = STABLE_INPUTS if loss_fn == STABLE else LOSS_INPUTS[loss_fn]
    optional = ("logprobs",) if loss_fn == STABLE else ()
    missing = [k for k in needed if k not in d.loss_fn_inputs]
    if missing:
        raise InputError(f"{where}.loss_fn_inputs lacks {missing}: {loss_fn} needs {list(needed)}")
    extra = sorted(set(d.loss_fn_inputs) - set(needed) - set(optional))
    if extra:
        raise InputError(f"{where}.loss_fn_inputs has {extra}, which {loss_fn} does not use; it takes "
                         f"{list(needed + optional)}")
    inputs = {}
    for name in needed + tuple(k for k in optional if k in d.loss_fn_inputs):
        arr = _tensor(d.loss_fn_inputs[name], f"{where}.loss_fn_inputs[{name!r}]", n)
        if name == "target_tokens":
            if arr.dtype.kind != "i":
                raise InputError(f"{where}.loss_fn_inputs['target_tokens'] must be int64, not {arr.dtype}")
            _check_range(arr, f"{where}.loss_fn_inputs['target_tokens']", caps.vocab_size)
            inputs[name] = arr.astype(np.int64)
        else:
            arr = arr.astype(np.float32)
            if not np.isfinite(arr).all():
                raise InputError(f"{where}.loss_fn_inputs[{name!r}] has non-finite values")
            inputs[name] = arr
    return Datum(tokens=tokens, inputs=inputs)


def _provenance(d, where: str) -> Provenance | None:
    """The datum's runs (records.Provenance), None when it has none; offsets and lengths are checked here,
    what they name by the service."""
    if not d.model_input_spans and not d.loss_fn_input_spans:
        return None
    lists = []
    for field in ("model_input_spans", "loss_fn_input_spans"):
        runs = []
        for j, sp in enumerate(getattr(d, field)):
            arm = sp.WhichOneof("span")
            if arm is None:
                raise InputError(f"{where}.{field}[{j}] is empty: a run is prompt_tokens or sampled_tokens")
            run = getattr(sp, arm)
            if run.offset < 0 or run.length < 0 or not run.sequence_id:
                raise InputError(f"{where}.{field}[{j}] has offset {run.offset}, length {run.length} and sequence_id "
                                 f"{run.sequence_id!r}: offset and length must be >= 0, the sequence_id set")
            runs.append(Span(arm == "sampled_tokens", run.sequence_id, run.offset, run.length))
        lists.append(tuple(runs))
    return Provenance(*lists)


def tokens_of_chunks(chunks, where: str, caps: Capabilities) -> np.ndarray:
    """The token ids of a model input's chunks, concatenated (a renderer sends several per prompt)."""
    parts = []
    for j, c in enumerate(chunks):
        kind = c.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InputError(f"{where}[{j}] is a {kind or 'empty'} chunk; this server takes encoded_text only")
        if len(c.encoded_text.tokens) % 4:
            raise InputError(f"{where}[{j}].tokens is {len(c.encoded_text.tokens)} bytes, not int32s")
        parts.append(np.frombuffer(c.encoded_text.tokens, np.int32))
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    check_tokens(tokens, where, caps)
    return tokens


def check_tokens(tokens: np.ndarray, where: str, caps: Capabilities) -> None:
    if len(tokens) == 0:
        raise InputError(f"{where} has no tokens")
    if len(tokens) > caps.max_context:
        raise InputError(f"{where} has {len(tokens)} tokens, more than the model's max context ({caps.max_context})")
    _check_range(tokens, where, caps.vocab_size)


def _check_range(tokens: np.ndarray, where: str, vocab: int) -> None:
    bad = tokens[(tokens < 0) | (tokens >= vocab)]
    if len(bad):
        raise InputError(f"{where} has token id {int(bad[0])}, outside the vocabulary [0, {vocab})")


def _tensor(t, where: str, n: int) -> np.ndarray:
    if t.WhichOneof("encoding") == "sparse_csr":
        raise InputError(f"{where} is sparse (2-D); this server takes 1-D inputs of one value per position")
    if t.dtype not in _NP:
        raise InputError(f"{where} has dtype {pb.DType.Name(t.dtype)}; accepted: FLOAT32, INT64")
    dtype = np.dtype(_NP[t.dtype])
    if len(t.dense) % dtype.itemsize:
        raise InputError(f"{where}: {len(t.dense)} bytes is not a whole number of {dtype} values")
    arr = np.frombuffer(t.dense, dtype)
    shape = list(t.shape) or [len(arr)]
    if int(np.prod(shape)) != len(arr):
        raise InputError(f"{where}: shape {shape} does not match its {len(arr)} values")
    if len(shape) != 1:
        raise InputError(f"{where} has shape {shape}; this server takes 1-D inputs of one value per position")
    if len(arr) != n:
        raise InputError(f"{where} has {len(arr)} values for {n} input tokens; every input has one per token")
    return arr


# -- results ---------------------------------------------------------------------------------------
def encode_forward_output(result: ForwardResult) -> bytes:
    """ForwardBackwardOutput: one ArrayRecord, a BatchedTensor per output field."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.metrics.update({k: float(v) for k, v in result.metrics.items()})
    record = out.loss_fn_outputs.add()
    record.num_datums = len(result.outputs)
    names = list(result.outputs[0]) if result.outputs else []
    for name in names:
        arrays = [np.ascontiguousarray(o[name], np.float32) for o in result.outputs]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype(np.int64)
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_FLOAT32
    return out.SerializeToString()


def forward_output_json(result: ForwardResult) -> dict:
    """The JSON form of ForwardBackwardOutput, for clients that do not ask for protobuf."""
    return {"loss_fn_output_type": "ArrayRecord", "metrics": dict(result.metrics),
            "loss_fn_outputs": [{k: {"data": v.tolist(), "dtype": "float32", "shape": [len(v)]} for k, v in o.items()}
                                for o in result.outputs]}


def encode_sample(result: SampleResult) -> bytes:
    out = pb.SampleResponse()
    for s in result.sequences:
        out.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(s.tokens, np.int32).tobytes(),
                          logprobs=np.asarray(s.logprobs, np.float32).tobytes())
    if result.prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(result.prompt_logprobs, np.float32).tobytes()
    return out.SerializeToString()


def sample_json(result: SampleResult) -> dict:
    def clean(a):
        return [None if math.isnan(x) else float(x) for x in a]

    out = {"type": "sample", "sequences": [{"tokens": s.tokens.tolist(), "logprobs": clean(s.logprobs),
                                            "stop_reason": s.stop_reason} for s in result.sequences]}
    if result.prompt_logprobs is not None:
        out["prompt_logprobs"] = clean(result.prompt_logprobs)
    return out

